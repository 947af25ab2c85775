"""Training and evaluation loaders over image-text webdataset shards.

Training is one endless stream per rank. Each reader (rank × worker) reads its share of epoch e's shards
(see `shards_for_reader`), shuffles samples through a buffer, then moves on to epoch e + 1. Within an
epoch every sample is read exactly once across all readers.

Resume is exact. Each batch carries its reader's position (epoch, raw samples taken from the shuffle
buffer in that epoch); the loader's state holds the last position of every reader. A resumed reader
replays its epoch's shards up to that position without decoding images, so buffer contents, crops and
batch order continue as if the run had never stopped. DataLoader hands out batches from workers in
round-robin order, so a resumed loader rotates the reader roles of its workers to keep that order.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterator

import torch
import webdataset as wds
from open_clip.tokenizer import tokenize
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from src.config import DataConfig
from src.data.image_text import decode_image, image_bytes
from src.data.shards import expand_shards, shards_for_reader

log = logging.getLogger(__name__)


def read_samples(urls: list[str]) -> Iterator[dict]:
    """Raw samples (a dict of member bytes keyed by extension) from tar shards, in order."""
    return wds.tariterators.tarfile_samples([{"url": u} for u in urls])


def buffer_shuffle(samples: Iterator[dict], size: int, rng: random.Random) -> Iterator[dict]:
    buffer: list[dict] = []
    for sample in samples:
        if len(buffer) < size:
            buffer.append(sample)
            continue
        i = rng.randrange(size)
        buffer[i], sample = sample, buffer[i]
        yield sample
    rng.shuffle(buffer)
    yield from buffer


class TrainStream(IterableDataset):
    """Endless batches for one rank; each DataLoader worker plays one reader role."""

    def __init__(
        self, shards: list[str], cfg: DataConfig, *, batch_size: int, image_size: int, context_length: int,
        seed: int, rank: int, world_size: int, positions: list[tuple[int, int]], role_offset: int,
        bad_samples: list[int],
    ):
        self.shards, self.cfg = shards, cfg
        self.batch_size, self.image_size, self.context_length = batch_size, image_size, context_length
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.positions, self.role_offset, self.bad_samples = positions, role_offset, bad_samples

    def _epoch_samples(self, role: int, epoch: int) -> Iterator[dict]:
        num_roles = len(self.positions)
        urls = shards_for_reader(
            self.shards, seed=self.seed, epoch=epoch,
            reader=self.rank * num_roles + role, num_readers=self.world_size * num_roles,
        )
        rng = random.Random(f"buffer-{self.seed}-{epoch}-{self.rank}-{role}")
        return buffer_shuffle(read_samples(urls), self.cfg.shuffle_buffer, rng)

    def _decode(self, sample: dict, epoch: int) -> tuple[torch.Tensor, str]:
        rng = random.Random(f"crop-{self.seed}-{epoch}-{sample['__url__']}-{sample['__key__']}")
        image = decode_image(image_bytes(sample), self.image_size, rng, self.cfg.crop_scale_min)
        return image, sample["txt"].decode("utf-8")

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        role = (worker + self.role_offset) % len(self.positions)
        epoch, done = self.positions[role]
        images, captions, keys, bad = [], [], [], self.bad_samples[role]
        while True:
            samples = self._epoch_samples(role, epoch)
            for _ in range(done):  # replay to the saved position without decoding
                next(samples)
            for sample in samples:
                done += 1
                try:
                    image, caption = self._decode(sample, epoch)
                except Exception as err:  # a bad sample must not stop a week-long run
                    bad += 1
                    log.warning("skipping sample %s in %s: %s", sample.get("__key__"), sample["__url__"], err)
                    continue
                images.append(image)
                captions.append(caption)
                keys.append(sample["__key__"])
                if len(images) == self.batch_size:
                    yield {
                        "images": torch.stack(images), "tokens": tokenize(captions, self.context_length),
                        "keys": keys, "role": role, "epoch": epoch, "done": done, "bad_samples": bad,
                    }
                    images, captions, keys = [], [], []
            epoch, done = epoch + 1, 0


class TrainLoader:
    """Iterates this rank's batches ({"images": uint8 (B, 3, H, W), "tokens": (B, L), "keys": [...]}) and
    knows its own resume position."""

    def __init__(
        self, cfg: DataConfig, *, image_size: int, context_length: int, seed: int, rank: int = 0,
        world_size: int = 1, pin_memory: bool = False,
    ):
        if cfg.batch_size % world_size:
            raise ValueError(
                f"data.batch_size={cfg.batch_size} is not divisible by the world size {world_size}: "
                "the global batch is split evenly across ranks"
            )
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.shards = expand_shards(cfg.shards)
        num_roles = max(1, cfg.num_workers)
        shards_for_reader(self.shards, seed=seed, epoch=0, reader=0, num_readers=world_size * num_roles)
        self.kwargs = dict(
            batch_size=cfg.batch_size // world_size, image_size=image_size, context_length=context_length,
            seed=seed, rank=rank, world_size=world_size,
        )
        self.pin_memory = pin_memory
        self.positions = [(0, 0)] * num_roles
        self.batches = 0
        self.bad_samples = [0] * num_roles
        self._iterator: Iterator[dict] | None = None

    def _start(self) -> Iterator[dict]:
        stream = TrainStream(
            self.shards, self.cfg, positions=list(self.positions),
            role_offset=self.batches % len(self.positions), bad_samples=list(self.bad_samples), **self.kwargs,
        )
        workers = self.cfg.num_workers
        # Its own generator: otherwise starting the workers draws from the global RNG, and a resumed run
        # (which starts them later) would see different patch-dropout draws than an uninterrupted one.
        return iter(DataLoader(
            stream, batch_size=None, num_workers=workers, pin_memory=self.pin_memory,
            persistent_workers=workers > 0, prefetch_factor=4 if workers > 0 else None,
            generator=torch.Generator().manual_seed(self.kwargs["seed"]),
        ))

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        if self._iterator is None:
            self._iterator = self._start()
        batch = next(self._iterator)
        self.positions[batch["role"]] = (batch["epoch"], batch["done"])
        self.bad_samples[batch["role"]] = batch["bad_samples"]
        self.batches += 1
        return batch

    @property
    def epoch(self) -> int:
        return min(epoch for epoch, _ in self.positions)

    def state_dict(self) -> dict:
        return {
            "positions": [list(p) for p in self.positions], "batches": self.batches,
            "bad_samples": list(self.bad_samples), "world_size": self.world_size,
        }

    def load_state_dict(self, state: dict) -> None:
        if self._iterator is not None:
            raise RuntimeError("load the loader state before iterating")
        saved_roles, saved_world = len(state["positions"]), state["world_size"]
        if (saved_roles, saved_world) != (len(self.positions), self.world_size):
            raise ValueError(
                f"the checkpoint's data position is for world size {saved_world} with "
                f"data.num_workers={saved_roles}, but this run has world size {self.world_size} with "
                f"data.num_workers={len(self.positions)}: resume with the same world size and "
                "data.num_workers to continue the epoch exactly"
            )
        self.positions = [tuple(p) for p in state["positions"]]
        self.batches = state["batches"]
        self.bad_samples = list(state["bad_samples"])


class EvalStream(IterableDataset):
    """One ordered pass over held-out shards: centre-cropped images, tokens and class labels."""

    def __init__(self, shards: list[str], *, batch_size: int, image_size: int, context_length: int):
        self.shards, self.batch_size = shards, batch_size
        self.image_size, self.context_length = image_size, context_length

    def _batch(self, images: list, captions: list, labels: list) -> dict:
        return {
            "images": torch.stack(images), "tokens": tokenize(captions, self.context_length),
            "labels": torch.tensor(labels),
        }

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        shards = self.shards[info.id :: info.num_workers] if info is not None else self.shards
        images, captions, labels = [], [], []
        for sample in read_samples(shards):
            images.append(decode_image(image_bytes(sample), self.image_size, None, 1.0))
            captions.append(sample["txt"].decode("utf-8"))
            labels.append(json.loads(sample["json"]).get("label", -1) if "json" in sample else -1)
            if len(images) == self.batch_size:
                yield self._batch(images, captions, labels)
                images, captions, labels = [], [], []
        if images:
            yield self._batch(images, captions, labels)


def eval_batches(
    pattern: str, *, batch_size: int, image_size: int, context_length: int, num_workers: int
) -> Iterator[dict]:
    shards = expand_shards(pattern, key="data.eval_shards")
    stream = EvalStream(shards, batch_size=batch_size, image_size=image_size, context_length=context_length)
    return iter(DataLoader(stream, batch_size=None, num_workers=min(num_workers, len(shards))))
