"""data.image_mean/std, data.interpolation, data.resize_mode, data.color_jitter(_prob), data.grayscale_prob."""

import io
import random
from dataclasses import replace

import numpy as np
import open_clip
import pytest
import torch
from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD
from PIL import Image
from torchvision.transforms import InterpolationMode
from torchvision.transforms.v2 import functional as TF

from src.data.image_text import Preprocess, decode_image, random_resized_crop_box
from src.data.loader import TrainLoader, eval_batches
from src.data.video_text import decode_clip
from src.trainer.preflight import range_problems
from src.trainer.trainer import image_normalizer
from tests.conftest import compose_config


def png(width: int, height: int, seed: int = 0) -> bytes:
    """A blocky random image (8-pixel squares), so that resampling differences stay small and meaningful."""
    rng = np.random.default_rng(seed)
    pixels = np.kron(rng.integers(0, 256, (height // 8, width // 8, 3)), np.ones((8, 8, 1))).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def preprocess(*overrides: str) -> Preprocess:
    return Preprocess.from_config(compose_config(list(overrides)).data)


def test_the_default_mean_and_std_are_openai_clips_and_normalize_on_the_device():
    data = compose_config([]).data
    assert tuple(data.image_mean) == OPENAI_DATASET_MEAN and tuple(data.image_std) == OPENAI_DATASET_STD
    images = torch.tensor([0, 51, 255], dtype=torch.uint8).view(1, 3, 1, 1).expand(2, 3, 2, 2)
    siglip = compose_config(["precision=fp32", "data.image_mean=[0.5,0.5,0.5]", "data.image_std=[0.5,0.5,0.5]"])
    out = image_normalizer(siglip, torch.device("cpu"))(images)
    assert out.dtype == torch.float32
    assert out[0, :, 0, 0].tolist() == pytest.approx([-1.0, 51 / 127.5 - 1, 1.0], abs=1e-6)


@pytest.mark.parametrize("interpolation", ["bicubic", "bilinear"])
@pytest.mark.parametrize("resize_mode, openclip_mode", [("crop", "shortest"), ("squash", "squash")])
def test_evaluation_takes_openclips_deterministic_transform(interpolation, resize_mode, openclip_mode):
    data = png(64, 40)
    ours = decode_image(data, 24, None, 1.0, None, preprocess=preprocess(
        f"data.interpolation={interpolation}", f"data.resize_mode={resize_mode}", "data.color_jitter=0.4",
        "data.grayscale_prob=1.0"))  # augmentation is training's only
    # OpenCLIP's eval transform with the normalization undone (mean 0, std 1/255): PIL's resampling, on floats.
    theirs = open_clip.image_transform(24, is_train=False, resize_mode=openclip_mode, interpolation=interpolation,
                                       mean=(0.0, 0.0, 0.0), std=(1 / 255,) * 3)(Image.open(io.BytesIO(data)))
    assert ours.shape == theirs.shape == (3, 24, 24)
    difference = (ours.float() - theirs).abs()
    assert difference.max() <= 2 and difference.mean() < 0.1  # the same pixels, up to 8-bit rounding
    other = decode_image(data, 24, None, 1.0, None, preprocess=preprocess(
        f"data.interpolation={interpolation}", f"data.resize_mode={'crop' if resize_mode == 'squash' else 'squash'}"))
    assert (other.float() - theirs).abs().mean() > 5  # a 64 x 40 image: squashing and cropping differ


def test_training_crops_resample_with_the_chosen_interpolation():
    data, box_seed = png(64, 48), "crop-key"
    crops = {}
    for mode in ("bilinear", "bicubic"):
        crops[mode] = decode_image(data, 24, random.Random(box_seed), 0.5, None,
                                   preprocess=preprocess(f"data.interpolation={mode}"))
    box = random_resized_crop_box(64, 48, random.Random(box_seed), (0.5, 1.0))
    image = TF.pil_to_tensor(Image.open(io.BytesIO(data)).convert("RGB"))
    want = TF.resized_crop(image, *box, [24, 24], interpolation=InterpolationMode.BICUBIC, antialias=True)
    assert torch.equal(crops["bicubic"], want)
    assert not torch.equal(crops["bicubic"], crops["bilinear"])


def test_colour_jitter_and_grayscale_follow_openclips_semantics():
    buffer = io.BytesIO()  # a uniform grey image: contrast and saturation leave it alone, brightness scales it
    Image.new("RGB", (32, 32), (100, 100, 100)).save(buffer, format="PNG")
    gray = buffer.getvalue()
    jitter = preprocess("data.color_jitter=0.4", "data.color_jitter_prob=1.0")
    factors = [decode_image(gray, 16, random.Random(seed), 1.0, None, preprocess=jitter).float().mean().item() / 100
               for seed in range(40)]
    assert 0.6 - 0.01 <= min(factors) < 0.75 and 1.25 < max(factors) <= 1.4 + 0.01  # factors in [1 - s, 1 + s]
    again = [decode_image(gray, 16, random.Random(seed), 1.0, None, preprocess=jitter).float().mean().item() / 100
             for seed in range(40)]
    assert again == factors  # drawn from the sample's RNG: a resumed run draws the same
    sometimes = preprocess("data.color_jitter=0.4", "data.color_jitter_prob=0.5")
    jittered = sum(decode_image(gray, 16, random.Random(seed), 1.0, None, preprocess=sometimes).float().mean() != 100
                   for seed in range(200))
    assert 70 < jittered < 130  # about half: color_jitter_prob=0.5

    colour = png(32, 32, seed=1)
    grayed = decode_image(colour, 16, random.Random(0), 1.0, None, preprocess=preprocess("data.grayscale_prob=1.0"))
    assert torch.equal(grayed[0], grayed[1]) and torch.equal(grayed[1], grayed[2])
    kept = decode_image(colour, 16, random.Random(0), 1.0, None, preprocess=preprocess())
    assert torch.equal(grayed, TF.rgb_to_grayscale(kept, num_output_channels=3))  # the same crop, then grayscale
    partly = preprocess("data.grayscale_prob=0.3")
    half = sum(not torch.equal(x[0], x[1]) for x in (
        decode_image(colour, 16, random.Random(seed), 1.0, None, preprocess=partly) for seed in range(200)))
    assert 110 < half < 170  # about 70% keep their colour


def test_a_clip_is_jittered_and_grayed_as_one(tmp_path):
    frame = png(40, 32, seed=2)
    clip = {"__key__": "clip", **{f"f{i:03d}.jpg": frame for i in range(4)}}
    both = preprocess("data.color_jitter=0.4", "data.color_jitter_prob=1.0", "data.grayscale_prob=1.0")
    frames = decode_clip(clip, 4, 16, random.Random(3), 0.5, None, preprocess=both)
    assert frames.shape == (4, 3, 16, 16)
    assert all(torch.equal(frames[0], f) for f in frames[1:])  # one draw for all frames: motion is preserved
    assert torch.equal(frames[:, 0], frames[:, 2])


def test_the_loader_augments_training_batches_only(shapes):
    cfg = replace(compose_config(["experiment=quickstart", "data.grayscale_prob=1.0"]).data, shards=shapes["shards"],
                  batch_size=8, num_workers=0, shuffle_buffer=8)
    batch = next(TrainLoader(cfg, image_size=32, context_length=16, seed=0))["images"]
    assert torch.equal(batch[:, 0], batch[:, 1]) and torch.equal(batch[:, 1], batch[:, 2])
    held_out = next(eval_batches(shapes["eval_shards"], batch_size=8, image_size=32, context_length=16,
                                 num_workers=0, preprocess=Preprocess.from_config(cfg)))["images"]
    assert not torch.equal(held_out[:, 0], held_out[:, 1])  # coloured shapes, left in colour


def test_preflight_refuses_preprocessing_values_out_of_range():
    cfg = compose_config(["data.image_std=[0.5,0.0,0.5]", "data.image_mean=[0.5,0.5]", "data.color_jitter=1.5",
                          "data.grayscale_prob=-0.1", "data.color_jitter_prob=2"])
    problems = "\n".join(range_problems(cfg))
    for key in ("data.image_std=[0.5, 0.0, 0.5]", "data.image_mean=[0.5, 0.5]", "data.color_jitter=1.5",
                "data.grayscale_prob=-0.1", "data.color_jitter_prob=2.0"):
        assert f"{key} is out of range" in problems, key
    assert "three finite numbers above 0 (R, G, B)" in problems
