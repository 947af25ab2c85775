"""Training and evaluation loaders over image-text webdataset shards.

Training is one endless stream per rank; each DataLoader worker is one reader (`src/data/reader.py`).
- `data.mode=epoch`: for epoch e all ranks permute the shard list with the same seed (seed, e) and reader
  r of R takes every R-th shard, so each sample is read exactly once per epoch across ranks and workers.
  Readers get whole shards; when the shards do not divide evenly, some readers have more samples in an
  epoch than others and simply start their next epoch later (steps never wait for an epoch boundary).
- `data.mode=resampled`: each reader draws shards with replacement (weighted by source) and reads
  `samples_per_epoch / R` samples per virtual epoch.

Each batch carries its reader's exact position, and the loader's `state_dict()` holds the last one of every
reader, so a resumed run continues with the same samples in the same order (see `reader.py` for what is
re-read). DataLoader hands out batches round-robin over workers; a resumed loader rotates the workers'
reader roles to keep that order.

Bad data (undecodable images, missing captions, unreadable or truncated shards) is skipped and counted by
reason; past `data.max_bad_fraction` the run stops with a message naming the worst shards.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import random
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from open_clip.tokenizer import tokenize
from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info

from src.config import DataConfig, DataMode
from src.data.device_crop import decode_for_device
from src.data.device_decode import DeviceDecoder, collate_for_device, jpeg_for_device
from src.data.image_text import OversizedImage, Preprocess, decode_image, image_bytes
from src.data.processes import check_worker_temp_dir, shield_worker, start_workers, worker_start_method
from src.data.reader import BadData, Position, Reader, ResampledShards, read_shard
from src.data.shards import check_pipe_allowed, expand_shards, read_sizes, shards_for_reader
from src.data.video_text import TooFewFrames, decode_clip

log = logging.getLogger(__name__)
MODES = DataMode.values()
# Bad-data fractions are judged only after this many bad samples, so that one corrupt image at the start
# of a run does not look like 100% bad data.
MIN_BAD_TO_JUDGE = 10


def default_num_workers() -> int:
    """Loader processes per rank when data.num_workers is null: three quarters of this rank's share of the
    node's CPUs, at most 16. The rest is the training process's: on one H200 with 16 CPUs, a ViT-B/32 run fed
    by 12 workers outran the same run with 8 or 15 (docs/BENCHMARKS.md). The cap bounds the shared memory the
    prefetched batches hold (4 per worker: 0.6 GB per worker at ViT-B/32's batch of 1,024)."""
    per_rank = (os.cpu_count() or 2) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, min(16, per_rank * 3 // 4))


PREFETCH_FACTOR = 4  # batches each worker keeps ready


def loader_shared_memory(cfg: DataConfig, image_size: int, context_length: int, canvas: int, world_size: int) -> int:
    """Bytes of shared memory one rank's training loader may hold at once: every worker's prefetched batches and the
    one it is building, each its uint8 pixels (canvases with `canvas`, clips of data.frames frames) and tokens."""
    frames = max(1, cfg.frames)
    side = canvas or image_size
    per_sample = frames * 3 * side * side + context_length * 8
    return cfg.num_workers * (PREFETCH_FACTOR + 1) * (cfg.batch_size // world_size) * per_sample


def decode_pixels(
    sample: dict, frames: int, size: int, rng: random.Random | None, scale_min: float, max_pixels: int | None,
    flip: bool = True, *, preprocess: Preprocess,
) -> torch.Tensor:
    """An image sample to (3, size, size), or, with `frames` > 0, a packed clip to (frames, 3, size, size),
    randomly mirrored when `flip`; uint8, resized and augmented as `preprocess` says. Raises KeyError when the
    sample has no image (or no frames), and OversizedImage for an image (or frame) of more than `max_pixels`
    pixels."""
    if frames:
        return decode_clip(sample, frames, size, rng, scale_min, max_pixels, flip, preprocess=preprocess)
    return decode_image(image_bytes(sample), size, rng, scale_min, max_pixels, preprocess=preprocess)


def decode_caption(sample: dict, bad: BadData) -> str | None:
    """A sample's caption, or None (counted as `missing_caption` or `bad_caption`)."""
    if "txt" not in sample:
        bad.add("missing_caption", sample["__url__"])
        return None
    try:
        return sample["txt"].decode("utf-8")
    except UnicodeDecodeError:
        bad.add("bad_caption", sample["__url__"])
        return None


def decode_sample_pixels(
    sample: dict, bad: BadData, *, frames: int, size: int, rng: random.Random | None, scale_min: float,
    max_pixels: int | None, flip: bool, preprocess: Preprocess, canvas: int = 0, device_decode: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    """`decode_pixels` (with `canvas`, a training image's canvas and crop box for the device to resize:
    `decode_for_device`; with `device_decode`, its JPEG and crop box for the device to decode: `jpeg_for_device`),
    or None for a sample to skip, counted by reason (`missing_image`, `oversized_image`, `corrupt_image`): the one
    decision of what bad data is, for training and evaluation alike."""
    url = sample["__url__"]
    try:
        if device_decode:
            return jpeg_for_device(sample, size, rng, scale_min, max_pixels, preprocess)
        if canvas:
            return decode_for_device(sample, size, rng, scale_min, max_pixels, canvas, preprocess)
        return decode_pixels(sample, frames, size, rng, scale_min, max_pixels, flip, preprocess=preprocess)
    except KeyError:
        bad.add("missing_image", url)
        return None
    except TooFewFrames:
        raise
    except OversizedImage as err:
        log.debug("skipping %s in %s: %s", sample.get("__key__"), url, err)
        bad.add("oversized_image", url)
        return None
    except Exception as err:  # PIL raises many types for broken files; any of them means skip this one
        log.debug("skipping %s in %s: %s", sample.get("__key__"), url, err)
        bad.add("corrupt_image", url)
        return None


def resolve_sources(cfg: DataConfig) -> tuple[list[list[str]], list[float]]:
    """Shard lists and weights of `data.sources`, or of `data.shards` as a single source."""
    if cfg.shards and cfg.sources:
        raise ValueError("set data.shards (one source) or data.sources (several, with weights), not both")
    if not cfg.shards and not cfg.sources:
        raise ValueError("no training data: set data.shards='/path/{00000..00099}.tar' or data.sources")
    check_pipe_allowed(cfg)
    if cfg.shards:
        return [expand_shards(cfg.shards)], [1.0]
    sources = [expand_shards(s.shards, key=f"data.sources[{i}].shards") for i, s in enumerate(cfg.sources)]
    weights = [s.weight for s in cfg.sources]
    if any(w <= 0 for w in weights):
        raise ValueError(f"data.sources weights must be positive, got {weights}")
    if cfg.mode == "epoch" and len(set(weights)) > 1:
        raise ValueError(
            f"data.sources has weights {weights}, but data.mode=epoch reads every sample once per epoch: "
            "use data.mode=resampled to mix sources by weight"
        )
    return sources, weights


def check_batch_size(batch_size: int, world_size: int) -> None:
    if batch_size % world_size:
        raise ValueError(
            f"data.batch_size={batch_size} is not divisible by the world size {world_size}: the global batch is "
            f"split evenly across ranks, so set data.batch_size to a multiple of {world_size}"
        )


@dataclass(frozen=True)
class ReaderState:
    """What a worker's batch carries about its reader: the role, the position right after the batch and the
    bad-data counts. One object rather than entries of the batch's dict, because the DataLoader's pinning thread
    rebuilds every list and dict it finds, and a position holds one tag per sample in the shuffle buffer
    (data.shuffle_buffer, 5,000 by default): 10-20 ms a batch, in the training process and holding its GIL."""

    role: int
    position: dict
    bad: dict


def as_built(batch: dict) -> dict:
    """The DataLoader's hook for an item from a worker (`collate_fn` with batch_size=None): the batch the worker
    built, as it is. The default, default_convert, rebuilds every list and dict in it: 10-20 ms a batch of 1,024
    keys and a 5,000-sample buffer's position, in the worker (docs/benchmarks-history.md, loader)."""
    return batch


class TrainStream(IterableDataset):
    """Endless batches for one rank; each DataLoader worker plays one reader role."""

    def __init__(
        self, sources: list[list[str]], weights: list[float], cfg: DataConfig, *, batch_size: int,
        image_size: int, context_length: int, seed: int, rank: int, world_size: int, positions: list[dict | None],
        role_offset: int, bad_counts: list[dict], canvas: int = 0, device_decode: bool = False,
    ):
        self.sources, self.weights, self.cfg, self.canvas = sources, weights, cfg, canvas
        self.device_decode = device_decode
        self.batch_size, self.image_size, self.context_length = batch_size, image_size, context_length
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.positions, self.role_offset, self.bad_counts = positions, role_offset, bad_counts
        self.preprocess = Preprocess.from_config(cfg)

    def _reader(self, role: int, bad: BadData) -> Reader:
        num_readers = self.world_size * len(self.positions)
        reader_id = self.rank * len(self.positions) + role
        shards = [url for source in self.sources for url in source]
        quota = None
        if self.cfg.mode == "resampled":
            quota = math.ceil(self.cfg.samples_per_epoch / num_readers)

            def shards_of_epoch(epoch: int) -> Sequence[str]:
                return ResampledShards(self.sources, self.weights, f"resample-{self.seed}-{epoch}-{reader_id}")
        else:
            def shards_of_epoch(epoch: int) -> Sequence[str]:
                return shards_for_reader(shards, seed=self.seed, epoch=epoch, reader=reader_id,
                                         num_readers=num_readers)
        return Reader(shards_of_epoch, quota=quota, buffer_size=self.cfg.shuffle_buffer,
                      rng_seed=f"buffer-{self.seed}-{reader_id}", bad=bad, retries=self.cfg.shard_retries)

    def _decode(self, sample: dict, epoch: int, bad: BadData) -> tuple[torch.Tensor, str] | None:
        caption = decode_caption(sample, bad)
        if caption is None:
            return None
        rng = random.Random(f"crop-{self.seed}-{epoch}-{sample['__url__']}-{sample['__key__']}")
        pixels = decode_sample_pixels(sample, bad, frames=self.cfg.frames, size=self.image_size, rng=rng,
                                      scale_min=self.cfg.crop_scale_min, max_pixels=self.cfg.max_image_pixels,
                                      flip=self.cfg.hflip, preprocess=self.preprocess, canvas=self.canvas,
                                      device_decode=self.device_decode)
        return None if pixels is None else (pixels, caption)

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        role = (worker + self.role_offset) % len(self.positions)
        bad = BadData()
        bad.counts.update(self.bad_counts[role].get("counts", {}))
        bad.shards.update(self.bad_counts[role].get("shards", {}))
        reader = self._reader(role, bad)
        saved = self.positions[role]
        images, captions, keys = [], [], []
        for sample in reader.samples(Position.from_state(saved) if saved else Position()):
            decoded = self._decode(sample, reader.epoch, bad)
            if decoded is None:
                continue
            images.append(decoded[0])
            captions.append(decoded[1])
            keys.append(sample["__key__"])
            if len(images) == self.batch_size:
                # In a worker, default_collate stacks straight into shared memory; torch.stack would make a
                # private batch that sending it to the training process then copies again.
                if self.device_decode:
                    batch = collate_for_device(images, in_worker=info is not None)
                elif self.canvas:
                    batch = dict(zip(("images", "boxes"), default_collate(images)))
                else:
                    batch = {"images": default_collate(images)}
                yield {
                    **batch, "tokens": tokenize(captions, self.context_length), "keys": keys,
                    "reader": ReaderState(role, reader.current_position().to_state(),
                                          {"counts": dict(bad.counts), "shards": dict(bad.shards)}),
                }
                images, captions, keys = [], [], []


class TrainLoader:
    """Iterates this rank's batches ({"images": uint8 (B, 3, H, W), "tokens": (B, L), "keys": [...]}) and
    knows its own resume position. With `canvas` (src/data/device_crop.py) "images" are (B, 3, canvas, canvas)
    canvases and "boxes" (B, 4) their crops, for `resize_crops` on the training device. With `decoder`
    (src/data/device_decode.py) the workers ship JPEGs, and "images" come decoded and cropped on its device."""

    def __init__(
        self, cfg: DataConfig, *, image_size: int, context_length: int, seed: int, rank: int = 0,
        world_size: int = 1, pin_memory: bool = False, canvas: int = 0, decoder: DeviceDecoder | None = None,
    ):
        check_batch_size(cfg.batch_size, world_size)
        if cfg.mode not in MODES:
            raise ValueError(f"data.mode={cfg.mode!r} is not one of {', '.join(MODES)}")
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.sources, self.weights = resolve_sources(cfg)
        num_roles = max(1, cfg.num_workers)
        shards = [url for source in self.sources for url in source]
        self.sizes = read_sizes(shards)
        if cfg.mode == "resampled" and cfg.samples_per_epoch is None:
            if self.sizes is None:
                raise ValueError("data.mode=resampled needs data.samples_per_epoch (no sizes.json beside the shards)")
            cfg.samples_per_epoch = sum(self.sizes.values())
        if cfg.mode == "epoch":
            shards_for_reader(shards, seed=seed, epoch=0, reader=0, num_readers=world_size * num_roles)
        self.kwargs = dict(
            batch_size=cfg.batch_size // world_size, image_size=image_size, context_length=context_length,
            seed=seed, rank=rank, world_size=world_size, canvas=canvas, device_decode=decoder is not None,
        )
        self.decoder = decoder
        self.undecodable = 0  # samples the decoder replaced: corrupt images found after the workers
        self._decoding: deque = deque()  # (reader state, decode future) in batch order
        self.pin_memory = pin_memory
        self.positions: list[dict | None] = [None] * num_roles
        self.bad: list[dict] = [{} for _ in range(num_roles)]
        self.batches = 0
        self._iterator: Iterator[dict] | None = None

    def _start(self) -> Iterator[dict]:
        stream = TrainStream(
            self.sources, self.weights, self.cfg, positions=list(self.positions),
            role_offset=self.batches % len(self.positions), bad_counts=list(self.bad), **self.kwargs,
        )
        workers = self.cfg.num_workers
        check_worker_temp_dir(workers)
        # Its own generator: otherwise starting the workers draws from the global RNG, and a resumed run
        # (which starts them later) would see different patch-dropout draws than an uninterrupted one.
        loader = DataLoader(
            stream, batch_size=None, collate_fn=as_built, num_workers=workers, pin_memory=self.pin_memory,
            persistent_workers=workers > 0, prefetch_factor=PREFETCH_FACTOR if workers > 0 else None,
            worker_init_fn=functools.partial(shield_worker, trainer=os.getpid()),
            generator=torch.Generator().manual_seed(self.kwargs["seed"]),
        )
        with start_workers():
            return iter(loader)

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        if self._iterator is None:
            self._iterator = self._start()
        if self.decoder is None:
            batch = next(self._iterator)
            state = batch.pop("reader")
        else:  # the decoder's threads work on the next batches meanwhile; the position is the returned batch's
            while len(self._decoding) < self.decoder.depth:
                raw = next(self._iterator)
                self._decoding.append((raw.pop("reader"), self.decoder.submit(raw)))
            state, future = self._decoding.popleft()
            batch, failed = self.decoder.result(future)
            self.undecodable += len(failed)  # JPEGs neither the device nor the host could decode
        batch.update(role=state.role, position=state.position, bad=state.bad)
        self.positions[state.role] = state.position
        self.bad[state.role] = state.bad
        self.batches += 1
        self._check_bad_fraction()
        return batch

    def close(self) -> None:
        """Ends the loader's worker processes and decode threads, dropping the batches they had read ahead. A later
        `next` starts them again from the last batch returned, as a resumed run does, so the batches are the same
        as without the pause."""
        if self.decoder is not None:
            self.decoder.close()
        self._decoding.clear()
        self._iterator = None  # the DataLoader's iterator ends its workers when it goes

    def bad_counts(self) -> dict[str, int]:
        """Skipped data of this rank so far, by reason."""
        total: Counter[str] = Counter()
        for role in self.bad:
            total.update(role.get("counts", {}))
        if self.undecodable:
            total["corrupt_image"] += self.undecodable
        return dict(total)

    def _check_bad_fraction(self) -> None:
        bad = sum(n for reason, n in self.bad_counts().items() if not reason.endswith("_shard"))
        seen = bad + self.batches * self.kwargs["batch_size"]
        if bad >= MIN_BAD_TO_JUDGE and bad / seen > self.cfg.max_bad_fraction:
            shards: Counter[str] = Counter()
            for role in self.bad:
                shards.update(role.get("shards", {}))
            worst = ", ".join(f"{url} ({n})" for url, n in shards.most_common(5))
            raise RuntimeError(
                f"{bad} of {seen} samples ({bad / seen:.1%}) were bad, above data.max_bad_fraction="
                f"{self.cfg.max_bad_fraction}: {self.bad_counts()}. Worst shards: {worst}. "
                "Check them with scripts/inspect_shards.py, or raise data.max_bad_fraction."
            )

    @property
    def epoch(self) -> int:
        return min((p["epoch"] if p else 0) for p in self.positions)

    def state_dict(self) -> dict:
        state = {"positions": list(self.positions), "batches": self.batches, "bad": list(self.bad),
                 "world_size": self.world_size, "mode": str(self.cfg.mode)}
        if self.decoder is not None:
            state["undecodable"] = self.undecodable
        return state

    def load_state_dict(self, state: dict) -> None:
        if self._iterator is not None:
            raise RuntimeError("load the loader state before iterating")
        saved_roles, saved_world = len(state["positions"]), state["world_size"]
        if (saved_roles, saved_world) != (len(self.positions), self.world_size):
            if self.cfg.mode == "resampled":
                # Draws with replacement have no "rest of the epoch" to protect: start fresh draws, keep counts.
                log.warning("data position saved for world size %d x %d workers; this run has %d x %d: "
                            "resampled mode starts new draws", saved_world, saved_roles, self.world_size,
                            len(self.positions))
                self.batches = state["batches"]
                return
            raise ValueError(
                f"the checkpoint's data position is for world size {saved_world} with "
                f"data.num_workers={saved_roles}, but this run has world size {self.world_size} with "
                f"data.num_workers={len(self.positions)}: resume with the same world size and "
                "data.num_workers to continue the epoch exactly, or use data.mode=resampled"
            )
        self.positions = list(state["positions"])
        self.batches = state["batches"]
        self.bad = list(state["bad"])
        self.undecodable = state.get("undecodable", 0)  # absent from checkpoints of loaders without a decoder


# One unit of held-out data: (its place in the set, a shard URL or an image file, the file's class index or -1).
EvalUnit = tuple[int, str, int]


def sample_label(sample: dict, bad: BadData) -> int | None:
    """A labelled sample's class index (`json`'s "label", or a `cls` member as webdataset's ImageNet shards
    have), -1 without a label, None for a label that does not parse (counted as `bad_label`)."""
    try:
        if "json" in sample:
            return int(json.loads(sample["json"]).get("label", -1))
        if "cls" in sample:
            return int(sample["cls"].decode("ascii"))
    except (ValueError, TypeError, AttributeError, UnicodeDecodeError):
        bad.add("bad_label", sample["__url__"])
        return None
    return -1


class EvalStream(IterableDataset):
    """One ordered pass over units of held-out data (shards, or the files of an image folder): images (or clips)
    through the deterministic transform of `preprocess`, tokens when `captions`, class labels, and each sample's
    place in the whole set (`order`: shard index << 32 | index in the shard, or the file's index), so that shares
    read by several ranks and workers can be put back in the set's order. Bad samples are skipped and counted as in
    training; every worker ends with an item holding only its counts ({"worker", "bad"})."""

    def __init__(self, units: list[EvalUnit], *, folder: bool, captions: bool, batch_size: int, image_size: int,
                 context_length: int, frames: int, max_image_pixels: int | None, retries: int,
                 preprocess: Preprocess):
        self.units, self.folder, self.captions, self.batch_size = units, folder, captions, batch_size
        self.image_size, self.context_length, self.frames = image_size, context_length, frames
        self.max_image_pixels, self.retries, self.preprocess = max_image_pixels, retries, preprocess

    def _samples(self, units: list[EvalUnit], bad: BadData) -> Iterator[tuple[int, dict, int | None]]:
        for index, path, label in units:
            if not self.folder:
                for offset, sample in enumerate(read_shard(path, bad, self.retries)):
                    yield (index << 32) | offset, sample, sample_label(sample, bad)
                continue
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError as err:
                log.warning("skipping %s: %s", path, err)
                bad.add("unreadable_file", path)
                continue
            # Under any image key: the decoder reads the format from the bytes (PIL), as it does for shards.
            yield index, {"jpg": data, "__url__": path, "__key__": path}, label

    def _batch(self, images: list, captions: list, labels: list, order: list, worker: int, bad: BadData) -> dict:
        batch = {"images": default_collate(images), "labels": torch.tensor(labels), "order": torch.tensor(order),
                 "worker": worker, "bad": dict(bad.counts)}
        if self.captions:
            batch["tokens"] = tokenize(captions, self.context_length)
        return batch

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        units = self.units[info.id :: info.num_workers] if info is not None else self.units
        bad = BadData()
        images, captions, labels, order = [], [], [], []
        for place, sample, label in self._samples(units, bad):
            caption = decode_caption(sample, bad) if self.captions else ""
            if caption is None or label is None:
                continue
            pixels = decode_sample_pixels(sample, bad, frames=self.frames, size=self.image_size, rng=None,
                                          scale_min=1.0, max_pixels=self.max_image_pixels, flip=False,
                                          preprocess=self.preprocess)
            if pixels is None:
                continue
            images.append(pixels)
            captions.append(caption)
            labels.append(label)
            order.append(place)
            if len(images) == self.batch_size:
                yield self._batch(images, captions, labels, order, worker, bad)
                images, captions, labels, order = [], [], [], []
        if images:
            yield self._batch(images, captions, labels, order, worker, bad)
        yield {"worker": worker, "bad": dict(bad.counts)}


class EvalBatches:
    """The batches of one pass over held-out data; `bad_counts()` then holds what it skipped, by reason."""

    def __init__(self, loader: DataLoader):
        self.loader = loader
        self.bad: dict[int, dict[str, int]] = {}
        self._items: Iterator[dict] | None = None

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        if self._items is None:
            with start_workers():
                self._items = iter(self.loader)
        while True:
            item = next(self._items)
            self.bad[item["worker"]] = item["bad"]
            if "images" in item:
                return item

    def bad_counts(self) -> dict[str, int]:
        total: Counter[str] = Counter()
        for counts in self.bad.values():
            total.update(counts)
        return dict(total)


def eval_loader(units: list[EvalUnit], *, folder: bool, captions: bool, batch_size: int, image_size: int,
                context_length: int, num_workers: int, frames: int, max_image_pixels: int | None,
                retries: int, preprocess: Preprocess) -> EvalBatches:
    stream = EvalStream(units, folder=folder, captions=captions, batch_size=batch_size, image_size=image_size,
                        context_length=context_length, frames=frames, max_image_pixels=max_image_pixels,
                        retries=retries, preprocess=preprocess)
    check_worker_temp_dir(num_workers)
    workers = min(num_workers, len(units))
    loader = DataLoader(stream, batch_size=None, num_workers=workers,
                        multiprocessing_context=worker_start_method() if workers else None,
                        worker_init_fn=functools.partial(shield_worker, trainer=os.getpid()))
    return EvalBatches(loader)


def eval_batches(
    pattern: str, *, batch_size: int, image_size: int, context_length: int, num_workers: int, frames: int = 0,
    max_image_pixels: int | None = None, retries: int = 0, captions: bool = True, rank: int = 0,
    world_size: int = 1, key: str = "data.eval_shards", preprocess: Preprocess,
) -> EvalBatches:
    """One ordered pass over held-out shards: images (or clips of `frames` middle frames), tokens (when
    `captions`), labels. `max_image_pixels` (data.max_image_pixels) refuses larger images; None leaves only PIL's
    own limit. `rank` of `world_size` reads every world_size-th shard. `key` names the pattern in errors.
    `preprocess`: the run's (`Preprocess.from_config(cfg.data)`), of which evaluation takes the interpolation and
    resize mode and no augmentation."""
    shards = expand_shards(pattern, key=key)
    units = [(index, url, -1) for index, url in enumerate(shards)][rank::world_size]
    return eval_loader(units, folder=False, captions=captions, batch_size=batch_size, image_size=image_size,
                       context_length=context_length, num_workers=num_workers, frames=frames,
                       max_image_pixels=max_image_pixels, retries=retries, preprocess=preprocess)


def image_folder(root: str) -> tuple[list[str], list[tuple[str, int]]]:
    """The class directories (sorted) and the (file, class index) pairs of an image tree root/<class>/<file>,
    as torchvision's ImageFolder finds them (its image extensions, sorted)."""
    from torchvision.datasets import ImageFolder

    tree = ImageFolder(root)
    return tree.classes, tree.samples


def eval_folder_batches(
    samples: list[tuple[str, int]], *, batch_size: int, image_size: int, num_workers: int,
    max_image_pixels: int | None, rank: int = 0, world_size: int = 1, preprocess: Preprocess,
) -> EvalBatches:
    """One ordered pass over the files of an image folder (`image_folder`'s pairs): images through the
    deterministic transform of `preprocess`, and their labels, no tokens. `rank` of `world_size` reads every
    world_size-th file."""
    units = [(index, path, label) for index, (path, label) in enumerate(samples)][rank::world_size]
    return eval_loader(units, folder=True, captions=False, batch_size=batch_size, image_size=image_size,
                       context_length=0, num_workers=num_workers, frames=0, max_image_pixels=max_image_pixels,
                       retries=0, preprocess=preprocess)
