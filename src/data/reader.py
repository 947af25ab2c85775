"""One reader's endless, resumable stream of raw samples: shard after shard, through a shuffle buffer.

A reader is one (rank, DataLoader worker). For each epoch it gets a sequence of shards (its share of the
epoch's permutation in epoch mode, weighted draws with replacement in resampled mode), reads them in
order and shuffles samples through a buffer. Its `Position` says exactly where it is: the shard being
read and how many of its samples were read, which samples (shard, index) sit in the buffer, and the
buffer's RNG state. A position can be saved at any batch boundary. Resuming from it re-reads only the
shards that hold buffered samples plus the current one (a few shards, not the epoch), and then continues
exactly as the uninterrupted run would have: same samples, same order.
"""

from __future__ import annotations

import logging
import random
import re
import tarfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from webdataset import gopen
from webdataset.tariterators import group_by_keys

from src.data.processes import EXIT_GRACE_S, CommandStream

log = logging.getLogger(__name__)

Tag = tuple[int, int]  # (shard index in the epoch's sequence, sample index within that shard)
# This many shards in a row without a single sample is not a dataset with some bad shards but one that cannot be
# reached (a directory without permission, expired credentials): the reader stops instead of spinning forever.
MAX_DEAD_SHARDS = 100


@dataclass
class Position:
    epoch: int = 0
    shard: int = 0
    offset: int = 0
    taken: int = 0  # samples read this epoch (resampled mode stops at its quota)
    buffer: list[Tag] = field(default_factory=list)
    rng: tuple | None = None
    draining: bool = False

    def to_state(self) -> dict:
        return {"epoch": self.epoch, "shard": self.shard, "offset": self.offset, "taken": self.taken,
                "buffer": [list(t) for t in self.buffer], "rng": self.rng, "draining": self.draining}

    @classmethod
    def from_state(cls, state: dict) -> Position:
        rng = state["rng"]
        rng = (rng[0], tuple(rng[1]), rng[2]) if rng is not None else None  # JSON/pickle turn tuples into lists
        return cls(state["epoch"], state["shard"], state["offset"], state["taken"],
                   [tuple(t) for t in state["buffer"]], rng, state["draining"])


class BadData:
    """Counts of skipped data by reason, and the shards where it happened (for the error message)."""

    def __init__(self):
        self.counts: Counter[str] = Counter()
        self.shards: Counter[str] = Counter()

    def add(self, reason: str, shard: str) -> None:
        self.counts[reason] += 1
        self.shards[shard] += 1


# Exit statuses of a `pipe:` command that say nothing about its data: killed by us after a grace period (None), or
# cut off by SIGPIPE when the reader stopped reading.
NOT_A_FAILURE = (0, None, 128 + 13)


META_MEMBER = re.compile(r"__[^/]*__($|/)")  # webdataset's metadata members, not part of any sample


class CheckedTarInfo(tarfile.TarInfo):
    """tarfile, reading a stream, stops without a word at a header that is cut short or garbled after the first
    member, so a shard cut at a member boundary, or garbage after good members, would look complete. A header
    that is not the end-of-archive block raises instead."""

    @classmethod
    def fromtarfile(cls, tar: tarfile.TarFile) -> tarfile.TarInfo:
        try:
            return super().fromtarfile(tar)
        except tarfile.EOFHeaderError:  # the end-of-archive block: a complete archive
            raise
        except tarfile.HeaderError as err:
            raise tarfile.ReadError(f"{type(err).__name__} at byte {tar.offset}: {err}") from None


def tar_members(stream, url: str) -> Iterator[dict]:
    """The regular members of a tar stream as webdataset's `group_by_keys` takes them; raises where the stream is
    cut short or corrupt. Members are bytes only: nothing is decoded or unpickled here."""
    with tarfile.open(fileobj=stream, mode="r|*", tarinfo=CheckedTarInfo) as tar:
        for member in tar:
            if member.isreg() and not META_MEMBER.match(member.name):
                yield {"fname": member.name, "data": tar.extractfile(member).read(), "__url__": url}
            tar.members = []  # stream mode would otherwise keep every header in memory


def open_stream(url: str):
    """A readable stream of one shard: a local file, a `pipe:` command's output, or webdataset's opener for URLs."""
    return CommandStream(url.removeprefix("pipe:")) if url.startswith("pipe:") else gopen(url)


def end_stream(stream, drain: bool, grace_s: float) -> str | None:
    """Close a shard's stream; why its source failed (a command's exit status), or None."""
    if isinstance(stream, CommandStream):
        status = stream.end(drain, grace_s)
        return None if status in NOT_A_FAILURE else f"{stream} exited with status {status}"
    try:
        stream.close()  # webdataset's command streams (curl for http://...) raise here for a failed command
    except Exception as err:
        return str(err)
    return None


def read_shard(url: str, bad: BadData, retries: int, retry_wait_s: float = 1.0) -> Iterator[dict]:
    """Samples of one tar (local path, `pipe:` command or URL), never fatal here. A shard that cannot be opened, or
    whose command fails before it gave a sample, is retried, then skipped (`unreadable_shard`). One that breaks
    after giving samples (truncated, garbage, a command failing midway) ends there (`truncated_shard`): reading it
    again would deliver its first samples twice. A complete tar without a sample is `empty_shard`."""
    for attempt in range(retries + 1):
        read, broken, failure = 0, None, None
        try:
            stream = open_stream(url)
        except Exception as err:
            failure = str(err)
        else:
            try:
                for sample in group_by_keys(tar_members(stream, url)):
                    read += 1
                    yield sample
            except GeneratorExit:  # the reader stopped early (its quota, the end of training): stop the command now
                end_stream(stream, drain=False, grace_s=0.0)
                raise
            except Exception as err:
                broken = err
            failure = end_stream(stream, drain=broken is None, grace_s=EXIT_GRACE_S)
        if broken is None and failure is None:
            if not read:  # a complete tar without a sample: counted, since sizes.json may promise samples there
                log.warning("shard %s holds no sample", url)
                bad.add("empty_shard", url)
            return
        if read or failure is None:
            log.warning("shard %s ends early after %d samples: %s", url, read, failure or broken)
            bad.add("truncated_shard", url)
            return
        if attempt == retries:
            log.warning("skipping shard %s: cannot open it after %d attempts (%s)", url, retries + 1, failure)
            bad.add("unreadable_shard", url)
            return
        time.sleep(retry_wait_s)


class Reader:
    def __init__(
        self, shards_of_epoch: Callable[[int], Sequence[str]], *, quota: int | None, buffer_size: int,
        rng_seed: str, bad: BadData, retries: int,
    ):
        self.shards_of_epoch, self.quota, self.buffer_size = shards_of_epoch, quota, buffer_size
        self.rng_seed, self.bad, self.retries = rng_seed, bad, retries
        self._live: tuple = ()

    def _refill(self, urls: Sequence[str], tags: list[Tag]) -> list[tuple[Tag, dict]]:
        """Re-read the buffered samples of a saved position, shard by shard, in their buffer order."""
        wanted: dict[int, set[int]] = {}
        for shard, index in tags:
            wanted.setdefault(shard, set()).add(index)
        found: dict[Tag, dict] = {}
        for shard, indices in wanted.items():
            for index, sample in enumerate(read_shard(urls[shard], self.bad, self.retries)):
                if index in indices:
                    found[(shard, index)] = sample
        return [(t, found[t]) for t in tags if t in found]

    @property
    def epoch(self) -> int:
        return self._live[0]

    def current_position(self) -> Position:
        """Where the stream stands right after the sample it yielded last (built on demand: it copies the
        buffer's tags, too slow to do for every sample)."""
        epoch, shard, offset, taken, buffer, rng, draining = self._live
        return Position(epoch, shard, offset, taken, [t for t, _ in buffer], rng.getstate(), draining)

    def samples(self, start: Position) -> Iterator[dict]:
        """Endless samples from `start`."""
        pos = start
        dead = 0  # shards in a row that gave no sample
        while True:
            urls = self.shards_of_epoch(pos.epoch)
            rng = random.Random(f"{self.rng_seed}-{pos.epoch}")
            if pos.rng is not None:
                rng.setstate(pos.rng)
            buffer = self._refill(urls, pos.buffer) if pos.buffer else []
            shard, offset, taken = pos.shard, pos.offset, pos.taken
            if not pos.draining:
                while shard < len(urls) and (self.quota is None or taken < self.quota):
                    url, empty = urls[shard], True
                    for index, sample in enumerate(read_shard(url, self.bad, self.retries)):
                        empty = False
                        if index < offset:
                            continue
                        offset, taken = index + 1, taken + 1
                        item = ((shard, index), sample)
                        if len(buffer) < self.buffer_size:
                            buffer.append(item)
                        else:
                            slot = rng.randrange(self.buffer_size)
                            buffer[slot], item = item, buffer[slot]
                            self._live = (pos.epoch, shard, offset, taken, buffer, rng, False)
                            yield item[1]
                        if self.quota is not None and taken >= self.quota:
                            break
                    else:
                        shard, offset = shard + 1, 0
                        dead = dead + 1 if empty else 0
                        if dead == MAX_DEAD_SHARDS:
                            raise RuntimeError(
                                f"{dead} shards in a row gave no sample, the last {url}: the data cannot be reached "
                                "(deleted, no read permission, a failing pipe: command) or is not tar files; skipped "
                                f"so far: {dict(self.bad.counts)}. Restore access to the shards (check them with "
                                "scripts/inspect_shards.py), then continue with trainer.resume=latest"
                            )
                rng.shuffle(buffer)  # drained from the end: popping there is O(1)
            while buffer:
                _, sample = buffer.pop()
                self._live = (pos.epoch, shard, offset, taken, buffer, rng, True)
                yield sample
            pos = Position(epoch=pos.epoch + 1)


class ResampledShards(Sequence[str]):
    """Shards drawn with replacement, by source weight then uniformly within the source. Indexable, so a
    resumed reader finds shard k of an epoch without replaying the draws before it."""

    def __init__(self, sources: list[list[str]], weights: list[float], seed: str):
        self.sources, self.weights, self.seed = sources, weights, seed

    def __len__(self) -> int:
        return 2**62

    def __getitem__(self, k: int) -> str:  # type: ignore[override]
        rng = random.Random(f"{self.seed}-{k}")
        source = rng.choices(self.sources, weights=self.weights)[0]
        return source[rng.randrange(len(source))]
