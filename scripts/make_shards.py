"""Pack an image folder and its captions into webdataset shards in img2dataset's layout.

    python scripts/make_shards.py --images photos/ --out data/mine --max-size 512
    python scripts/make_shards.py --images photos/ --captions captions.csv --out data/mine --max-size 512

Without --captions each image's caption is the text file beside it (`cat.jpg` and `cat.txt`, in any subfolder).
The captions table (.csv, .tsv, .jsonl or .parquet; parquet needs `pip install pyarrow`) has a `path`
column (relative to --images, or absolute) and a `caption` column; other columns go into each sample's .json.
Writes OUT/{PREFIX}{00000..N}.tar with {key}.jpg|png|webp, {key}.txt and {key}.json per sample, a {shard}_stats.json
per shard, sizes.json, and failures.jsonl listing the rows that were not packed (missing or undecodable
image, empty caption). Keys are 9 digits, 5 for the shard and 4 for the row, so --shard-size is at most 10000.
Exit code 0 when shards were written, 1 when no row could be packed, 2 for bad arguments or captions tables.
"""

from __future__ import annotations

import argparse
import os
import sys

from src.tools.shard_writer import MAX_SHARD_SIZE, InputError, make_shards, read_caption_files, read_captions

SHOWN_FAILURES = 20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", required=True, help="folder that relative paths in the table start from")
    parser.add_argument("--captions", help="captions table: .csv, .tsv, .jsonl or .parquet (default: x.txt beside "
                                           "each image x.jpg)")
    parser.add_argument("--out", required=True, help="output folder for the shards")
    parser.add_argument("--shard-size", type=int, default=MAX_SHARD_SIZE, help="rows per shard (at most 10000)")
    parser.add_argument("--workers", type=int, default=os.cpu_count(), help="shards written in parallel")
    parser.add_argument("--max-size", type=int, help="downscale images whose longer side exceeds this (pixels)")
    parser.add_argument("--quality", type=int, default=95, help="JPEG quality of re-encoded images")
    parser.add_argument("--prefix", default="", help="shard file name prefix, e.g. 'train-' for train-00000.tar")
    parser.add_argument("--path-column", default="path", help="column with the image paths")
    parser.add_argument("--caption-column", default="caption", help="column with the captions")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.images):
        parser.error(f"--images {args.images!r} is not a folder")
    for name in ("workers", "max_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if not 1 <= args.quality <= 100:
        parser.error(f"--quality must be in 1..100, got {args.quality}")
    try:
        rows = (read_captions(args.captions, args.path_column, args.caption_column) if args.captions
                else read_caption_files(args.images))
        summary = make_shards(rows, args.images, args.out, shard_size=args.shard_size, workers=args.workers,
                              max_size=args.max_size, quality=args.quality, prefix=args.prefix)
    except InputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for failure in summary.failures[:SHOWN_FAILURES]:
        print(f"failed: {failure['source_path']!r} ({failure['location']}): {failure['reason']}", file=sys.stderr)
    if len(summary.failures) > SHOWN_FAILURES:
        print(f"... and {len(summary.failures) - SHOWN_FAILURES} more", file=sys.stderr)
    print(f"wrote {summary.samples} samples in {summary.shards} shards; {len(summary.failures)} failures "
          f"(listed in {os.path.join(args.out, 'failures.jsonl')})")
    # The quotes keep the shell from expanding the braces (train.py quotes them again for Hydra).
    print(f"train with: python train.py data=laion_wds data.shards='{summary.pattern}' ...")
    return 0 if summary.samples else 1


if __name__ == "__main__":
    raise SystemExit(main())
