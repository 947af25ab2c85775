"""Short synthetic video clips of a coloured shape moving in one direction, with captions.

"a red square moving left" and "a red square moving right" show the same frames in opposite order, so a model
that looks at a single frame (or averages frames) cannot tell the captions apart: the direction of motion is
only in the order of the frames. This is the test and demo data of video-language fine-tuning.
"""

from __future__ import annotations

import csv
import math
import os
import random
import tempfile
from concurrent.futures import ProcessPoolExecutor

import numpy as np
from PIL import Image, ImageDraw
from tqdm import tqdm
from webdataset.shardlists import expand_urls

from src.data.shard_writer import read_captions
from src.data.synthetic_shapes import BACKGROUNDS, COLOURS, jitter
from src.data.video_pack import pack_videos

SHAPES = ("circle", "square", "triangle")
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
CAPTIONS = ("a {c} {s} moving {d}", "a {c} {s} that moves {d}", "{c} {s} going {d} on a {b} background")
# Share of the frame the shapes of the fine-tuning dataset cross. Crossing all of it through the middle, a
# horizontal path covers other positions than a vertical one, and averaged frames then give the axis of motion
# away (a mean-pooling model tells horizontal from vertical 85% of the time), which leaves the order of the frames
# only left-or-right to decide (docs/video.md).
TRAVEL = 0.4


def draw_frame(size: int, background, colour, shape: str, cx: float, cy: float, r: float) -> np.ndarray:
    image = Image.new("RGB", (size, size), background)
    draw = ImageDraw.Draw(image)
    if shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=colour)
    elif shape == "square":
        draw.rectangle([cx - r, cy - r, cx + r, cy + r], fill=colour)
    else:
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=colour)
    return np.asarray(image)


def write_clip(path: str, seed: int, frames: int, size: int, fps: int, travel: float = 1.0) -> dict:
    """Encode one clip (H.264 in mp4, via a temporary name) and return its caption row. The shape's centre
    moves `travel` times the distance from one edge to the other: at 1 from edge to edge through the middle,
    below 1 along a shorter path at a random place."""
    import av  # the `video` extra; image-only installs never call this

    rng = random.Random(seed)
    colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
    background, direction = rng.choice(list(BACKGROUNDS)), rng.choice(list(DIRECTIONS))
    dx, dy = DIRECTIONS[direction]
    r = rng.uniform(0.1, 0.16) * size
    span = size - 2 * r  # the centre's range: the shape stays inside the frame
    fill, back = jitter(COLOURS[colour], rng), jitter(BACKGROUNDS[background], rng)
    length = travel * span
    along, across = 0.0, span / 2
    if travel < 1:
        # Which positions a short path covers then says almost nothing about its direction, so a model that
        # averages frames cannot read even the axis of motion from them.
        along, across = rng.uniform(0, span - length), rng.uniform(0, span)
    start = r + along
    start_x = r + across if dx == 0 else (start if dx > 0 else size - start)
    start_y = r + across if dy == 0 else (start if dy > 0 else size - start)
    tmp = path + ".tmp.mp4"
    with av.open(tmp, mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(frames):
            t = i / (frames - 1)
            frame = draw_frame(size, back, fill, shape, start_x + dx * length * t, start_y + dy * length * t, r)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    os.replace(tmp, path)
    caption = rng.choice(CAPTIONS).format(c=colour, s=shape, d=direction, b=background)
    return {"path": os.path.basename(path), "caption": caption, "direction": direction}


def make_synthetic_videos(
    out_dir: str, clips: int, frames: int = 32, size: int = 64, fps: int = 16, seed: int = 0, travel: float = 1.0
) -> str:
    """Write `clips` mp4 files and `captions.csv` (path, caption, direction) to `out_dir`; returns the CSV path.
    `travel` (0 < travel <= 1): the share of the frame each shape crosses (see `write_clip`)."""
    if clips < 1 or frames < 2 or size < 16 or size % 2 or not 0 < travel <= 1:
        raise ValueError(f"need clips >= 1, frames >= 2, an even size >= 16 and 0 < travel <= 1; got {clips}, "
                         f"{frames}, {size}, {travel}")
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, f"clip_{i:06d}.mp4") for i in range(clips)]
    with ProcessPoolExecutor(max_workers=os.cpu_count()) as pool:
        jobs = [pool.submit(write_clip, p, seed * 1_000_003 + i, frames, size, fps, travel)
                for i, p in enumerate(paths)]
        rows = [job.result() for job in tqdm(jobs, desc="writing clips", unit="clip")]
    table = os.path.join(out_dir, "captions.csv")
    with open(table + ".tmp", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["path", "caption", "direction"])
        writer.writeheader()
        writer.writerows(rows)
    os.replace(table + ".tmp", table)
    return table


def pack_split(pattern: str, clips: int, *, frames: int, stored: int, size: int, seed: int, travel: float) -> None:
    """Write `clips` mp4 files to a temporary folder and pack them into the shards that `pattern` names,
    which must be DIR/{00000..N}.tar, the names scripts/pack_videos.py gives."""
    urls = expand_urls(pattern)
    directory = os.path.dirname(urls[0])
    expected = [os.path.join(directory, f"{i:05d}.tar") for i in range(len(urls))]
    if urls != expected:
        raise ValueError(f"{pattern!r}: generated video shards are named DIR/00000.tar, DIR/00001.tar, ...; use "
                         f"a pattern like '{os.path.join(directory, '{00000..' + f'{len(urls) - 1:05d}' + '}.tar')}'")
    if clips < len(urls):
        raise ValueError(f"{clips} clips cannot fill {len(urls)} shards: ask for more clips")
    with tempfile.TemporaryDirectory() as raw:
        table = make_synthetic_videos(raw, clips, frames=frames, size=size, seed=seed, travel=travel)
        summary = pack_videos(read_captions(table), raw, directory, frames=stored, short_side=size,
                              shard_size=math.ceil(clips / len(urls)))
    if summary.failures or summary.shards != len(urls):
        raise RuntimeError(f"packing synthetic clips into {directory} gave {summary.shards} shards and "
                           f"{len(summary.failures)} failures (see its failures.jsonl)")


def make_synthetic_video_shards(
    train_pattern: str, eval_pattern: str, train_clips: int, eval_clips: int, size: int = 32, seed: int = 0,
    frames: int = 32, stored: int = 16, travel: float = TRAVEL,
) -> None:
    """The generated video dataset (data=synthetic_videos): train and held-out clips of `frames` frames
    (different seeds, so no clip is shared), each packed with `stored` frames at `size` pixels (at least 16,
    even). The held-out split is written last: its sizes.json marks the dataset complete."""
    size = max(16, size + size % 2)
    pack_split(train_pattern, train_clips, frames=frames, stored=stored, size=size, seed=seed, travel=travel)
    pack_split(eval_pattern, eval_clips, frames=frames, stored=stored, size=size, seed=seed + 1_000_003,
               travel=travel)
