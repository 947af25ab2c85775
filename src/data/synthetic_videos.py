"""Short synthetic video clips of a coloured shape moving in one direction, with captions.

"a red square moving left" and "a red square moving right" show the same frames in opposite order, so a model
that looks at a single frame (or averages frames) cannot tell the captions apart: the direction of motion is
only in the order of the frames. This is the test and demo data of video-language fine-tuning.
"""

from __future__ import annotations

import csv
import os
import random
from concurrent.futures import ProcessPoolExecutor

import av
import numpy as np
from PIL import Image, ImageDraw
from tqdm import tqdm

from src.data.synthetic_shapes import BACKGROUNDS, COLOURS, jitter

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


def write_clip(path: str, seed: int, frames: int, size: int, fps: int) -> dict:
    """Encode one clip (H.264 in mp4, via a temporary name) and return its caption row."""
    rng = random.Random(seed)
    colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
    background, direction = rng.choice(list(BACKGROUNDS)), rng.choice(list(DIRECTIONS))
    dx, dy = DIRECTIONS[direction]
    r = rng.uniform(0.1, 0.16) * size
    travel = size - 2 * r  # the shape crosses the frame from one edge to the other
    start_x = size / 2 if dx == 0 else (r if dx > 0 else size - r)
    start_y = size / 2 if dy == 0 else (r if dy > 0 else size - r)
    fill, back = jitter(COLOURS[colour], rng), jitter(BACKGROUNDS[background], rng)
    tmp = path + ".tmp.mp4"
    with av.open(tmp, mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(frames):
            t = i / (frames - 1)
            frame = draw_frame(size, back, fill, shape, start_x + dx * travel * t, start_y + dy * travel * t, r)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    os.replace(tmp, path)
    caption = rng.choice(CAPTIONS).format(c=colour, s=shape, d=direction, b=background)
    return {"path": os.path.basename(path), "caption": caption, "direction": direction}


def make_synthetic_videos(
    out_dir: str, clips: int, frames: int = 32, size: int = 64, fps: int = 16, seed: int = 0
) -> str:
    """Write `clips` mp4 files and `captions.csv` (path, caption, direction) to `out_dir`; returns the CSV path."""
    if clips < 1 or frames < 2 or size < 16 or size % 2:
        raise ValueError(f"need clips >= 1, frames >= 2 and an even size >= 16; got {clips}, {frames}, {size}")
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, f"clip_{i:06d}.mp4") for i in range(clips)]
    with ProcessPoolExecutor(max_workers=os.cpu_count()) as pool:
        jobs = [pool.submit(write_clip, p, seed * 1_000_003 + i, frames, size, fps) for i, p in enumerate(paths)]
        rows = [job.result() for job in tqdm(jobs, desc="writing clips", unit="clip")]
    table = os.path.join(out_dir, "captions.csv")
    with open(table + ".tmp", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["path", "caption", "direction"])
        writer.writeheader()
        writer.writerows(rows)
    os.replace(table + ".tmp", table)
    return table
