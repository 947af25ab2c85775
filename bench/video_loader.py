"""Video clip loading on the CPU: decoding mp4 files per clip against our packed-frame shards.

    python bench/video_loader.py                               # 12 videos of 8 s, T=8 of K=16, 20 s per run
    python bench/video_loader.py --videos 4 --seconds-per-video 4 --seconds 5 --json /tmp/video_bench.json

1. Source videos, built once and cached under --out-dir: --videos H.264 mp4 files, half 640x360 and half
   1280x720, 30 fps, --seconds-per-video long, encoded by PyAV's libx264 with the encoder's defaults (CRF 23,
   preset medium, and no gop_size set, so x264's default keyframe interval of 250 frames applies, plus its
   scene-cut keyframes: an 8 s video has one keyframe, sometimes two; the manifest counts them). Content: a
   slowly panning and zooming crop of a scikit-image sample photograph (astronaut, coffee, chelsea) with
   per-frame grain (Gaussian, sigma 5), which gives web-like bitrates (about 1 Mbit/s at 360p, 3 Mbit/s at
   720p) instead of the trivially compressible flat colours of synthetic test clips. A captions CSV (path,
   caption, width, height, source) sits beside them; the manifest records each file's size, bitrate and
   keyframe count. Each video is one clip.
2. Measures three pipelines on the same clips, each giving batches of --batch clips of --T frames at --size
   pixels (uint8 (B, T, 3, H, W)), with one random resized crop and flip per clip (our loader's
   `crop_scale_min`), TSN-style frame choice (one random frame per equal segment):
   (a) mp4, seek per frame: for each clip, open the mp4 file with PyAV, and for each of the T random times
       seek to the keyframe before it and decode forward to the first frame at or after it; the equivalent
       of reading frames by index with OpenCV per sample, the baseline of the MXNet video-I/O write-up
       (docs papers.md section 3). Implemented here (`seek_decode`), in a DataLoader over the files.
   (b) mp4 in shard: video2dataset's layout (`{key}.mp4` holding the file's bytes, `{key}.txt`, `{key}.json`)
       written with webdataset's TarWriter and read by our `TrainLoader` (DataConfig frames=T), which decodes
       the mp4 in the worker (`src.data.video_text`). Before timing, a tiny mp4 shard checks that the loader
       has that path; if it has not, (b) falls back to `seek_decode` on the tar's bytes inside our loader, and
       the output says so (`b_decoder`). Shards are contiguous runs of the video list, by default one per
       worker of the largest --workers (each reader then gets one shard, with as many 360p as 720p clips).
   (c) packed frames: `src.tools.video_pack.pack_videos` shards of K JPEG frames per clip (short side
       --short-side), read by our `TrainLoader` with frames=T.
   All decoders run one thread: PyAV's decoder gets thread_count=1 (its default, all cores, has deadlocked
   next to DataLoader workers: docs practices.md), torch gets 1 intra-op thread in the main process, and
   DataLoader workers run one. With --workers 0 the main process is the one core doing all the work, so its
   rate is the rate per core; with N workers the rate is divided by N for "per worker".
   Each run first takes --warmup-batches (default one per worker, at least one; worker start-up and first
   opens excluded from the timing), then counts whole batches until --seconds of wall time have passed and
   the count is a whole round (a multiple of the worker count: DataLoader takes batches from the workers in
   turn, and slow pipelines deliver them in bunches of one per worker).
   Reported per pipeline and worker count: clips/s and frames/s (per worker), CPU ms per clip (user+system
   time of this process and its worker processes over the timed window: the number least sensitive to other
   load), and bytes per clip on disk for (b) and (c) (tar bytes / clips; for (a), the mean mp4 file).
   Ratios (c)/(a) and (c)/(b) come from the same run. The CPU cores needed to feed one accelerator are
       cores = clips_per_s_needed / clips_per_s_per_core,  clips_per_s_per_core = 1000 / (CPU ms per clip)
   printed for --clips-per-s-needed (default 100 clips/s: an ASSUMED fine-tuning rate for one H200, not a
   measurement). It counts the loader's work only, not the training process's own CPU.
3. Prints a table and, with --json, writes the numbers with the date, CPU model, core count, versions, the
   exact command and the load average at start and end.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import io
import json
import math
import multiprocessing
import os
import platform
import queue
import random
import shlex
import shutil
import statistics
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import av
import numpy as np
import PIL
import torch
import torchvision
import webdataset
from PIL import Image
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
import src.data.loader as loader_module  # noqa: E402
from bench.process_stats import cpu_model, stop_workers, time_batches  # noqa: E402
from src.compose import compose_config  # noqa: E402
from src.data.image_text import Preprocess, crop, random_resized_crop_box  # noqa: E402
from src.data.loader import TrainLoader  # noqa: E402
from src.data.video_text import segment_times  # noqa: E402
from src.tools.shard_writer import read_captions, shard_pattern  # noqa: E402
from src.tools.synthetic_videos import yuv420p_frame  # noqa: E402
from src.tools.video_pack import pack_videos  # noqa: E402

DATA_VERSION = 2  # bump when the generated videos change, so old caches are not reused
FPS = 30
RESOLUTIONS = ((640, 360), (1280, 720))
GRAIN_SIGMA = 5.0  # per-frame noise: sets the bitrate to web-like levels (see the module docstring)
PHOTOS = {
    "astronaut": "an astronaut in a white suit, the camera slowly panning and zooming",
    "coffee": "a cup of coffee on a saucer, filmed with a drifting camera",
    "chelsea": "a tabby cat looking to the side, the camera moving closer and away",
}
CONTEXT_LENGTH = 77
CROP_SCALE_MIN = compose_config([]).data.crop_scale_min  # our loader's default
PIPELINES = {
    "a": "(a) mp4, seek per frame",
    "b": "(b) mp4 in shard",
    "c": "(c) packed frames",
}
GOALS = {"a": 18.0, "b": 5.0}  # the goals: (c) at least 18x (a) and 5x (b), in clips/s per worker


# ----------------------------------------------------------------------------------------------- videos


def render_frames(photo: Image.Image, width: int, height: int, count: int, seed: int) -> Iterator[np.ndarray]:
    """`count` RGB frames: a crop of `photo` that pans and zooms smoothly (periods of a few seconds, random
    per video), resampled to width x height, with fresh grain on every frame."""
    rng = np.random.default_rng(seed)
    zoom_period, pan_x_period, pan_y_period = rng.uniform(3, 7, size=3)
    phases = rng.uniform(0, 2 * math.pi, size=3)
    pw, ph = photo.size
    for i in range(count):
        t = i / FPS
        crop_w = min(pw, ph * width / height) * (0.65 + 0.25 * math.sin(2 * math.pi * t / zoom_period + phases[0]))
        crop_h = crop_w * height / width
        cx = pw / 2 + 0.45 * (pw - crop_w) * math.sin(2 * math.pi * t / pan_x_period + phases[1])
        cy = ph / 2 + 0.45 * (ph - crop_h) * math.sin(2 * math.pi * t / pan_y_period + phases[2])
        box = (cx - crop_w / 2, cy - crop_h / 2, cx + crop_w / 2, cy + crop_h / 2)
        image = photo.transform((width, height), Image.Transform.EXTENT, box, Image.Resampling.BILINEAR)
        grain = rng.standard_normal((height, width, 1), dtype=np.float32) * GRAIN_SIGMA
        yield np.clip(np.asarray(image, dtype=np.float32) + grain, 0, 255).astype(np.uint8)


def write_video(path: str, source: str, width: int, height: int, seconds: float, seed: int) -> dict:
    """Encode one mp4 with libx264's defaults (no gop_size, no bitrate: CRF 23, keyint 250)."""
    import skimage.data

    photo = Image.fromarray(getattr(skimage.data, source)())
    with av.open(path + ".tmp", mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=FPS)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for array in render_frames(photo, width, height, round(seconds * FPS), seed):
            container.mux(stream.encode(yuv420p_frame(array)))
        container.mux(stream.encode())
    os.replace(path + ".tmp", path)
    with av.open(path) as container:
        keyframes = sum(packet.is_keyframe for packet in container.demux(video=0) if packet.size)
        bitrate = container.bit_rate
    return {"path": os.path.basename(path), "caption": PHOTOS[source], "width": width, "height": height,
            "source": source, "bytes": os.path.getsize(path), "mbit_per_s": round(bitrate / 1e6, 3),
            "keyframes": keyframes}


def build_videos(out_dir: str, count: int, seconds: float, seed: int) -> tuple[str, dict]:
    """The cached source videos and captions.csv; returns (folder, manifest)."""
    final = os.path.join(out_dir, f"videos-v{DATA_VERSION}-n{count}-s{seconds:g}-seed{seed}")
    if os.path.isfile(os.path.join(final, "manifest.json")):
        with open(os.path.join(final, "manifest.json")) as f:
            return final, json.load(f)
    tmp = f"{final}.tmp-{os.getpid()}"
    os.makedirs(tmp)
    names = list(PHOTOS)
    # Resolutions alternate, so every contiguous run of an even number of videos (a shard, or one worker's
    # share in (a)) holds as many 360p as 720p ones and the workers do equal work.
    jobs = [(os.path.join(tmp, f"video_{i:04d}.mp4"), names[i % len(names)], *RESOLUTIONS[i % 2], seconds,
             seed * 1_000_003 + i) for i in range(count)]
    print(f"encoding {count} videos of {seconds:g} s (libx264 defaults) into {final}")
    with ProcessPoolExecutor(max_workers=min(count, os.cpu_count() or 1)) as pool:
        videos = list(pool.map(write_video, *zip(*jobs)))
    with open(os.path.join(tmp, "captions.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["path", "caption", "width", "height", "source"])
        writer.writeheader()
        writer.writerows({k: v[k] for k in writer.fieldnames} for v in videos)
    manifest = {"videos": videos, "seconds": seconds, "fps": FPS, "seed": seed, "grain_sigma": GRAIN_SIGMA,
                "encoder": "libx264 defaults via PyAV (CRF 23, preset medium, keyint 250)"}
    for width, height in RESOLUTIONS:
        same = [v for v in videos if v["width"] == width]
        if same:
            manifest[f"{height}p"] = {"videos": len(same), "mbit_per_s_mean": statistics.mean(
                v["mbit_per_s"] for v in same), "keyframes_max": max(v["keyframes"] for v in same)}
    with open(os.path.join(tmp, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    os.replace(tmp, final)  # complete or absent: a crash never leaves a half-built cache under the final name
    return final, manifest


def write_mp4_shards(videos: list[dict], videos_dir: str, out_dir: str, shards: int) -> None:
    """video2dataset's layout: `{key}.mp4` (the file's bytes), `{key}.txt`, `{key}.json`, plus sizes.json."""
    os.makedirs(out_dir)
    per_shard = math.ceil(len(videos) / shards)
    sizes = {}
    for shard in range(shards):
        chunk = videos[shard * per_shard : (shard + 1) * per_shard]
        name = f"{shard:05d}.tar"
        with webdataset.TarWriter(os.path.join(out_dir, name), mtime=0) as sink:
            for index, video in enumerate(chunk):
                key = f"{shard:05d}{index:04d}"
                with open(os.path.join(videos_dir, video["path"]), "rb") as f:
                    data = f.read()
                meta = {"key": key, "caption": video["caption"], "width": video["width"], "height": video["height"],
                        "source_path": video["path"]}
                sink.write({"__key__": key, "mp4": data, "txt": video["caption"], "json": json.dumps(meta)})
        sizes[name] = len(chunk)
    with open(os.path.join(out_dir, "sizes.json"), "w") as f:
        json.dump(sizes, f, indent=1)


def build_shards(videos_dir: str, videos: list[dict], shards: int, frames: int, short_side: int) -> dict:
    """The cached (b) and (c) shard sets beside the videos; returns their patterns and bytes per clip (for (a),
    the mean mp4 file)."""
    result = {}
    mp4_dir = os.path.join(videos_dir, f"mp4-shards{shards}")
    if not os.path.isdir(mp4_dir):
        write_mp4_shards(videos, videos_dir, f"{mp4_dir}.tmp-{os.getpid()}", shards)
        os.replace(f"{mp4_dir}.tmp-{os.getpid()}", mp4_dir)
    packed_dir = os.path.join(videos_dir, f"packed-K{frames}-side{short_side}-shards{shards}")
    if not os.path.isdir(packed_dir):
        tmp = f"{packed_dir}.tmp-{os.getpid()}"
        rows = read_captions(os.path.join(videos_dir, "captions.csv"))
        summary = pack_videos(rows, videos_dir, tmp, frames=frames, short_side=short_side,
                              shard_size=math.ceil(len(rows) / shards), workers=min(shards, os.cpu_count() or 1))
        if summary.failures:
            shutil.rmtree(tmp)
            raise RuntimeError(f"pack_videos failed on {len(summary.failures)} videos: {summary.failures[:3]}")
        os.replace(tmp, packed_dir)
    result["a"] = {"files": len(videos), "bytes_per_clip": statistics.mean(v["bytes"] for v in videos)}
    for name, folder in (("b", mp4_dir), ("c", packed_dir)):
        tars = sorted(n for n in os.listdir(folder) if n.endswith(".tar"))
        total = sum(os.path.getsize(os.path.join(folder, n)) for n in tars)
        result[name] = {"pattern": shard_pattern(folder, len(tars)), "shards": len(tars), "tar_bytes": total,
                        "bytes_per_clip": total / len(videos)}
    return result


# ----------------------------------------------------------------------------------------------- decoding


def seek_decode(source: str | io.BytesIO, frames: int, rng: random.Random) -> torch.Tensor:
    """(T, 3, H, W) uint8, full resolution: for each random time, a seek to the keyframe before it, then
    decoding forward to the first frame at or after it. This is what reading frames by index costs with
    OpenCV (CAP_PROP_POS_FRAMES) per sample: each seek re-decodes the group of pictures from its keyframe."""
    with av.open(source) as container:
        stream = container.streams.video[0]
        stream.thread_type, stream.codec_context.thread_count = "SLICE", 1  # one decoding thread (module docstring)
        duration = float(stream.duration * stream.time_base) if stream.duration else container.duration / 1e6
        picked = []
        for target in segment_times(duration, frames, rng):
            container.seek(int(target / stream.time_base), stream=stream, backward=True)
            frame = None
            for frame in container.decode(stream):
                if frame.time is not None and frame.time >= target:
                    break
            if frame is None:
                raise ValueError(f"no frame decoded after seeking to {target:.3f} s")
            picked.append(torch.from_numpy(frame.to_ndarray(format="rgb24", threads=1)).permute(2, 0, 1))
    return torch.stack(picked)


PREPROCESS = Preprocess.from_config(compose_config([]).data)  # the default resize, no augmentation


def crop_clip(clip: torch.Tensor, size: int, rng: random.Random) -> torch.Tensor:
    """One random resized crop and one flip for the whole clip, as `src.data.video_text.decode_clip` does."""
    height, width = clip.shape[-2:]
    clip = crop(clip, size, random_resized_crop_box(width, height, rng, (CROP_SCALE_MIN, 1.0)), PREPROCESS)
    return clip.flip(-1) if rng.random() < 0.5 else clip


class SeekPerFrameClips(IterableDataset):
    """Pipeline (a): endless batches of clips decoded from the mp4 files; worker w of W takes the w-th of W
    contiguous parts of the file list (as many 360p as 720p files when a part has an even count)."""

    def __init__(self, paths: list[str], frames: int, size: int, batch_size: int, seed: int):
        self.paths, self.frames, self.size, self.batch_size, self.seed = paths, frames, size, batch_size, seed

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        mine = self.paths[worker * len(self.paths) // workers : (worker + 1) * len(self.paths) // workers]
        rng = random.Random(f"seek-{self.seed}-{worker}")
        batch = []
        while True:
            rng.shuffle(mine)
            for path in mine:
                batch.append(crop_clip(seek_decode(path, self.frames, rng), self.size, rng))
                if len(batch) == self.batch_size:
                    yield torch.stack(batch)
                    batch = []


def seek_batches(paths: list[str], args: argparse.Namespace, workers: int) -> Iterator[torch.Tensor]:
    """DataLoader settings as in our TrainLoader: persistent workers, prefetch_factor 4."""
    dataset = SeekPerFrameClips(paths, args.T, args.size, args.batch, args.seed)
    yield from DataLoader(dataset, batch_size=None, num_workers=workers, persistent_workers=workers > 0,
                          prefetch_factor=4 if workers > 0 else None)


def loader_batches(pattern: str, args: argparse.Namespace, workers: int) -> Iterator[torch.Tensor]:
    cfg = dataclasses.replace(compose_config(["data=laion_wds"]).data, name="v", shards=pattern, frames=args.T,
                              batch_size=args.batch, num_workers=workers, shuffle_buffer=args.shuffle_buffer)
    for batch in TrainLoader(cfg, image_size=args.size, context_length=CONTEXT_LENGTH, seed=args.seed):
        yield batch["images"]


# ----------------------------------------------------------------------------------------------- mp4 path probe


def tiny_mp4(frames: int = 24, size: int = 64) -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=FPS)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(frames):
            array = np.full((size, size, 3), 8 * i, dtype=np.uint8)
            container.mux(stream.encode(yuv420p_frame(array)))
        container.mux(stream.encode())
    return buffer.getvalue()


def _probe_child(path: str, frames: int, size: int, answer: multiprocessing.Queue) -> None:
    try:
        cfg = dataclasses.replace(compose_config(["data=laion_wds"]).data, name="probe", shards=path, frames=frames,
                                  batch_size=2, num_workers=0, shuffle_buffer=1)
        images = next(TrainLoader(cfg, image_size=size, context_length=CONTEXT_LENGTH, seed=0))["images"]
        expected = (2, frames, 3, size, size)
        ok = tuple(images.shape) == expected and images.dtype == torch.uint8
        answer.put((ok, f"batch {tuple(images.shape)} {images.dtype}" + ("" if ok else f", expected {expected}")))
    except Exception as err:
        answer.put((False, f"{type(err).__name__}: {err}"))


def loader_decodes_mp4(work_dir: str, frames: int, size: int, timeout_s: float = 120) -> tuple[bool, str]:
    """Does our TrainLoader decode `{key}.mp4` samples? Asked in a child process: a loader that skips every
    sample (as "missing_image") never yields a batch, so the question needs a timeout."""
    os.makedirs(work_dir, exist_ok=True)
    path = os.path.join(work_dir, "probe-00000.tar")
    data = tiny_mp4()
    with webdataset.TarWriter(path, mtime=0) as sink:
        for i in range(2):
            sink.write({"__key__": f"probe{i}", "mp4": data, "txt": "a probe clip", "json": "{}"})
    context = multiprocessing.get_context("fork")
    answer = context.Queue()
    child = context.Process(target=_probe_child, args=(path, frames, size, answer), daemon=True)
    child.start()
    try:
        verdict = answer.get(timeout=timeout_s)
    except queue.Empty:
        verdict = (False, f"no batch within {timeout_s:g} s (every sample skipped?)")
    child.join(5)
    if child.is_alive():
        child.kill()
        child.join()
    return verdict


def use_bench_mp4_decoder() -> None:
    """Fallback for (b) when our loader has no mp4 path: our TrainLoader still reads, shuffles and batches the
    shards, but an `mp4` member is decoded by `seek_decode` (the workers are forked and inherit this)."""
    original = loader_module.decode_pixels

    def decode_pixels(sample: dict, frames: int, size: int, rng: random.Random | None, scale_min: float, *rest,
                      **options):
        if frames and "mp4" in sample:
            rng = rng or random.Random(0)
            return crop_clip(seek_decode(io.BytesIO(sample["mp4"]), frames, rng), size, rng)
        return original(sample, frames, size, rng, scale_min, *rest, **options)

    loader_module.decode_pixels = decode_pixels


# ----------------------------------------------------------------------------------------------- timing


def measure(name: str, batches: Iterator[torch.Tensor], workers: int, seconds: float, warmup: int,
            frames: int) -> dict:
    t = time_batches(batches, warmup, seconds, rounds=max(1, workers))
    elapsed, clips, first = t["seconds"], t["items"], t["first"]
    per_worker = clips / elapsed / max(1, workers)
    result = {
        "pipeline": name, "workers": workers, "warmup_batches": warmup, "warmup_s": round(t["warmup_s"], 2),
        "batches": t["batches"], "clips": clips, "seconds": round(elapsed, 3), "clips_per_s": clips / elapsed,
        "clips_per_s_per_worker": per_worker, "frames_per_s_per_worker": per_worker * frames,
        "cpu_s": round(t["cpu_s"], 2), "cpu_ms_per_clip": 1000 * t["cpu_s"] / clips, "batch_shape": list(first.shape),
        "batch_dtype": str(first.dtype),
    }
    stop_workers(batches, name)
    return result


# ----------------------------------------------------------------------------------------------- report


def versions() -> dict:
    import skimage

    return {"python": platform.python_version(), "torch": torch.__version__, "torchvision": torchvision.__version__,
            "av": av.__version__, "libavcodec": ".".join(map(str, av.library_versions["libavcodec"])),
            "webdataset": getattr(webdataset, "__version__", "unknown"), "pillow": PIL.__version__,
            "numpy": np.__version__, "scikit-image": skimage.__version__}


def summarize(results: list[dict], shards: dict, args: argparse.Namespace) -> dict:
    """Ratios of (c) over (a) and (b) per worker count, the goals, and the cores estimate."""
    by = {(r["pipeline"], r["workers"]): r for r in results}
    ratios = {}
    for workers in args.workers:
        c = by["c", workers]
        ratios[str(workers)] = {
            f"c_over_{other}": {"clips_per_s": c["clips_per_s"] / by[other, workers]["clips_per_s"],
                                "cpu_per_clip": by[other, workers]["cpu_ms_per_clip"] / c["cpu_ms_per_clip"]}
            for other in ("a", "b")
        }
    # The goals are judged on the single-process (per core) rates when measured, else the fewest workers.
    judge = str(min(args.workers))
    goals = {f"c_over_{other}": {"goal": goal, "measured": ratios[judge][f"c_over_{other}"]["clips_per_s"],
                                 "compared": f"(c)/({other})",
                                 "met": ratios[judge][f"c_over_{other}"]["clips_per_s"] >= goal, "workers": judge}
             for other, goal in GOALS.items()}
    cores = {}
    for name in PIPELINES:
        r = by[name, min(args.workers)]
        per_core = 1000 / r["cpu_ms_per_clip"]
        cores[name] = {"clips_per_s_per_core": per_core, "clips_per_s_per_worker_wall": r["clips_per_s_per_worker"],
                       "cores": args.clips_per_s_needed / per_core}
    for r in results:
        r["bytes_per_clip"] = shards[r["pipeline"]]["bytes_per_clip"]
    return {"ratios": ratios, "goals": goals, "cores_needed": {
        "formula": "cores = clips_per_s_needed / clips_per_s_per_core; clips_per_s_per_core = 1000 / cpu_ms_per_clip",
        "clips_per_s_needed": args.clips_per_s_needed,
        "clips_per_s_needed_is": "an assumption (a fine-tuning step rate for one H200), not a measurement",
        "per_pipeline": cores}}


def print_report(results: list[dict], summary: dict, args: argparse.Namespace) -> None:
    print(f"\n{'pipeline':<26} {'workers':>7} {'clips/s':>8} {'clips/s/wkr':>11} {'frames/s/wkr':>12} "
          f"{'CPU ms/clip':>11} {'clips':>6} {'seconds':>7} {'bytes/clip':>11}")
    for r in results:
        size = f"{r['bytes_per_clip'] / 1e6:.2f} MB"
        print(f"{PIPELINES[r['pipeline']]:<26} {r['workers']:>7} {r['clips_per_s']:>8.2f} "
              f"{r['clips_per_s_per_worker']:>11.2f} {r['frames_per_s_per_worker']:>12.1f} "
              f"{r['cpu_ms_per_clip']:>11.1f} {r['clips']:>6} {r['seconds']:>7.1f} {size:>11}")
    print()
    for workers, ratio in summary["ratios"].items():
        print(f"workers={workers}: (c)/(a) {ratio['c_over_a']['clips_per_s']:.1f}x clips/s "
              f"({ratio['c_over_a']['cpu_per_clip']:.1f}x less CPU per clip), (c)/(b) "
              f"{ratio['c_over_b']['clips_per_s']:.1f}x clips/s ({ratio['c_over_b']['cpu_per_clip']:.1f}x less CPU)")
    for goal in summary["goals"].values():
        print(f"goal {goal['compared']} >= {goal['goal']:g}x at workers={goal['workers']}: "
              f"measured {goal['measured']:.1f}x -> {'MET' if goal['met'] else 'NOT MET'}")
    needed = summary["cores_needed"]
    print(f"\nCPU cores to feed one H200 at an ASSUMED {needed['clips_per_s_needed']:g} clips/s "
          f"(T={args.T}, {args.size} px; loader work only):")
    print(f"  {needed['formula']}")
    for name, c in needed["per_pipeline"].items():
        print(f"  {PIPELINES[name]:<26} {needed['clips_per_s_needed']:g} / {c['clips_per_s_per_core']:.2f} "
              f"= {c['cores']:.1f} cores")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out-dir", default="/tmp/video_bench", help="cache folder for the videos and shards")
    parser.add_argument("--videos", type=int, default=12, help="source videos (= clips), half 360p and half 720p")
    parser.add_argument("--seconds-per-video", type=float, default=8.0)
    parser.add_argument("--T", type=int, default=8, help="frames per clip given to the model")
    parser.add_argument("--K", type=int, default=16, help="frames stored per clip in the packed shards")
    parser.add_argument("--size", type=int, default=224, help="output frame size")
    parser.add_argument("--short-side", type=int, default=256, help="short side of the packed JPEG frames")
    parser.add_argument("--shards", type=int, help="shards per shard set, contiguous runs of videos (default: the "
                        "largest --workers, so each reader gets one shard with as many 360p as 720p clips)")
    parser.add_argument("--batch", type=int, default=8, help="clips per batch")
    parser.add_argument("--shuffle-buffer", type=int, default=8, help="our loader's data.shuffle_buffer")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2], help="DataLoader worker counts")
    parser.add_argument("--seconds", type=float, default=20.0, help="timed wall time per pipeline and worker count")
    parser.add_argument("--warmup-batches", type=int, help="batches before timing (default: one per worker, min 1)")
    parser.add_argument("--clips-per-s-needed", type=float, default=100.0,
                        help="assumed clip rate of one H200 in video fine-tuning, for the cores estimate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    shards = min(args.shards or max(1, *args.workers), args.videos)
    if min(args.workers) < 0 or args.seconds <= 0 or not 1 <= args.T <= args.K or args.seconds_per_video <= 0:
        parser.error("need --workers >= 0, --seconds > 0, --seconds-per-video > 0 and 1 <= --T <= --K")
    if shards < max(args.workers):
        parser.error(f"{shards} shards (and videos) cannot feed {max(args.workers)} workers: raise --videos/--shards")

    load_start = os.getloadavg()
    torch.set_num_threads(1)
    videos_dir, manifest = build_videos(args.out_dir, args.videos, args.seconds_per_video, args.seed)
    data = build_shards(videos_dir, manifest["videos"], shards, args.K, args.short_side)
    for res in ("360p", "720p"):
        if res in manifest:
            m = manifest[res]
            print(f"{res}: {m['videos']} videos, {m['mbit_per_s_mean']:.2f} Mbit/s mean, "
                  f"at most {m['keyframes_max']} keyframes per video")
    print(f"(b) {data['b']['pattern']}: {data['b']['bytes_per_clip'] / 1e6:.2f} MB per clip")
    print(f"(c) {data['c']['pattern']}: {data['c']['bytes_per_clip'] / 1e6:.2f} MB per clip")

    has_mp4_path, probe = loader_decodes_mp4(os.path.join(args.out_dir, "probe"), args.T, args.size)
    if has_mp4_path:
        b_decoder = "TrainLoader's own mp4 path (src.data.video_text)"
    else:
        b_decoder = "bench fallback: seek_decode inside TrainLoader (the loader has no mp4 path)"
        use_bench_mp4_decoder()
        print(f"WARNING: our loader did not decode an mp4 shard ({probe}); (b) uses the benchmark's decoder")
    print(f"(b) decoder: {b_decoder} [probe: {probe}]")

    paths = [os.path.join(videos_dir, v["path"]) for v in manifest["videos"]]
    makers: dict[str, Callable[[int], Iterator[torch.Tensor]]] = {
        "a": lambda w: seek_batches(paths, args, w),
        "b": lambda w: loader_batches(data["b"]["pattern"], args, w),
        "c": lambda w: loader_batches(data["c"]["pattern"], args, w),
    }
    results = []
    for workers in args.workers:
        warmup = args.warmup_batches or max(1, workers)
        for name, make in makers.items():
            r = measure(name, make(workers), workers, args.seconds, warmup, args.T)
            print(f"{PIPELINES[name]:<26} workers={workers}: {r['clips_per_s']:.2f} clips/s, "
                  f"{r['cpu_ms_per_clip']:.1f} CPU ms/clip, {r['clips']} clips in {r['seconds']:.1f} s "
                  f"(warm-up {r['warmup_s']:.1f} s)")
            results.append(r)
    load_end = os.getloadavg()

    summary = summarize(results, data, args)
    print_report(results, summary, args)
    print(f"\nload average {load_start[0]:.2f} at start, {load_end[0]:.2f} at end ({os.cpu_count()} CPUs)")
    if max(load_start[0], load_end[0]) > 0.5:
        print("note: other work was running; these timings are noisy")
    if args.json:
        report = {
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": shlex.join([sys.executable, *sys.argv]), "cpu": cpu_model(), "nproc": os.cpu_count(),
            "affinity": len(os.sched_getaffinity(0)), "versions": versions(), "loadavg_start": load_start,
            "loadavg_end": load_end, "args": vars(args), "shards": shards, "videos": manifest, "data": data,
            "b_decoder": b_decoder, "b_probe": probe, "results": results, **summary,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
