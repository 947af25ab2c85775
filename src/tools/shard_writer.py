"""Pack an image folder and a captions table (or a caption file beside each image) into webdataset shards in
img2dataset's layout.

Layout: `OUT/00000.tar, 00001.tar, ...`, each sample `{key}.jpg|png|webp`, `{key}.txt` and `{key}.json`; per
shard a `{shard}_stats.json`; for the folder `sizes.json` ({shard file name: samples}) and `failures.jsonl`.
A key is `f"{shard:05d}{row:04d}"` (img2dataset's), `row` being the sample's place among its shard's input
rows. So a shard takes at most 10,000 rows, a folder at most 100,000 shards, and a failed image leaves a gap
in the keys instead of shifting the samples after it.
"""

from __future__ import annotations

import csv
import functools
import io
import json
import os
import re
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass

import numpy as np
import webdataset as wds
from PIL import Image, UnidentifiedImageError
from tqdm import tqdm

from src.jsonl import JsonlError, iter_jsonl

Packer = Callable[[str, "Row"], dict]  # (key, row) -> webdataset sample; raises SampleError to skip the row
MAX_SHARD_SIZE = 10_000
MAX_SHARDS = 100_000
KEPT_FORMATS = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}
FAILURE_KINDS = ("failed_to_read", "failed_to_decode", "failed_no_caption")


class InputError(ValueError):
    """Inputs the user has to fix; the command-line tools exit with code 2."""


class SampleError(Exception):
    """One row that cannot become a sample; `kind` is one of FAILURE_KINDS."""

    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind = kind


@dataclass(frozen=True)
class Row:
    path: str
    caption: str
    extra: dict
    location: str  # "line 7" or "row 6", for messages


# ----------------------------------------------------------------------------------------------- captions


def _check_columns(file: str, where: str, found: list[str], wanted: tuple[str, ...]) -> None:
    for column in wanted:
        if column not in found:
            raise InputError(f"{file}: {where} has no column {column!r} (columns: {', '.join(map(str, found))})")


def _delimited_records(file: str, columns: tuple[str, ...], delimiter: str) -> Iterator[tuple[str, dict]]:
    # utf-8-sig: spreadsheet programs start their CSV exports with a byte-order mark.
    with open(file, newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f, delimiter=delimiter)
        _check_columns(file, "line 1 (header)", list(reader.fieldnames or []), columns)
        for record in reader:
            record.pop(None, None)  # values beyond the header's columns
            yield f"line {reader.line_num}", record


def _jsonl_records(file: str, columns: tuple[str, ...]) -> Iterator[tuple[str, dict]]:
    try:
        for number, record in iter_jsonl(file):
            _check_columns(file, f"line {number}", list(record), columns)
            yield f"line {number}", record
    except JsonlError as err:
        raise InputError(str(err)) from err


def _parquet_records(file: str, columns: tuple[str, ...]) -> Iterator[tuple[str, dict]]:
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError as err:
        raise InputError(f"{file}: reading parquet needs pyarrow: pip install pyarrow") from err
    try:
        table = pyarrow.parquet.read_table(file)
    except pyarrow.ArrowException as err:
        raise InputError(f"{file}: cannot read parquet: {err}") from err
    _check_columns(file, "the schema", table.column_names, columns)
    for number, record in enumerate(table.to_pylist(), 1):
        yield f"row {number}", record


def read_captions(file: str, path_column: str = "path", caption_column: str = "caption") -> list[Row]:
    """Rows of a CSV, TSV, JSONL or parquet captions table (by extension). A missing column, an unreadable
    file or a table without rows raises InputError; an empty path or caption is left to the packer, which
    reports that row as a failure."""
    readers = {
        ".csv": lambda f, c: _delimited_records(f, c, ","), ".tsv": lambda f, c: _delimited_records(f, c, "\t"),
        ".jsonl": _jsonl_records, ".parquet": _parquet_records,
    }
    extension = os.path.splitext(file)[1].lower()
    if extension not in readers:
        raise InputError(f"{file}: unknown captions format {extension!r}: use .csv, .tsv, .jsonl or .parquet")
    text = lambda value: "" if value is None else str(value)
    rows = []
    try:
        for location, record in readers[extension](file, (path_column, caption_column)):
            extra = {k: v for k, v in record.items() if k not in (path_column, caption_column)}
            rows.append(Row(text(record[path_column]), text(record[caption_column]), extra, location))
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise InputError(f"{file}: cannot read captions: {err}") from err
    if not rows:
        raise InputError(f"{file}: no captions: the table has no rows")
    return rows


IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp")


def read_caption_files(images_dir: str) -> list[Row]:
    """Rows of a folder of pairs, `x.jpg` beside `x.txt` (the caption, UTF-8), found in every subfolder, in sorted
    order. An image without its .txt becomes a row with an empty caption, which the packer reports as
    failed_no_caption; a folder without images raises InputError."""
    rows = []
    for folder, subfolders, files in os.walk(images_dir):
        subfolders.sort()
        for name in sorted(files):
            stem, extension = os.path.splitext(name)
            if extension.lower() not in IMAGE_EXTENSIONS:
                continue
            path = os.path.relpath(os.path.join(folder, name), images_dir)
            caption_file = os.path.join(folder, stem + ".txt")
            try:
                with open(caption_file, encoding="utf-8") as f:
                    caption = f.read().strip()
            except FileNotFoundError:
                caption = ""
            except (OSError, UnicodeDecodeError) as err:
                raise InputError(f"{caption_file}: cannot read the caption: {err}") from err
            rows.append(Row(path, caption, {}, os.path.join(os.path.dirname(path), stem + ".txt")))
    if not rows:
        raise InputError(f"{images_dir}: no images ({', '.join(IMAGE_EXTENSIONS)}) in it or its subfolders, and "
                         "no --captions table was given")
    return rows


# ----------------------------------------------------------------------------------------------- images


def image_error(err: Exception) -> str:
    # PIL's message for an unknown format names an object's address, which would vary from run to run.
    if isinstance(err, UnidentifiedImageError):
        return "UnidentifiedImageError: not an image format PIL can read"
    return f"{type(err).__name__}: {err}"


def jpeg_ready(img: Image.Image) -> Image.Image:
    """An L or RGB image, which JPEG can hold. Transparency is flattened onto white (the colour under fully
    transparent pixels is often black and would show); 16-bit greyscale is scaled to 8 bits, not clipped."""
    if img.mode in ("RGB", "L"):
        return img
    if img.mode.startswith("I;16"):
        return Image.fromarray((np.asarray(img) >> 8).astype(np.uint8))
    if img.mode in ("RGBA", "LA", "PA") or "transparency" in img.info:
        rgba = img.convert("RGBA")
        flat = Image.new("RGB", img.size, (255, 255, 255))
        flat.paste(rgba, mask=rgba.getchannel("A"))
        return flat
    return img.convert("RGB")


def encode_image(data: bytes, max_size: int | None = None, quality: int = 95) -> tuple[bytes, str, dict]:
    """Decode `data` fully (which verifies it) and return (bytes, extension, sizes). JPEG/PNG/WEBP within
    `max_size` keep their bytes; larger images are downscaled to it and everything else is re-encoded as JPEG."""
    with Image.open(io.BytesIO(data)) as img:
        img.load()
        original = {"original_width": img.width, "original_height": img.height}
        extension = KEPT_FORMATS.get(img.format)
        shrink = max_size is not None and max(img.size) > max_size
        if extension and not shrink:
            return data, extension, {"width": img.width, "height": img.height, **original}
        image = jpeg_ready(img)
        if shrink:
            scale = max_size / max(img.size)
            image = image.resize((max(1, round(img.width * scale)), max(1, round(img.height * scale))),
                                 Image.Resampling.LANCZOS)
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue(), "jpg", {"width": image.width, "height": image.height, **original}


def pack_row(key: str, row: Row, *, images_dir: str, max_size: int | None, quality: int) -> dict:
    """The sample for one row (webdataset's dict of member bytes), or SampleError."""
    if not row.caption.strip():
        raise SampleError("failed_no_caption", "empty caption")
    if not row.path:
        raise SampleError("failed_to_read", "empty path")
    try:
        with open(os.path.join(images_dir, row.path), "rb") as f:
            data = f.read()
    except OSError as err:
        raise SampleError("failed_to_read", f"{type(err).__name__}: {err.strerror or err}") from err
    try:
        image, extension, sizes = encode_image(data, max_size, quality)
    except Exception as err:  # PIL raises many types (OSError, SyntaxError, DecompressionBombError, ...)
        raise SampleError("failed_to_decode", image_error(err)) from err
    # Our fields win over extra columns of the same name: the loader and inspect_shards rely on them.
    meta = {**row.extra, "key": key, "caption": row.caption, **sizes, "source_path": row.path}
    return {
        "__key__": key, extension: image, "txt": row.caption.encode("utf-8"),
        "json": json.dumps(meta, ensure_ascii=False, default=str).encode("utf-8"),
    }


# ----------------------------------------------------------------------------------------------- shards


def write_atomic(path: str, text: str) -> None:
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def write_shard(out_dir: str, prefix: str, shard: int, rows: list[Row], packer: Packer) -> tuple[dict, list[dict]]:
    """Write one shard (via a .tmp name, so a crash leaves no half shard) and its _stats.json; returns
    (stats, failures)."""
    path = os.path.join(out_dir, f"{prefix}{shard:05d}.tar")
    failures: list[dict] = []
    kinds: Counter = Counter()
    # A fixed member time makes the same input give byte-identical shards.
    with wds.TarWriter(path + ".tmp", mtime=0) as sink:
        for index, row in enumerate(rows):
            key = f"{shard:05d}{index:04d}"
            try:
                sink.write(packer(key, row))
            except SampleError as err:
                kinds[err.kind] += 1
                failures.append({"key": key, "source_path": row.path, "location": row.location, "kind": err.kind,
                                 "reason": str(err)})
    os.replace(path + ".tmp", path)
    stats = {"count": len(rows), "successes": len(rows) - len(failures), **{k: kinds[k] for k in FAILURE_KINDS},
             **kinds}
    write_atomic(path.removesuffix(".tar") + "_stats.json", json.dumps(stats, indent=1))
    return stats, failures


def shard_pattern(out_dir: str, shards: int, prefix: str = "") -> str:
    return os.path.join(out_dir, f"{prefix}{{00000..{shards - 1:05d}}}.tar")


@dataclass
class PackSummary:
    samples: int
    failures: list[dict]
    shards: int
    pattern: str


def make_shards(
    rows: list[Row], images_dir: str, out_dir: str, *, shard_size: int = MAX_SHARD_SIZE, workers: int | None = None,
    max_size: int | None = None, quality: int = 95, prefix: str = "",
) -> PackSummary:
    """Pack image rows (paths relative to `images_dir`, or absolute) into shards `{prefix}00000.tar, ...` of
    `shard_size` rows each, in parallel."""
    packer = functools.partial(pack_row, images_dir=images_dir, max_size=max_size, quality=quality)
    return write_shards(rows, out_dir, packer, shard_size=shard_size, workers=workers, prefix=prefix)


def write_shards(
    rows: list[Row], out_dir: str, packer: Packer, *, shard_size: int = MAX_SHARD_SIZE, workers: int | None = None,
    prefix: str = "",
) -> PackSummary:
    """Shards of `shard_size` rows, each row turned into a sample by `packer(key, row)` (a picklable callable
    that raises SampleError for a row it cannot pack), with _stats.json, sizes.json and failures.jsonl."""
    if not rows:
        raise InputError("no rows to pack")
    if re.search(r"[/{}]", prefix):
        raise InputError(f"--prefix {prefix!r} must not contain '/' or braces")
    if not 1 <= shard_size <= MAX_SHARD_SIZE:
        raise InputError(f"--shard-size must be in 1..{MAX_SHARD_SIZE} (keys hold 4 digits of row), got {shard_size}")
    chunks = [rows[i : i + shard_size] for i in range(0, len(rows), shard_size)]
    if len(chunks) > MAX_SHARDS:
        raise InputError(f"{len(chunks)} shards exceed the {MAX_SHARDS} that 5-digit names allow: split the table")
    os.makedirs(out_dir, exist_ok=True)
    # A stale higher-numbered shard from an earlier run would be picked up by globs but missing from sizes.json.
    stale = sorted(
        name for name in os.listdir(out_dir)
        if (m := re.fullmatch(re.escape(prefix) + r"(\d{5})(\.tar|_stats\.json)", name))
        and int(m.group(1)) >= len(chunks)
    )
    if stale:
        raise InputError(f"{out_dir} holds shards of an earlier, larger run ({', '.join(stale[:3])}, ...): "
                         "remove them or write to another folder")
    workers = min(workers or os.cpu_count() or 1, len(chunks))
    with ProcessPoolExecutor(max_workers=workers) as pool, tqdm(total=len(rows), unit="sample", desc="packing") as bar:
        jobs = [pool.submit(write_shard, out_dir, prefix, i, chunk, packer) for i, chunk in enumerate(chunks)]
        for job in as_completed(jobs):
            bar.update(job.result()[0]["count"])
    results = [job.result() for job in jobs]
    sizes = {f"{prefix}{i:05d}.tar": stats["successes"] for i, (stats, _) in enumerate(results)}
    failures = [failure for _, shard_failures in results for failure in shard_failures]
    write_atomic(os.path.join(out_dir, "sizes.json"), json.dumps(sizes, indent=1))
    write_atomic(os.path.join(out_dir, "failures.jsonl"),
                 "".join(json.dumps(f, ensure_ascii=False) + "\n" for f in failures))
    return PackSummary(sum(sizes.values()), failures, len(chunks), shard_pattern(out_dir, len(chunks), prefix))
