"""One packed clip (K JPEG frames + caption) in, a (T, 3, H, W) uint8 tensor of T frames out.

Frames are chosen TSN-style: the K stored frames are cut into T equal segments, and training takes a random
frame from each segment (so each epoch sees different frames of the same clip), evaluation the middle one.
One random resized crop and one horizontal flip are drawn per clip and applied to all its frames, so the
motion between frames is preserved.
"""

from __future__ import annotations

import random
import re

import torch

from src.data.image_text import crop, load_rgb, random_resized_crop_box

FRAME_MEMBER = re.compile(r"^f(\d{3})\.jpg$")


class TooFewFrames(ValueError):
    """The shards store fewer frames per clip than data.frames asks for: a setup error, not bad data."""


def frame_members(sample: dict) -> list[bytes]:
    """The stored frames of a sample, in time order."""
    names = sorted(name for name in sample if FRAME_MEMBER.match(name))
    if not names:
        raise KeyError(f"sample {sample.get('__key__')!r} has no frames (f000.jpg, f001.jpg, ...)")
    return [sample[name] for name in names]


def segment_indices(stored: int, frames: int, rng: random.Random | None) -> list[int]:
    """One index per segment of [0, stored): random within it in training, its middle in evaluation."""
    if stored < frames:
        raise TooFewFrames(f"the clip stores {stored} frames but data.frames={frames}: repack with more frames "
                         "(scripts/pack_videos.py --frames) or lower data.frames")
    bounds = [(i * stored // frames, (i + 1) * stored // frames - 1) for i in range(frames)]
    return [rng.randint(lo, hi) if rng is not None else (lo + hi) // 2 for lo, hi in bounds]


def decode_clip(sample: dict, frames: int, size: int, rng: random.Random | None, scale_min: float) -> torch.Tensor:
    stored = frame_members(sample)
    clip = torch.stack([load_rgb(stored[i], size) for i in segment_indices(len(stored), frames, rng)])
    if rng is None:
        return crop(clip, size, None)
    height, width = clip.shape[-2:]
    clip = crop(clip, size, random_resized_crop_box(width, height, rng, (scale_min, 1.0)))
    return clip.flip(-1) if rng.random() < 0.5 else clip
