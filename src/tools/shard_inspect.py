"""Check webdataset shards: sample counts against sizes.json / _stats.json, member extensions, samples
missing an image or caption, undecodable or oversized images, truncated tars, and caption-length statistics. Reads bytes
only: nothing in a shard is executed or unpickled.
"""

from __future__ import annotations

import functools
import io
import json
import os
import re
import tarfile
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import numpy as np
from PIL import Image
from tqdm import tqdm
from webdataset.tariterators import base_plus_ext

from src.data.image_text import OversizedImage, check_pixels
from src.data.shards import IMAGE_EXTENSIONS, recorded_sizes
from src.tools.shard_writer import image_error


@dataclass
class ShardReport:
    shard: str
    samples: int = 0
    extensions: Counter = field(default_factory=Counter)
    problems: list[dict] = field(default_factory=list)
    caption_chars: list[int] = field(default_factory=list)
    caption_words: list[int] = field(default_factory=list)
    unreadable: bool = False

    def problem(self, kind: str, detail: str, key: str | None = None) -> None:
        self.problems.append({"shard": self.shard, "key": key, "kind": kind, "detail": detail})


def check_sample(sample: dict, report: ShardReport, max_pixels: int) -> None:
    """Verify one sample's image (full decode, unless its header says it has more than `max_pixels` pixels, which
    training skips as oversized_image), caption and metadata; only parses bytes, never unpickles."""
    key = sample["__key__"]
    report.samples += 1
    extension = next((e for e in IMAGE_EXTENSIONS if e in sample), None)
    if extension is None:
        report.problem("missing_image", f"no image member (.{'/.'.join(IMAGE_EXTENSIONS)})", key)
    else:
        try:
            with Image.open(io.BytesIO(sample[extension])) as img:  # reads the header only
                check_pixels(*img.size, max_pixels)
                img.load()
        except (OversizedImage, Image.DecompressionBombError) as err:
            report.problem("oversized_image", f".{extension}: {err}", key)
        except Exception as err:  # PIL raises many types for bad data
            report.problem("corrupt_image", f".{extension}: {image_error(err)}", key)
    if "txt" not in sample:
        report.problem("missing_caption", "no .txt member", key)
    else:
        try:
            caption = sample["txt"].decode("utf-8")
        except UnicodeDecodeError as err:
            report.problem("bad_caption", f"not UTF-8: {err}", key)
        else:
            if not caption.strip():
                report.problem("bad_caption", "empty caption", key)
            report.caption_chars.append(len(caption))
            report.caption_words.append(len(caption.split()))
    if "json" in sample:
        try:
            json.loads(sample["json"])
        except ValueError as err:
            report.problem("corrupt_json", str(err), key)


def tar_ends_cleanly(path: str, offset: int) -> bool:
    """Whether only end-of-archive zero blocks follow `offset`. tarfile silently stops at a truncated or
    garbled header, so without this check a shard cut at a member boundary would look complete."""
    with open(path, "rb") as f:
        f.seek(offset)
        length = 0
        while chunk := f.read(1 << 20):
            if chunk.count(0) != len(chunk):
                return False
            length += len(chunk)
    return length >= 2 * tarfile.BLOCKSIZE


def tar_members(path: str) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of the regular members of a local tar; raises when it is cut short or corrupt."""
    with tarfile.open(path, mode="r|*") as tar:
        for member in tar:
            tar.members = []  # stream mode would otherwise keep every header in memory
            if member.isreg():
                yield member.name, tar.extractfile(member).read()
        end = tar.offset
    if path.endswith(".tar") and not tar_ends_cleanly(path, end):
        raise tarfile.ReadError(f"no end-of-archive marker after byte {end}: truncated, or a corrupt header")


def inspect_shard(path: str, max_pixels: int) -> ShardReport:
    """Read every member of one shard, grouping members into samples the way webdataset does."""
    report = ShardReport(path)
    sample: dict | None = None
    seen: set[str] = set()
    try:
        for name, data in tar_members(path):
            key, extension = base_plus_ext(name)
            if key is None:
                report.problem("bad_member_name", f"{name!r} has no extension")
                continue
            extension = extension.lower()
            report.extensions[extension] += 1
            if sample is None or key != sample["__key__"]:
                if sample is not None:
                    check_sample(sample, report, max_pixels)
                if key in seen:
                    report.problem("duplicate_key", "the key appears again after other samples", key)
                seen.add(key)
                sample = {"__key__": key}
            if extension in sample:
                report.problem("duplicate_member", f"two .{extension} members", key)
            sample[extension] = data
    except (tarfile.TarError, OSError, EOFError) as err:
        # The sample being read may be cut short, so it is neither checked nor counted.
        report.unreadable = True
        report.problem("unreadable_shard", f"{type(err).__name__}: {err} (after {report.samples} samples)")
        return report
    if sample is not None:
        check_sample(sample, report, max_pixels)
    return report


def expected_counts(shards: list[str]) -> tuple[dict[str, int], dict[str, int | None], list[dict]]:
    """Sample counts the writer recorded: sizes.json (for each shard it names; else the `_stats.json` count) and
    each `_stats.json`, plus problems for such files that exist but cannot be read."""
    problems = []
    stats: dict[str, int | None] = {shard: None for shard in shards}
    for shard in shards:
        path = re.sub(r"\.tar$", "", shard) + "_stats.json"
        if os.path.isfile(path):
            try:
                with open(path) as f:
                    stats[shard] = int(json.load(f)["successes"])
            except (OSError, ValueError, KeyError, TypeError) as err:
                problems.append({"shard": shard, "key": None, "kind": "bad_stats_json", "detail": f"{path}: {err!r}"})
    try:
        sizes = recorded_sizes(shards)
    except (OSError, ValueError, AttributeError) as err:
        sizes = {}
        problems.append({"shard": None, "key": None, "kind": "bad_sizes_json", "detail": repr(err)})
    return sizes, stats, problems


def describe(values: np.ndarray) -> dict | None:
    if not len(values):
        return None
    return {"min": int(values.min()), "mean": round(float(values.mean()), 2), "median": float(np.median(values)),
            "p95": float(np.percentile(values, 95)), "max": int(values.max())}


def inspect_shards(shards: list[str], max_image_pixels: int, workers: int = 1) -> dict:
    """Check local shards in parallel and return one JSON-ready report; `report["clean"]` is False when any
    problem was found (corrupt, oversized or missing members, unreadable tars, counts that disagree with the
    writer's). `max_image_pixels` is training's data.max_image_pixels."""
    check = functools.partial(inspect_shard, max_pixels=max_image_pixels)
    with ProcessPoolExecutor(max_workers=max(1, min(workers, len(shards)))) as pool:
        reports = list(tqdm(pool.map(check, shards), total=len(shards), unit="shard", desc="inspecting"))
    sizes, stats, problems = expected_counts(shards)
    per_shard, extensions = [], Counter()
    for report in reports:
        # An empty or unreadable shard has 0 samples: against a recorded count, that is a count mismatch too.
        expected = {"sizes.json": sizes.get(report.shard), "_stats.json": stats[report.shard]}
        for source, count in expected.items():
            if count is not None and count != report.samples:
                report.problem("count_mismatch", f"{report.samples} samples, {source} says {count}")
        per_shard.append({"shard": report.shard, "samples": report.samples, **expected,
                          "problems": len(report.problems), "unreadable": report.unreadable})
        problems += report.problems
        extensions.update(report.extensions)
    chars = np.concatenate([np.asarray(r.caption_chars, dtype=np.int32) for r in reports])
    words = np.concatenate([np.asarray(r.caption_words, dtype=np.int32) for r in reports])
    return {
        "shards": len(shards), "samples": sum(r.samples for r in reports), "clean": not problems,
        "extensions": dict(sorted(extensions.items())),
        "problem_counts": dict(sorted(Counter(p["kind"] for p in problems).items())),
        "caption_chars": describe(chars), "caption_words": describe(words),
        "per_shard": per_shard, "problems": problems,
    }
