"""Shard lists: expand brace patterns, check they exist, and give each reader its deterministic share."""

from __future__ import annotations

import json
import os
import random

from webdataset.shardlists import expand_urls

from src.config import DataConfig

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")  # the image members a sample may have, in order of preference


def is_local(url: str) -> bool:
    return not url.startswith("pipe:") and "://" not in url


def expand_shards(pattern: str, key: str = "data.shards") -> list[str]:
    """Expand `a/{000..009}.tar` (and `::`-joined lists); local files must all exist."""
    urls = expand_urls(pattern) if pattern else []
    missing = [u for u in urls if is_local(u) and not os.path.isfile(u)]
    if not urls or len(missing) == len(urls):
        raise FileNotFoundError(f"{key} matched no files: {pattern!r}")
    if missing:
        shown = ", ".join(repr(m) for m in missing[:3])
        raise FileNotFoundError(
            f"{key}={pattern!r}: {len(missing)} of {len(urls)} shards do not exist ({shown}...): "
            "fix the pattern or the missing files"
        )
    return urls


def check_pipe_allowed(data: DataConfig) -> None:
    """A `pipe:` URL runs its text as a shell command, so a configuration shared between people would run one
    person's commands as another: such URLs need an explicit data.allow_pipe=true."""
    if data.allow_pipe:
        return
    patterns = {"data.shards": data.shards, "data.eval_shards": data.eval_shards,
                **{f"data.sources[{i}].shards": source.shards for i, source in enumerate(data.sources)}}
    for key, pattern in patterns.items():
        command = next((url for url in (expand_urls(pattern) if pattern else []) if url.startswith("pipe:")), None)
        if command is not None:
            raise ValueError(
                f"{key} holds {command!r}, a pipe: URL, which runs a shell command, but data.allow_pipe=false: set "
                "data.allow_pipe=true if you trust every command of this configuration, or use local shards"
            )


def shards_for_reader(
    shards: list[str], *, seed: int, epoch: int, reader: int, num_readers: int
) -> list[str]:
    """This reader's shards for `epoch`. Every rank computes the same permutation from (seed, epoch), so
    the readers (rank × worker) partition the shard list exactly: each sample once per epoch."""
    if len(shards) < num_readers:
        raise ValueError(
            f"{len(shards)} shards cannot feed {num_readers} readers (world size × data.num_workers): "
            "every reader needs at least one shard. Write smaller shards or lower data.num_workers."
        )
    order = list(shards)
    random.Random(f"shards-{seed}-{epoch}").shuffle(order)
    return order[reader::num_readers]


def stats_count(shard: str) -> int | None:
    """img2dataset's per-shard count: `successes` in `{shard without .tar}_stats.json`."""
    path = shard.removesuffix(".tar") + "_stats.json"
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f).get("successes")


def recorded_sizes(shards: list[str]) -> dict[str, int]:
    """The sample count of each local shard that has one: from the `sizes.json` beside it ({shard file name:
    count}) or else img2dataset's `_stats.json`."""
    sizes: dict[str, int] = {}
    for directory in sorted({os.path.dirname(s) for s in shards if is_local(s)}):
        path = os.path.join(directory, "sizes.json")
        if os.path.isfile(path):
            with open(path) as f:
                sizes.update({os.path.join(directory, name): n for name, n in json.load(f).items()})
    for shard in shards:
        if shard not in sizes and is_local(shard) and (count := stats_count(shard)) is not None:
            sizes[shard] = count
    return {s: sizes[s] for s in shards if s in sizes}


def read_sizes(shards: list[str]) -> dict[str, int] | None:
    """Sample count of every shard (`recorded_sizes`); None when any shard's count is unknown."""
    sizes = recorded_sizes(shards)
    return sizes if len(sizes) == len(set(shards)) else None
