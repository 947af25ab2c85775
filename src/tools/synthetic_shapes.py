"""A small, learnable image-caption dataset: coloured shapes on coloured backgrounds.

Each image shows one shape; its class is (colour, shape), e.g. "red triangle". Captions vary the phrasing
and mention the background, so the text tower has to find the class words. They also say where the shape
sits when it is clearly off-centre ("on the left", "up high"): the words "left", "right", "up" and "down"
then mean something to the quickstart's text tower, which video fine-tuning needs to learn "moving left"
(docs/video.md). The held-out split is written
with class labels in `.json` and a `classes.json` (class names and zero-shot prompt templates), which the
trainer's zero-shot evaluation reads.
"""

from __future__ import annotations

import io
import json
import os
import random
from concurrent.futures import ProcessPoolExecutor

import webdataset as wds
from PIL import Image, ImageDraw
from tqdm import tqdm
from webdataset.shardlists import expand_urls

COLOURS = {
    "red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 80, 220),
    "yellow": (235, 215, 40), "purple": (150, 60, 190),
}
SHAPES = ("circle", "square", "triangle", "cross")
BACKGROUNDS = {"black": (15, 15, 15), "white": (240, 240, 240), "gray": (128, 128, 128), "brown": (110, 70, 40)}
CAPTIONS = (
    "a {c} {s} on a {b} background",
    "a photo of a {c} {s}",
    "{c} {s} in front of a {b} backdrop",
    "a {s} coloured {c}",
    "an image of a {c} {s} on {b}",
    "there is a {c} {s} here",
)
TEMPLATES = ("a photo of a {}.", "a {} on a background.", "an image of a {}.")
CLASSES = [f"{c} {s}" for c in COLOURS for s in SHAPES]


def jitter(colour: tuple[int, int, int], rng: random.Random, amount: int = 20) -> tuple[int, ...]:
    return tuple(max(0, min(255, v + rng.randint(-amount, amount))) for v in colour)


def draw_sample(rng: random.Random, size: int) -> tuple[Image.Image, int, str]:
    label = rng.randrange(len(CLASSES))
    colour, shape = CLASSES[label].split()
    background = rng.choice(list(BACKGROUNDS))
    image = Image.new("RGB", (size, size), jitter(BACKGROUNDS[background], rng))
    draw = ImageDraw.Draw(image)
    r = rng.uniform(0.2, 0.4) * size
    cx, cy = rng.uniform(r, size - r), rng.uniform(r, size - r)
    fill = jitter(COLOURS[colour], rng)
    if shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "square":
        draw.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "triangle":
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    else:
        w = r / 3
        draw.rectangle([cx - r, cy - w, cx + r, cy + w], fill=fill)
        draw.rectangle([cx - w, cy - r, cx + w, cy + r], fill=fill)
    caption = rng.choice(CAPTIONS).format(c=colour, s=shape, b=background)
    return image, label, caption + where(cx / size, cy / size)


def where(x: float, y: float) -> str:
    """Where the shape sits, in words, when it is clearly off-centre: ", on the left, up high" (x, y in 0..1)."""
    words = ""
    for value, (low, high) in ((x, ("on the left", "on the right")), (y, ("up high", "down low"))):
        if value < 0.4:
            words += f", {low}"
        elif value > 0.6:
            words += f", {high}"
    return words


def write_shard(path: str, seed: int, first: int, count: int, size: int) -> int:
    """Write samples first..first+count-1 to one tar, via a temporary name so a crash leaves no half shard."""
    with wds.TarWriter(path + ".tmp") as sink:
        for index in range(first, first + count):
            image, label, caption = draw_sample(random.Random(f"{seed}-{index}"), size)
            buffer = io.BytesIO()
            image.save(buffer, format="JPEG", quality=95)
            sink.write({
                "__key__": f"{index:09d}", "jpg": buffer.getvalue(), "txt": caption,
                "json": {"label": label, "class": CLASSES[label]},
            })
    os.replace(path + ".tmp", path)
    return count


def write_split(urls: list[str], samples: int, seed: int, size: int, desc: str) -> None:
    """Spread `samples` over the shard files `urls` (in parallel) and write `sizes.json` beside them."""
    if samples < len(urls):
        raise ValueError(f"{samples} samples cannot fill {len(urls)} shards: ask for more samples")
    counts = [samples // len(urls) + (i < samples % len(urls)) for i in range(len(urls))]
    firsts = [sum(counts[:i]) for i in range(len(urls))]
    for directory in {os.path.dirname(u) or "." for u in urls}:
        os.makedirs(directory, exist_ok=True)
    with ProcessPoolExecutor(max_workers=os.cpu_count()) as pool:
        jobs = [pool.submit(write_shard, u, seed, f, c, size) for u, f, c in zip(urls, firsts, counts)]
        for job in tqdm(jobs, desc=desc, unit="shard"):
            job.result()
    sizes: dict[str, dict[str, int]] = {}
    for url, count in zip(urls, counts):
        sizes.setdefault(os.path.dirname(url) or ".", {})[os.path.basename(url)] = count
    for directory, entries in sizes.items():
        with open(os.path.join(directory, "sizes.json"), "w") as f:
            json.dump(entries, f, indent=1)


def make_synthetic_shapes(
    train_pattern: str, eval_pattern: str, train_samples: int, eval_samples: int, size: int = 32, seed: int = 0
) -> None:
    """Write the train split and a held-out split drawn with another seed, so no image is shared; the
    held-out directory also gets `classes.json` for zero-shot evaluation."""
    train_urls, eval_urls = expand_urls(train_pattern), expand_urls(eval_pattern)
    if {os.path.dirname(u) for u in train_urls} & {os.path.dirname(u) for u in eval_urls}:
        raise ValueError("train and eval shards must be in different directories (each has its sizes.json)")
    write_split(train_urls, train_samples, seed, size, "writing train shards")
    write_split(eval_urls, eval_samples, seed + 1_000_003, size, "writing eval shards")
    with open(os.path.join(os.path.dirname(eval_urls[0]) or ".", "classes.json"), "w") as f:
        json.dump({"classes": CLASSES, "templates": list(TEMPLATES)}, f, indent=1)
