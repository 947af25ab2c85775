"""One clip in, a (T, 3, H, W) uint8 tensor of T frames out: from a packed clip (K JPEG frames, the fast path)
or from a video file stored in the shard (video2dataset's `{key}.mp4`, decoded here; for users who cannot
pre-extract frames).

Frames are chosen TSN-style: the K stored frames are cut into T equal segments, and training takes a random
frame from each segment (so each epoch sees different frames of the same clip), evaluation the middle one.
For a video file the segments are cut in time over its duration instead.
One random resized crop and one horizontal flip are drawn per clip and applied to all its frames, so the
motion between frames is preserved; so are the colour jitter and grayscale when they are on (`Preprocess`, with the
image path's interpolation and resize mode; the device normalizes with the same mean and std).
"""

from __future__ import annotations

import io
import random
import re

import torch
from torchvision.transforms.v2 import functional as TF

from src.data.image_text import Preprocess, check_pixels, crop, load_rgb, random_resized_crop_box

FRAME_MEMBER = re.compile(r"^f(\d{3})\.jpg$")
VIDEO_MEMBERS = ("mp4", "webm", "mkv", "avi", "mov")


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


def segment_times(duration: float, frames: int, rng: random.Random | None) -> list[float]:
    """One time per equal segment of [0, duration): random within it in training, its middle in evaluation."""
    width = duration / frames
    return [(i + (rng.random() if rng is not None else 0.5)) * width for i in range(frames)]


def video_frames(data: bytes, frames: int, rng: random.Random | None, max_pixels: int | None) -> torch.Tensor:
    """(T, 3, H, W) uint8: the frame at or after each segment time. One seek to the keyframe before the first
    time, then decoding forward: targets only increase, and training clips are short."""
    import av  # the `video` extra: only mp4-in-shard clips need PyAV, packed frames and images do not

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        stream.codec_context.thread_count = 1  # PyAV's default (all cores) has deadlocked next to DataLoader
        check_pixels(stream.codec_context.width, stream.codec_context.height, max_pixels)  # from the header
        duration = float(stream.duration * stream.time_base) if stream.duration else container.duration / 1e6
        targets = segment_times(duration, frames, rng)
        container.seek(int(targets[0] / stream.time_base), stream=stream, backward=True)
        picked = []
        for frame in container.decode(stream):
            while len(picked) < frames and frame.time is not None and frame.time >= targets[len(picked)]:
                # One scaling thread, like the decoder: PyAV's threaded rescaler (17+) deadlocks forked workers.
                picked.append(TF.pil_to_tensor(frame.to_image(threads=1)))
            if len(picked) == frames:
                break
    if not picked:
        raise ValueError("no decodable frame in the video")
    picked += picked[-1:] * (frames - len(picked))  # a clip ending early repeats its last frame
    return torch.stack(picked)


def decode_clip(
    sample: dict, frames: int, size: int, rng: random.Random | None, scale_min: float, max_pixels: int | None,
    flip: bool = True, *, preprocess: Preprocess,
) -> torch.Tensor:
    """(frames, 3, size, size) uint8; OversizedImage when a frame has more than `max_pixels` pixels."""
    video = next((sample[ext] for ext in VIDEO_MEMBERS if ext in sample), None)
    if video is not None and not any(FRAME_MEMBER.match(name) for name in sample):
        clip = video_frames(video, frames, rng, max_pixels)
    else:
        stored = frame_members(sample)
        clip = torch.stack([load_rgb(stored[i], size, max_pixels) for i in segment_indices(len(stored), frames, rng)])
    if rng is None:
        return crop(clip, size, None, preprocess)
    height, width = clip.shape[-2:]
    clip = crop(clip, size, random_resized_crop_box(width, height, rng, (scale_min, 1.0)), preprocess)
    # A caption that names left or right is wrong for a mirrored clip: data.hflip=false turns flips off.
    clip = clip.flip(-1) if flip and rng.random() < 0.5 else clip
    return preprocess.augment(clip, rng)
