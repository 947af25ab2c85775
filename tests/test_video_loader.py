import io
import random
import tarfile
from dataclasses import replace

import pytest
import torch
import webdataset as wds
from PIL import Image

from src.config import DataConfig
from src.data.image_text import Preprocess
from src.data.loader import TrainLoader, eval_batches
from src.data.video_text import TooFewFrames, decode_clip, segment_indices
from src.tools.shard_writer import read_captions
from src.tools.synthetic_videos import make_synthetic_videos
from src.tools.video_pack import pack_videos
from tests.conftest import compose_config

PREPROCESS = Preprocess.from_config(compose_config([]).data)  # the default resize, no augmentation


@pytest.fixture(scope="module")
def clip_shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("clips")
    table = make_synthetic_videos(str(root / "videos"), clips=8, frames=24, size=48)
    summary = pack_videos(read_captions(table), str(root / "videos"), str(root / "shards"), frames=8, short_side=40,
                          shard_size=2, workers=2)
    return summary.pattern


def video_config(pattern: str, frames: int = 4) -> DataConfig:
    return replace(compose_config(["data=laion_wds"]).data, name="video", shards=pattern, batch_size=4, num_workers=0,
                   shuffle_buffer=2, frames=frames)


def test_loader_yields_uint8_clips(clip_shards):
    pattern = clip_shards
    loader = TrainLoader(video_config(pattern), image_size=32, context_length=16, seed=0)
    batch = next(loader)
    assert batch["images"].shape == (4, 4, 3, 32, 32) and batch["images"].dtype == torch.uint8
    assert batch["tokens"].shape == (4, 16)
    evaluation = next(eval_batches(pattern, batch_size=8, image_size=32, context_length=16, num_workers=0, frames=4,
                                   preprocess=PREPROCESS))
    assert evaluation["images"].shape == (8, 4, 3, 32, 32)


def test_segments_differ_across_epochs_in_training_and_not_in_eval():
    draws = {tuple(segment_indices(16, 4, random.Random(f"crop-0-{epoch}-key"))) for epoch in range(8)}
    assert len(draws) > 1
    assert all(i * 4 <= index < (i + 1) * 4 for draw in draws for i, index in enumerate(draw))
    assert segment_indices(16, 4, None) == segment_indices(16, 4, None) == [1, 5, 9, 13]


def jpeg(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=95)
    return buffer.getvalue()


def test_one_crop_and_flip_per_clip():
    """With identical stored frames, a per-frame crop or flip would make the output frames differ."""
    torch.manual_seed(0)
    frame = jpeg(Image.fromarray(torch.randint(0, 255, (48, 64, 3), dtype=torch.uint8).numpy()))
    sample = {"__key__": "k", **{f"f{i:03d}.jpg": frame for i in range(8)}}
    clips = [decode_clip(sample, 4, 32, random.Random(seed), 0.3, None, preprocess=PREPROCESS) for seed in range(6)]
    for clip in clips:
        assert all(torch.equal(clip[0], clip[t]) for t in range(1, 4))
    assert len({c.sum().item() for c in clips}) > 1  # while the crops themselves differ between clips


def test_too_few_stored_frames_is_a_clear_error(clip_shards):
    loader = TrainLoader(video_config(clip_shards, frames=16), image_size=32, context_length=16, seed=0)
    with pytest.raises(TooFewFrames, match="stores 8 frames but data.frames=16"):
        next(loader)


@pytest.fixture(scope="module")
def mp4_shard(tmp_path_factory):
    """video2dataset's layout: the mp4 file itself in the shard, decoded by the loader."""
    root = tmp_path_factory.mktemp("mp4")
    make_synthetic_videos(str(root / "videos"), clips=6, frames=24, size=48)
    path = str(root / "mp4-00000.tar")
    with wds.TarWriter(path) as sink:
        for i in range(6):
            data = (root / "videos" / f"clip_{i:06d}.mp4").read_bytes()
            sink.write({"__key__": f"{i:09d}", "mp4": data if i != 2 else data[:300], "txt": f"clip {i}"})
    return path


def test_mp4_in_shard_clips_decode_in_the_loader(mp4_shard):
    cfg = replace(compose_config(["data=laion_wds"]).data, name="v", shards=mp4_shard, batch_size=5, num_workers=0,
                  shuffle_buffer=1, frames=4)
    loader = TrainLoader(cfg, image_size=32, context_length=16, seed=0)
    batch = next(loader)
    assert batch["images"].shape == (5, 4, 3, 32, 32) and "000000002" not in batch["keys"]
    assert loader.bad_counts() == {"corrupt_image": 1}  # the truncated mp4


def test_mp4_eval_frames_are_fixed_and_move(mp4_shard):
    with tarfile.open(mp4_shard) as tar:
        data = tar.extractfile("000000000.mp4").read()
    sample = {"__key__": "000000000", "mp4": data}
    first = decode_clip(sample, 4, 32, None, 1.0, None, preprocess=PREPROCESS)
    again = decode_clip(sample, 4, 32, None, 1.0, None, preprocess=PREPROCESS)
    assert torch.equal(first, again) and not torch.equal(first[0], first[-1])  # the shape moved between frames
