"""Training-loader throughput on the CPU: our `TrainLoader` against OpenCLIP's webdataset pipeline.

    python bench/loader.py                                     # 512 images, workers 0 1 2, 20 s each
    python bench/loader.py --images 128 --seconds 5 --workers 0 1 --json /tmp/loader.json
    python bench/loader.py --long-side 256 384                 # LAION pre-resized to 256 px (img2dataset's default)

1. Builds (once, cached under --out-dir) a shard set of real-sized JPEGs: scikit-image's colour sample
   photographs, randomly cropped, flipped and resized to 512-1024 px on the long side (--long-side; fixed
   seed), saved as JPEG quality 90 with a caption each, and packed by our `src.tools.shard_writer.make_shards`.
   Both loaders read these very same tar files.
2. Measures images/s of
   - ours: `TrainLoader` (epoch mode, single rank, image_size 224, context_length 77, --shuffle-buffer);
     batches hold uint8 (B, 3, 224, 224) images: normalization happens later, on the training device;
   - OpenCLIP: `open_clip_train.data.get_wds_dataset` on the same shards, with OpenCLIP's default train
     transform `open_clip.image_transform(224, is_train=True)` (RandomResizedCrop, bicubic, to float,
     Normalize) and the ViT-B-32 tokenizer: what an OpenCLIP user runs. It is given the true sample count;
     when its epoch ends, the next one starts as in OpenCLIP's training loop (`set_epoch`, iterate again),
     and that roll-over time counts.
   Each run first takes --warmup-batches (worker start-up excluded from the timing), then counts images over
   about --seconds of wall time. Reported: images/s; images/s per worker process (workers=0: the main process
   is the one core; workers=N: divided by N); CPU ms per image (user+system time of the main process and its
   worker processes over the timed window, the least load-sensitive number); and ours/OpenCLIP per worker
   count. torch runs --torch-threads intra-op threads in the main process (default 1, so that workers=0
   really is one core); DataLoader workers always run one.
3. Microbenchmarks single-image decode strategies on the same JPEGs, in this process: ours (torchvision's
   decode_jpeg for JPEGs under twice the crop size, else PIL with draft(); random resized crop on the uint8
   tensor), PIL with draft() for every image, PIL without draft(), torchvision.io.decode_jpeg for every image,
   OpenCLIP's per-sample path for reference (PIL full decode + its train transform), and what a worker does per
   image instead under data.decode_on=device (read the size from the header, draw the crop box, ship the bytes:
   the GPU decodes); with --batched-decode,
   also torchvision's decode_jpeg on lists of JPEGs on --decode-device (nvJPEG on a GPU), wall and host CPU time.
   Strategies are interleaved pass by pass, so load drift hits all of them; ms/image is the median pass.

Prints a table and, with --json, writes the numbers with the date, CPU model, core count, versions, the exact
command and the load average at start and end.

Two shims let OpenCLIP's pipeline run in our environment; the result JSON records whether each was applied.
- `open_clip_train.data` imports pandas at module level but only its CSV dataset uses it; when pandas is not
  installed, an empty stand-in module is registered so that the webdataset pipeline (which never touches it)
  can be imported.
- OpenCLIP 3.3.0's training extra pins webdataset<=0.2.86, but we need webdataset>=1.0, whose
  `tar_file_expander` ends every shard with an `{}` marker that OpenCLIP's `group_by_keys_nothrow` fails on
  (`KeyError: 'fname'`, open_clip#935, webdataset#384). Where that marker exists, OpenCLIP's
  `tarfile_to_samples_nothrow` is replaced by the same three lines with `eof_value=None`, the fix given there.
  Everything else is OpenCLIP's code as installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import inspect
import io
import json
import math
import os
import platform
import random
import shlex
import statistics
import sys
import tarfile
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import open_clip
import PIL
import torch
import torchvision
import webdataset
from PIL import Image
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms.v2 import functional as TF

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
from bench.process_stats import cpu_model, stop_workers, time_batches  # noqa: E402
from src.compose import compose_config  # noqa: E402
from src.data.device_crop import canvas_side, decode_for_device  # noqa: E402
from src.data.device_decode import jpeg_for_device  # noqa: E402
from src.data.image_text import Preprocess, decode_image, random_resized_crop_box  # noqa: E402
from src.data.loader import TrainLoader  # noqa: E402
from src.tools.shard_writer import Row, make_shards  # noqa: E402

try:
    import pandas  # noqa: F401
    PANDAS_STUBBED = False
except ImportError:
    # open_clip_train.data imports pandas for CsvDataset only; get_wds_dataset never uses it.
    sys.modules["pandas"] = types.ModuleType("pandas")
    PANDAS_STUBBED = True
import open_clip_train.data as openclip_data  # noqa: E402
from webdataset.tariterators import tar_file_expander, url_opener  # noqa: E402


def tarfile_to_samples_eof_none(src, handler=openclip_data.log_and_continue):
    """OpenCLIP's `tarfile_to_samples_nothrow` with `eof_value=None`: the fix of open_clip#935. Since 0.2.96
    webdataset yields an end-of-shard `{}` marker that OpenCLIP's `group_by_keys_nothrow` fails on with
    `KeyError: 'fname'` (OpenCLIP's training extra pins webdataset<=0.2.86; we need webdataset>=1.0)."""
    streams = url_opener(src, handler=handler)
    files = tar_file_expander(streams, handler=handler, eof_value=None)
    return openclip_data.group_by_keys_nothrow(files, handler=handler)


OPENCLIP_PATCHED = "eof_value" in inspect.signature(tar_file_expander).parameters
if OPENCLIP_PATCHED:  # get_wds_dataset looks the function up in its module when it builds the pipeline
    openclip_data.tarfile_to_samples_nothrow = tarfile_to_samples_eof_none

IMAGE_SIZE = 224
CONTEXT_LENGTH = 77
CROP_SCALE_MIN = 0.9  # ours: DataConfig's default; OpenCLIP's default train transform uses (0.9, 1.0) too
JPEG_QUALITY = 90
DATA_VERSION = 1  # bump when the generated images change, so old caches are not reused
# scikit-image sample photographs (colour) and a caption stem for each.
PHOTOS = {
    "astronaut": "an astronaut in a white space suit in front of the flag",
    "coffee": "a cup of coffee on a saucer",
    "chelsea": "a tabby cat looking to the side",
    "rocket": "a rocket on the launch pad",
    "immunohistochemistry": "a stained tissue section under a microscope",
    "hubble_deep_field": "a deep field of distant galaxies",
    "retina": "a fundus photograph of a human retina",
    "stereo_motorcycle": "a motorcycle parked in a workshop",
}
ADJECTIVES = ("close-up", "detailed", "bright", "dim", "cropped", "colourful", "grainy", "sharp", "wide", "old")


# ----------------------------------------------------------------------------------------------- data


def sample_photos() -> dict[str, np.ndarray]:
    """The colour sample photographs this scikit-image has (some need optional downloads: skipped)."""
    import skimage.data

    photos = {}
    for name in PHOTOS:
        try:
            image = getattr(skimage.data, name)()
        except Exception as err:  # missing in this version, or needs pooch and a download
            print(f"skimage.data.{name} unavailable ({type(err).__name__}): skipped")
            continue
        image = image[0] if isinstance(image, tuple) else image  # stereo_motorcycle: (left, right, disparity)
        if image.ndim == 3 and image.shape[2] == 3 and image.dtype == np.uint8:
            photos[name] = image
    if not photos:
        raise RuntimeError("no colour sample photographs in skimage.data")
    return photos


def write_images(images_dir: str, count: int, seed: int, long_side: tuple[int, int]) -> list[Row]:
    """`count` JPEGs (random crop, flip, `long_side` px on the long side, quality 90) and their captions."""
    photos = sample_photos()
    names = sorted(photos)
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(count):
        name = names[i % len(names)]
        photo = photos[name]
        height, width = photo.shape[:2]
        h, w = (max(16, round(side * rng.uniform(0.6, 1.0))) for side in (height, width))
        top, left = rng.integers(0, height - h + 1), rng.integers(0, width - w + 1)
        image = Image.fromarray(photo[top : top + h, left : left + w])
        if rng.random() < 0.5:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        scale = int(rng.integers(long_side[0], long_side[1] + 1)) / max(w, h)
        image = image.resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.Resampling.LANCZOS)
        path = f"{i:05d}.jpg"
        image.save(os.path.join(images_dir, path), format="JPEG", quality=JPEG_QUALITY)
        words = rng.choice(ADJECTIVES, size=int(rng.integers(0, 4)), replace=False)
        caption = " ".join([*words, PHOTOS[name]]) + f", picture {i}"
        rows.append(Row(path, caption, {"source": name}, f"image {i}"))
    return rows


def build_dataset(out_dir: str, count: int, shards: int, seed: int, long_side: tuple[int, int]) -> dict:
    """The cached shard set for (count, shards, seed, long side), built on first use; returns its manifest."""
    sides = "" if long_side == (512, 1024) else f"-px{long_side[0]}-{long_side[1]}"  # older caches keep their name
    final = os.path.join(out_dir, f"data-v{DATA_VERSION}-n{count}-s{shards}-seed{seed}{sides}")
    manifest_path = os.path.join(final, "manifest.json")
    if os.path.isfile(manifest_path):
        with open(manifest_path) as f:
            return json.load(f)
    os.makedirs(out_dir, exist_ok=True)
    tmp = f"{final}.tmp-{os.getpid()}"
    images_dir, shards_dir = os.path.join(tmp, "images"), os.path.join(tmp, "shards")
    os.makedirs(images_dir)
    print(f"writing {count} JPEGs to {images_dir}")
    rows = write_images(images_dir, count, seed, long_side)
    summary = make_shards(rows, images_dir, shards_dir, shard_size=math.ceil(count / shards), workers=2,
                          quality=JPEG_QUALITY)
    if summary.failures:
        raise RuntimeError(f"make_shards failed on {len(summary.failures)} images: {summary.failures[:3]}")
    sizes = [os.path.getsize(os.path.join(images_dir, r.path)) for r in rows]
    pixels = []
    for r in rows:
        with Image.open(os.path.join(images_dir, r.path)) as img:
            pixels.append(img.width * img.height)
    manifest = {
        "images": summary.samples, "shards": summary.shards, "seed": seed, "jpeg_quality": JPEG_QUALITY,
        "pattern": summary.pattern.replace(tmp, final), "sources": sorted({r.extra["source"] for r in rows}),
        "jpeg_kib_mean": round(statistics.mean(sizes) / 1024, 1),
        "megapixels_mean": round(statistics.mean(pixels) / 1e6, 3),
    }
    with open(os.path.join(tmp, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    os.replace(tmp, final)  # complete or absent: a crash never leaves a half-built cache under the final name
    return manifest


def jpeg_bytes(pattern: str) -> list[bytes]:
    """The JPEG members of the shards, in shard order."""
    urls = webdataset.shardlists.expand_urls(pattern)
    images = []
    for url in urls:
        with tarfile.open(url) as tar:
            images.extend(tar.extractfile(m).read() for m in tar.getmembers() if m.name.endswith(".jpg"))
    return images


# ----------------------------------------------------------------------------------------------- loaders


def ours(pattern: str, batch: int, workers: int, shuffle_buffer: int, seed: int) -> tuple[Iterator, dict]:
    cfg = dataclasses.replace(compose_config(["data=laion_wds"]).data, name="bench", shards=pattern, mode="epoch",
                              batch_size=batch, num_workers=workers, shuffle_buffer=shuffle_buffer,
                              crop_scale_min=CROP_SCALE_MIN)
    loader = TrainLoader(cfg, image_size=IMAGE_SIZE, context_length=CONTEXT_LENGTH, seed=seed)
    return (b["images"] for b in loader), {}


def openclip(pattern: str, batch: int, workers: int, samples: int, seed: int) -> tuple[Iterator, dict]:
    args = argparse.Namespace(
        train_data=pattern, val_data=None, train_num_samples=samples, val_num_samples=None, batch_size=batch,
        workers=workers, seed=seed, world_size=1, dataset_resampled=False, train_data_upsampling_factors=None,
    )
    transform = open_clip.image_transform(IMAGE_SIZE, is_train=True)
    tokenizer = open_clip.get_tokenizer("ViT-B-32")
    info = openclip_data.get_wds_dataset(args, transform, is_train=True, tokenizer=tokenizer)
    stats = {"epochs_started": 0, "batches_per_epoch": info.dataloader.num_batches}

    def batches() -> Iterator[torch.Tensor]:
        epoch = 0
        while True:  # open_clip_train.main: data["train"].set_epoch(epoch), then one pass per epoch
            info.set_epoch(epoch)
            stats["epochs_started"] += 1
            for images, _texts in info.dataloader:
                yield images
            epoch += 1

    return batches(), stats


def measure(name: str, make: Callable[[], tuple[Iterator, dict]], workers: int, seconds: float, warmup: int) -> dict:
    start = time.perf_counter()
    batches, stats = make()
    setup_s = time.perf_counter() - start
    t = time_batches(batches, warmup, seconds)
    elapsed, images, first = t["seconds"], t["items"], t["first"]
    result = {
        "loader": name, "workers": workers, "warmup_batches": warmup,
        "warmup_s": round(setup_s + t["warmup_s"], 2),
        "batches": t["batches"], "images": images, "seconds": round(elapsed, 3),
        "images_per_s": images / elapsed, "images_per_s_per_worker": images / elapsed / max(1, workers),
        "cpu_s": round(t["cpu_s"], 2), "cpu_ms_per_image": 1000 * t["cpu_s"] / images,
        "batch_dtype": str(first.dtype), "batch_shape": list(first.shape), **stats,
    }
    stop_workers(batches, name)
    return result


# ----------------------------------------------------------------------------------------------- decode


DEFAULT_DATA = compose_config([]).data
PREPROCESS = Preprocess.from_config(DEFAULT_DATA)  # the default resize, no augmentation
CANVAS = canvas_side(DEFAULT_DATA, IMAGE_SIZE)


def crop_uint8(image: torch.Tensor, rng: random.Random) -> torch.Tensor:
    height, width = image.shape[-2:]
    top, left, h, w = random_resized_crop_box(width, height, rng, (CROP_SCALE_MIN, 1.0))
    return TF.resized_crop(image, top, left, h, w, [IMAGE_SIZE, IMAGE_SIZE], antialias=True)


def decode_ours(data: bytes, rng: random.Random) -> torch.Tensor:
    return decode_image(data, IMAGE_SIZE, rng, CROP_SCALE_MIN, None, preprocess=PREPROCESS)


def decode_pil_draft(data: bytes, rng: random.Random) -> torch.Tensor:
    with Image.open(io.BytesIO(data)) as img:
        img.draft("RGB", (IMAGE_SIZE, IMAGE_SIZE))
        image = TF.pil_to_tensor(img.convert("RGB"))
    return crop_uint8(image, rng)


def decode_pil_no_draft(data: bytes, rng: random.Random) -> torch.Tensor:
    with Image.open(io.BytesIO(data)) as img:
        image = TF.pil_to_tensor(img.convert("RGB"))
    return crop_uint8(image, rng)


def decode_torchvision(data: bytes, rng: random.Random) -> torch.Tensor:
    image = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
    return crop_uint8(image, rng)


OPENCLIP_TRANSFORM = open_clip.image_transform(IMAGE_SIZE, is_train=True)


def decode_openclip(data: bytes, rng: random.Random) -> torch.Tensor:
    with Image.open(io.BytesIO(data)) as img:  # webdataset's "pilrgb" decoder, then the train transform
        img.load()
        return OPENCLIP_TRANSFORM(img.convert("RGB"))


def ship_for_device(data: bytes, rng: random.Random) -> torch.Tensor:
    """A worker's share of a JPEG under `data.decode_on=device` (`jpeg_for_device`): its size from the header, the
    crop box drawn as the workers' path draws it, and its bytes as a tensor; the GPU decodes and crops it. Returns
    the (6,) crop table row the loader ships beside the bytes (a non-JPEG, decoded in the worker, fails to unpack)."""
    _jpeg, row = jpeg_for_device({"jpg": data}, IMAGE_SIZE, rng, CROP_SCALE_MIN, None, PREPROCESS)
    return row


def place_for_device(data: bytes, rng: random.Random) -> torch.Tensor:
    """A worker's share of an image under `data.decode_on=workers` with `data.resize_on=device`
    (`decode_for_device`): decoded as the workers' path decodes it, the crop placed on its canvas for the GPU to
    resize (a crop larger than the canvas resized here, as there)."""
    canvas, _box = decode_for_device({"jpg": data}, IMAGE_SIZE, rng, CROP_SCALE_MIN, None, CANVAS, PREPROCESS)
    return canvas


SHIPPED = "ours, data.decode_on=device: header, crop box, bytes"
PLACED = "ours, data.resize_on=device: decode, crop on its canvas"
DECODERS = {
    "ours: decode_jpeg below 2x crop, else PIL draft": decode_ours,
    SHIPPED: ship_for_device,
    PLACED: place_for_device,
    "PIL draft + uint8 crop": decode_pil_draft,
    "PIL no draft + uint8 crop": decode_pil_no_draft,
    "torchvision decode_jpeg + uint8 crop": decode_torchvision,
    "OpenCLIP: PIL + image_transform (float)": decode_openclip,
}


def bench_decode(images: list[bytes], passes: int) -> dict:
    shapes = {SHIPPED: (6,), PLACED: (3, CANVAS, CANVAS)}
    for name, fn in DECODERS.items():  # warm-up, and a check that each gives a (3, 224, 224) image (or its own)
        out = fn(images[0], random.Random(0))
        assert tuple(out.shape) == shapes.get(name, (3, IMAGE_SIZE, IMAGE_SIZE)), (name, out.shape)
    times: dict[str, list[float]] = {name: [] for name in DECODERS}
    for p in range(passes):
        for name, fn in DECODERS.items():
            rng = random.Random(p)
            start = time.perf_counter()
            for data in images:
                fn(data, rng)
            times[name].append(1000 * (time.perf_counter() - start) / len(images))
    return {name: {"ms_per_image": statistics.median(t), "ms_per_image_min": min(t), "passes": t}
            for name, t in times.items()}


def bench_batched_decode(images: list[bytes], batch: int, passes: int, device: str) -> dict:
    """torchvision's `decode_jpeg` on lists of `batch` JPEGs at once on `device` (nvJPEG on "cuda"), then the uint8
    crop there, one image at a time: wall and host CPU time per image, the median pass. The CPU time says how much of
    the decoding stays on the host's cores, which is what a loader bound by those cores needs to know."""
    chunks = [[torch.frombuffer(bytearray(data), dtype=torch.uint8) for data in images[i : i + batch]]
              for i in range(0, len(images), batch)]
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    decoded = decode_jpeg(chunks[0], mode=ImageReadMode.RGB, device=device)  # warm-up: nvJPEG's handles
    assert len(decoded) == len(chunks[0]) and decoded[0].device.type == torch.device(device).type
    walls, cpus = [], []
    for p in range(passes):
        rng = random.Random(p)
        sync()
        wall, cpu = time.perf_counter(), time.process_time()
        for chunk in chunks:
            crops = [crop_uint8(image, rng) for image in decode_jpeg(chunk, mode=ImageReadMode.RGB, device=device)]
        sync()
        walls.append(1000 * (time.perf_counter() - wall) / len(images))
        cpus.append(1000 * (time.process_time() - cpu) / len(images))
    assert tuple(crops[0].shape) == (3, IMAGE_SIZE, IMAGE_SIZE), crops[0].shape
    return {"device": device, "batch": batch, "ms_per_image": statistics.median(walls),
            "ms_per_image_min": min(walls), "cpu_ms_per_image": statistics.median(cpus), "passes": walls}


NVIMGCODEC_BACKENDS = ("HW_GPU_ONLY", "GPU_ONLY", "HYBRID_CPU_GPU")


def bench_nvimgcodec_decode(images: list[bytes], batch: int, passes: int, backend: str, crop: bool) -> dict:
    """nvImageCodec's batched decode of `batch` JPEGs at once on the GPU through one `backend` (HW_GPU_ONLY: the
    chip's JPEG engines; GPU_ONLY and HYBRID_CPU_GPU: nvJPEG on the SMs, Huffman decoding on the GPU or the host),
    and with `crop` each image's random resized crop there (torchvision's antialiased resize, one image at a time):
    wall and host CPU time per image, the median pass. EXIF orientation is ignored, as PIL and torchvision ignore it."""
    from nvidia import nvimgcodec

    decoder = nvimgcodec.Decoder(backends=[nvimgcodec.Backend(getattr(nvimgcodec.BackendKind, backend))])
    params = nvimgcodec.DecodeParams(apply_exif_orientation=False, color_spec=nvimgcodec.ColorSpec.SRGB)
    chunks = [[nvimgcodec.CodeStream(data) for data in images[i : i + batch]] for i in range(0, len(images), batch)]

    def decode(chunk, rng):
        out = [torch.as_tensor(image, device="cuda") for image in decoder.decode(chunk, params=params)]
        if crop:
            out = [crop_uint8(image.permute(2, 0, 1), rng) for image in out]
        return out

    first = decode(chunks[0], random.Random(0))  # warm-up: the decoder's resources
    assert len(first) == len(chunks[0]) and all(image is not None for image in first)
    walls, cpus = [], []
    for p in range(passes):
        rng = random.Random(p)
        torch.cuda.synchronize()
        wall, cpu = time.perf_counter(), time.process_time()
        for chunk in chunks:
            decode(chunk, rng)
        torch.cuda.synchronize()
        walls.append(1000 * (time.perf_counter() - wall) / len(images))
        cpus.append(1000 * (time.process_time() - cpu) / len(images))
    return {"device": "cuda", "backend": backend, "batch": batch, "crop": crop,
            "ms_per_image": statistics.median(walls), "ms_per_image_min": min(walls),
            "cpu_ms_per_image": statistics.median(cpus), "passes": walls}


# ----------------------------------------------------------------------------------------------- report


def print_tables(results: list[dict], ratios: dict, decode: dict) -> None:
    print(f"\n{'loader':<10} {'workers':>7} {'images/s':>9} {'per worker':>10} {'CPU ms/img':>10} "
          f"{'images':>7} {'seconds':>7}  batch")
    for r in results:
        print(f"{r['loader']:<10} {r['workers']:>7} {r['images_per_s']:>9.1f} {r['images_per_s_per_worker']:>10.1f} "
              f"{r['cpu_ms_per_image']:>10.2f} {r['images']:>7} {r['seconds']:>7.1f}  {r['batch_dtype']}")
    for workers, ratio in ratios.items():
        print(f"ours/OpenCLIP at workers={workers}: {ratio['images_per_s']:.2f}x images/s, "
              f"{ratio['cpu_ms_per_image']:.2f}x CPU time per image")
    if decode:
        print(f"\n{'decode strategy (one process)':<56} {'ms/image':>8} {'min':>7} {'host CPU':>8}")
        for name, d in decode.items():
            cpu = f"{d['cpu_ms_per_image']:>8.3f}" if "cpu_ms_per_image" in d else ""
            print(f"{name:<56} {d['ms_per_image']:>8.3f} {d['ms_per_image_min']:>7.3f} {cpu}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out-dir", default="/tmp/loader_bench", help="cache folder for the images and shards")
    parser.add_argument("--images", type=int, default=512, help="JPEGs in the shard set")
    parser.add_argument("--shards", type=int, default=8, help="shards to pack them into")
    parser.add_argument("--long-side", type=int, nargs=2, default=[512, 1024], metavar=("MIN", "MAX"),
                        help="pixels on the JPEGs' long side, drawn uniformly")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2], help="DataLoader worker counts")
    parser.add_argument("--seconds", type=float, default=20.0, help="timed wall time per loader and worker count")
    parser.add_argument("--warmup-batches", type=int, help="batches before timing (default 2 per worker, min 2)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per loader and worker count; the order "
                        "alternates and the median run is reported (the lower middle one for an even count)")
    parser.add_argument("--shuffle-buffer", type=int, default=500, help="our loader's data.shuffle_buffer")
    parser.add_argument("--decode-passes", type=int, default=3, help="passes over the JPEGs per decode strategy "
                        "(0: skip the decode microbenchmark)")
    parser.add_argument("--batched-decode", type=int, default=0, metavar="BATCH",
                        help="also time decode_jpeg on lists of BATCH JPEGs on --decode-device (0: skip)")
    parser.add_argument("--decode-device", default="cuda", help="--batched-decode's device (cuda: nvJPEG)")
    parser.add_argument("--nvimgcodec", type=int, default=0, metavar="BATCH",
                        help="also time nvImageCodec's batched GPU decode of BATCH JPEGs at once, through each backend "
                             "(a GPU and the nvidia-nvimgcodec and nvidia-nvjpeg wheels needed)")
    parser.add_argument("--torch-threads", type=int, default=1, help="intra-op threads of the main process")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if min(args.workers) < 0 or args.images < args.batch or args.seconds <= 0:
        parser.error("need --workers >= 0, --images >= --batch and --seconds > 0")
    if not 0 < args.long_side[0] <= args.long_side[1]:
        parser.error(f"--long-side {args.long_side[0]} {args.long_side[1]}: need 0 < MIN <= MAX")

    load_start = os.getloadavg()
    torch.set_num_threads(args.torch_threads)
    data = build_dataset(args.out_dir, args.images, args.shards, args.seed, tuple(args.long_side))
    if data["shards"] < max(args.workers):
        parser.error(f"{data['shards']} shards cannot feed {max(args.workers)} workers: raise --shards")
    print(f"data: {data['images']} JPEGs in {data['shards']} shards ({data['pattern']}), "
          f"{data['jpeg_kib_mean']} KiB and {data['megapixels_mean']} MP on average")

    runs: dict[tuple[str, int], list[dict]] = {}
    for workers in args.workers:
        warmup = args.warmup_batches or max(2, 2 * workers)
        makers = {
            "ours": lambda w=workers: ours(data["pattern"], args.batch, w, args.shuffle_buffer, args.seed),
            "openclip": lambda w=workers: openclip(data["pattern"], args.batch, w, data["images"], args.seed),
        }
        for repeat in range(args.repeats):
            for name in (list(makers) if repeat % 2 == 0 else list(makers)[::-1]):
                r = measure(name, makers[name], workers, args.seconds, warmup)
                print(f"{name:<9} workers={workers} run {repeat + 1}: {r['images_per_s']:.1f} images/s, "
                      f"{r['cpu_ms_per_image']:.2f} CPU ms/image, {r['images']} images in {r['seconds']:.1f} s")
                runs.setdefault((name, workers), []).append(r)

    results = []
    for rs in runs.values():
        best = sorted(rs, key=lambda r: r["images_per_s"])[(len(rs) - 1) // 2]  # median run (lower for even)
        results.append({**best, "runs": [{k: r[k] for k in ("images_per_s", "cpu_ms_per_image")} for r in rs]})
    by = {(r["loader"], r["workers"]): r for r in results}
    ratios = {
        w: {"images_per_s": by["ours", w]["images_per_s"] / by["openclip", w]["images_per_s"],
            "cpu_ms_per_image": by["ours", w]["cpu_ms_per_image"] / by["openclip", w]["cpu_ms_per_image"]}
        for w in args.workers
    }
    decode = {}
    if args.decode_passes > 0:
        print(f"decode microbenchmark: {args.decode_passes} passes over {data['images']} JPEGs per strategy")
        decode = bench_decode(jpeg_bytes(data["pattern"]), args.decode_passes)
    if args.batched_decode > 0:
        decode[f"decode_jpeg, lists of {args.batched_decode}, on {args.decode_device}"] = bench_batched_decode(
            jpeg_bytes(data["pattern"]), args.batched_decode, max(1, args.decode_passes), args.decode_device)
    for backend in NVIMGCODEC_BACKENDS if args.nvimgcodec > 0 else ():
        for crop in (False, True):
            name = f"nvimgcodec {backend}, lists of {args.nvimgcodec}{', cropped' if crop else ''}"
            try:
                decode[name] = bench_nvimgcodec_decode(jpeg_bytes(data["pattern"]), args.nvimgcodec,
                                                       max(1, args.decode_passes), backend, crop)
            except RuntimeError as err:  # a backend this GPU or driver lacks: the others still run
                print(f"{name}: unavailable ({err})")
                break
    load_end = os.getloadavg()

    print_tables(results, ratios, decode)
    print(f"\nload average {load_start[0]:.2f} at start, {load_end[0]:.2f} at end ({os.cpu_count()} CPUs)")
    if max(load_start[0], load_end[0]) > 0.5:
        print("note: other work was running; these timings are noisy")
    if args.json:
        report = {
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": shlex.join([sys.executable, *sys.argv]), "cpu": cpu_model(), "nproc": os.cpu_count(),
            "affinity": len(os.sched_getaffinity(0)), "torch_threads": args.torch_threads,
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "torchvision": torchvision.__version__, "open_clip": open_clip.__version__,
                         "webdataset": getattr(webdataset, "__version__", "unknown"), "pillow": PIL.__version__},
            "openclip_pandas_stubbed": PANDAS_STUBBED,
            "openclip_eof_value_patched": OPENCLIP_PATCHED,
            "loadavg_start": load_start, "loadavg_end": load_end, "args": vars(args), "data": data,
            "results": results, "ratio_ours_over_openclip": {str(w): r for w, r in ratios.items()},
            "decode": decode,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
