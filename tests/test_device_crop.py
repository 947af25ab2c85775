"""data.resize_on=device: the workers ship canvases and crop boxes, the training device resizes them. The crops
against the workers' own (exact where the worker resizes, within a fraction of a grey level where the device
does), the same samples and boxes from the loader, what `auto` picks and why, preflight's refusals, and a
training run on a CPU."""

import random
from dataclasses import replace

import pytest
import torch
from skimage import data as photos
from torchvision.transforms import InterpolationMode
from torchvision.transforms.v2 import functional as TF

from src.data.device_crop import canvas_side, place_crop, resize_crops, resolve_resize_on
from src.data.image_text import random_resized_crop_box
from src.data.loader import TrainLoader
from src.parallel.distributed import DistInfo
from src.trainer.preflight import preflight
from tests.conftest import compose_config, small_trainer
from tests.test_data import data_config

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)
BILINEAR = InterpolationMode.BILINEAR


def photo(height: int, width: int) -> torch.Tensor:
    """A real photograph (sharp edges, texture) as uint8 (3, height, width)."""
    image = torch.from_numpy(photos.astronaut()).permute(2, 0, 1)
    return TF.resize(image, [height, width], antialias=True)


def workers_crop(image: torch.Tensor, box: tuple[int, int, int, int], size: int) -> torch.Tensor:
    return TF.resized_crop(image, *box, [size, size], interpolation=BILINEAR, antialias=True)


def device_crops(image: torch.Tensor, boxes: list[tuple[int, int, int, int]], size: int, canvas: int) -> torch.Tensor:
    placed = [place_crop(image, box, size, canvas, BILINEAR) for box in boxes]
    return resize_crops(torch.stack([c for c, _ in placed]), torch.stack([b for _, b in placed]), size)


def test_random_crops_of_a_256_px_photo_are_within_a_fraction_of_a_grey_level_of_the_workers():
    image, rng = photo(256, 232), random.Random(0)
    boxes = [random_resized_crop_box(232, 256, rng, (0.5, 1.0)) for _ in range(24)]
    ours = device_crops(image, boxes, 224, 256).int()
    theirs = torch.stack([workers_crop(image, box, 224) for box in boxes]).int()
    diff = (ours - theirs).abs().float()
    assert ours.shape == (24, 3, 224, 224)
    # Bilinear point samples against a triangle filter as wide as the scale (at most 8/7 here): edges differ.
    assert diff.mean() < 0.4, diff.mean()
    assert diff.quantile(0.999) <= 8, diff.quantile(0.999)
    assert (diff > 2).float().mean() < 0.01


def test_every_crop_of_a_256_px_image_goes_to_the_device_with_the_default_canvas():
    """img2dataset's default images are 256 px: with the default canvas (8/7 of 224 and a border) every crop of
    one, the whole image included (torchvision's fallback when no drawn box fits), is resized on the device."""
    side = canvas_side(compose_config([]).data, 224)
    image, rng = photo(256, 256), random.Random(0)
    boxes = [random_resized_crop_box(256, 256, rng, (0.9, 1.0)) for _ in range(64)]
    assert side == 258 and (0, 0, 256, 256) in boxes
    placed = [place_crop(image, box, 224, side, BILINEAR) for box in boxes]
    identity = torch.tensor([0.0, 0.0, 224.0, 224.0])  # the box of a crop the worker resized itself
    assert not any(torch.equal(box, identity) for _, box in placed)
    ours = resize_crops(torch.stack([c for c, _ in placed]), torch.stack([b for _, b in placed]), 224).int()
    diff = (ours - torch.stack([workers_crop(image, box, 224) for box in boxes]).int()).abs().float()
    # Near 8/7 of the output a bilinear point sample and torchvision's filter differ most (about 0.6 of a grey
    # level on average on this sharp photograph). The crops of 255 and 256 px a side, which a 256-px canvas left
    # to the workers, differ no more than the smaller ones it already took.
    wide = torch.tensor([max(box[2:]) >= 255 for box in boxes])
    assert wide.any() and (~wide).any()
    assert diff[wide].mean() < diff[~wide].mean() + 0.1 and diff.mean() < 0.7, (diff[wide].mean(), diff.mean())


def test_an_enlarged_crop_matches_the_workers_to_one_grey_level_also_at_the_images_edges():
    image = photo(200, 180)
    # Smaller than the output (upsampled, where the filters agree), at each corner and inside.
    boxes = [(0, 0, 150, 120), (50, 60, 150, 120), (30, 10, 100, 160), (0, 20, 200, 140)]
    ours = device_crops(image, boxes, 224, 256).int()
    theirs = torch.stack([workers_crop(image, box, 224) for box in boxes]).int()
    # Inside the image the crop's border interpolates with the real neighbours, where torchvision repeats the
    # crop's edge: that touches the first and last output rows and columns only.
    diff = (ours - theirs).abs()
    assert diff[..., 1:-1, 1:-1].max() <= 1
    assert diff.max() > 1  # (those border pixels do differ)
    # At the image's own edges the edge is repeated, as torchvision does: the first crop's top row and left
    # column, the last crop's top and bottom rows.
    assert diff[0, :, :-1, :-1].max() <= 1
    assert diff[3, :, :, 1:-1].max() <= 1


def test_a_crop_too_large_for_the_canvas_is_resized_in_the_worker_and_copied_exactly():
    image = photo(600, 480)
    boxes = [(10, 20, 500, 400), (0, 0, 600, 480), (100, 50, 300, 260)]
    ours = device_crops(image, boxes, 224, 256)
    assert torch.equal(ours, torch.stack([workers_crop(image, box, 224) for box in boxes]))


def test_the_loader_ships_the_same_samples_and_crops_as_canvases(shapes):
    cfg = data_config(shapes["shards"], 16, 0)
    plain = TrainLoader(cfg, image_size=32, context_length=16, seed=3)
    canvased = TrainLoader(cfg, image_size=32, context_length=16, seed=3, canvas=36)
    for _ in range(3):
        a, b = next(plain), next(canvased)
        assert a["keys"] == b["keys"] and torch.equal(a["tokens"], b["tokens"]) and a["position"] == b["position"]
        assert "boxes" not in a and b["images"].shape == (16, 3, 36, 36) and b["boxes"].shape == (16, 4)
        diff = (resize_crops(b["images"], b["boxes"], 32).int() - a["images"].int()).abs().float()
        assert diff.mean() < 1.0, diff.mean()


def test_auto_resizes_on_a_gpu_and_says_why_not_elsewhere():
    data = compose_config([]).data
    assert resolve_resize_on(data, 224, CUDA) == (
        258, "data: crops up to 256 px a side resized on the cuda (auto: on a GPU), larger ones in the workers")
    canvas, line = resolve_resize_on(data, 224, CPU)
    assert canvas == 0 and "auto: on cpu" in line
    for change, reason in ((dict(color_jitter=0.4), "colour jitter"), (dict(grayscale_prob=0.2), "grayscale"),
                           (dict(interpolation="bicubic"), "data.interpolation=bicubic"),
                           (dict(frames=8), "video clips")):
        canvas, line = resolve_resize_on(replace(data, **change), 224, CUDA)
        assert canvas == 0 and reason in line
    assert resolve_resize_on(replace(data, resize_on="workers"), 224, CUDA)[0] == 0
    assert resolve_resize_on(replace(data, resize_on="device", device_resize_max_side=300), 224, CPU)[0] == 300


def test_preflight_refuses_device_resizing_it_cannot_do(tmp_path):
    cfg = compose_config(["experiment=quickstart", "data.resize_on=device", "data.color_jitter=0.4",
                          "data.device_resize_max_side=10"])
    with pytest.raises(ValueError, match="the configuration cannot run") as err:
        preflight(cfg, DistInfo(0, 1, 0, CPU), str(tmp_path))
    assert "data.resize_on=device cannot apply here: colour jitter" in str(err.value)
    assert "data.device_resize_max_side must be at least model.vision.image_size" in str(err.value)


def test_a_cpu_run_with_device_resizing_trains_on_the_resized_crops(shapes, tmp_path):
    trainer = small_trainer(shapes, tmp_path / "run", "data.resize_on=device")
    batch = next(trainer.loader)
    assert batch["images"].shape[-1] == 38 and "boxes" in batch  # the quickstart's 32 px: 8/7 of it and a border
    losses = [trainer.train_step(next(trainer.loader))["loss"].item() for _ in range(3)]
    assert all(torch.isfinite(torch.tensor(losses)))
