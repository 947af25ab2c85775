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

from src.tools.shard_writer import read_captions
from src.tools.synthetic_shapes import BACKGROUNDS, COLOURS, jitter
from src.tools.video_pack import pack_videos

SHAPES = ("circle", "square", "triangle")
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
CAPTIONS = ("a {c} {s} moving {d}", "a {c} {s} that moves {d}", "{c} {s} going {d} on a {b} background")


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


def yuv420p_frame(rgb: np.ndarray):
    """An (H, W, 3) uint8 RGB array as the yuv420p `av.VideoFrame` an H.264 encoder takes, converted with one
    thread. Left to the encoder, the conversion runs PyAV's threaded rescaler (PyAV 17+), whose threads a process
    forked later (a shard writer's pool, a DataLoader's workers) inherits half-copied, and deadlocks in."""
    import av  # the `video` extra

    return av.VideoFrame.from_ndarray(rgb, format="rgb24").reformat(format="yuv420p", threads=1)


def write_clip(path: str, seed: int, frames: int, size: int, fps: int, anywhere: bool = False) -> dict:
    """Encode one clip (H.264 in mp4, via a temporary name) and return its caption row. The shape crosses the
    frame from one edge to the other, along the middle row (or column), or with `anywhere` a random one."""
    import av  # the `video` extra; image-only installs never call this

    rng = random.Random(seed)
    colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
    background, direction = rng.choice(list(BACKGROUNDS)), rng.choice(list(DIRECTIONS))
    dx, dy = DIRECTIONS[direction]
    r = rng.uniform(0.1, 0.16) * size
    travel = size - 2 * r  # the shape crosses the frame from one edge to the other
    fill, back = jitter(COLOURS[colour], rng), jitter(BACKGROUNDS[background], rng)
    # Along the middle, every horizontal path covers the same positions and every vertical one others, so the
    # average of the frames tells the axis of motion; at a random row or column it does not.
    across = r + rng.uniform(0, travel) if anywhere else size / 2
    start_x = across if dx == 0 else (r if dx > 0 else size - r)
    start_y = across if dy == 0 else (r if dy > 0 else size - r)
    tmp = path + ".tmp.mp4"
    with av.open(tmp, mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(frames):
            t = i / (frames - 1)
            frame = draw_frame(size, back, fill, shape, start_x + dx * travel * t, start_y + dy * travel * t, r)
            container.mux(stream.encode(yuv420p_frame(frame)))
        container.mux(stream.encode())
    os.replace(tmp, path)
    caption = rng.choice(CAPTIONS).format(c=colour, s=shape, d=direction, b=background)
    return {"path": os.path.basename(path), "caption": caption, "direction": direction}


def make_synthetic_videos(
    out_dir: str, clips: int, frames: int = 32, size: int = 64, fps: int = 16, seed: int = 0, anywhere: bool = False,
) -> str:
    """Write `clips` mp4 files and `captions.csv` (path, caption, direction) to `out_dir`; returns the CSV path.
    `anywhere`: shapes cross the frame at a random row or column instead of the middle one (see `write_clip`)."""
    if clips < 1 or frames < 2 or size < 16 or size % 2:
        raise ValueError(f"need clips >= 1, frames >= 2 and an even size >= 16; got {clips}, {frames}, {size}")
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, f"clip_{i:06d}.mp4") for i in range(clips)]
    with ProcessPoolExecutor(max_workers=os.cpu_count()) as pool:
        jobs = [pool.submit(write_clip, p, seed * 1_000_003 + i, frames, size, fps, anywhere)
                for i, p in enumerate(paths)]
        rows = [job.result() for job in tqdm(jobs, desc="writing clips", unit="clip")]
    table = os.path.join(out_dir, "captions.csv")
    with open(table + ".tmp", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["path", "caption", "direction"])
        writer.writeheader()
        writer.writerows(rows)
    os.replace(table + ".tmp", table)
    return table


def pack_split(pattern: str, clips: int, *, frames: int, stored: int, size: int, seed: int) -> None:
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
        # At a random row or column, so that averaging the frames tells nothing about the direction.
        table = make_synthetic_videos(raw, clips, frames=frames, size=size, seed=seed, anywhere=True)
        summary = pack_videos(read_captions(table), raw, directory, frames=stored, short_side=size,
                              shard_size=math.ceil(clips / len(urls)))
    if summary.failures or summary.shards != len(urls):
        raise RuntimeError(f"packing synthetic clips into {directory} gave {summary.shards} shards and "
                           f"{len(summary.failures)} failures (see its failures.jsonl)")


def make_synthetic_video_shards(
    train_pattern: str, eval_pattern: str, train_clips: int, eval_clips: int, size: int = 32, seed: int = 0,
    frames: int = 32, stored: int = 16,
) -> None:
    """The generated video dataset (data=synthetic_videos): train and held-out clips of `frames` frames
    (different seeds, so no clip is shared), each packed with `stored` frames at `size` pixels (at least 16,
    even). The held-out split is written last: its sizes.json marks the dataset complete."""
    size = max(16, size + size % 2)
    pack_split(train_pattern, train_clips, frames=frames, stored=stored, size=size, seed=seed)
    pack_split(eval_pattern, eval_clips, frames=frames, stored=stored, size=size, seed=seed + 1_000_003)
