"""Pack video clips and their captions into webdataset shards of pre-decoded JPEG frames.

    python scripts/pack_videos.py --videos clips/ --captions captions.csv --out data/video_shards --frames 16

The captions table (.csv, .tsv or .jsonl) has the columns `path` (relative to --videos, or absolute) and
`caption`, and optionally `start` and `end` (seconds) to cut a clip out of a longer video; other columns go into
each sample's .json. Each sample holds K = --frames frames sampled uniformly over the clip, resized to a short
side of at most --short-side. Writes OUT/{00000..N}.tar, a _stats.json per shard, sizes.json and
failures.jsonl (unreadable videos, clips with fewer than K frames). Exit code 0 when shards were written, 1
when no clip could be packed, 2 for bad arguments or captions tables.
"""

from __future__ import annotations

import argparse
import os
import sys

from src.tools.shard_writer import InputError, read_captions
from src.tools.video_pack import pack_videos


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--videos", required=True, help="folder that relative paths in the table start from")
    parser.add_argument("--captions", required=True, help="captions table: .csv, .tsv or .jsonl")
    parser.add_argument("--out", required=True, help="output folder for the shards")
    parser.add_argument("--frames", type=int, default=16, help="frames stored per clip (K >= the T used in training)")
    parser.add_argument("--short-side", type=int, default=256, help="downscale frames to this short side (pixels)")
    parser.add_argument("--quality", type=int, default=90, help="JPEG quality of the frames")
    parser.add_argument("--shard-size", type=int, default=1000, help="clips per shard (at most 10000)")
    parser.add_argument("--workers", type=int, default=os.cpu_count(), help="shards written in parallel")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.videos):
        parser.error(f"--videos {args.videos!r} is not a folder")
    try:
        rows = read_captions(args.captions)
        summary = pack_videos(rows, args.videos, args.out, frames=args.frames, short_side=args.short_side,
                              quality=args.quality, shard_size=args.shard_size, workers=args.workers)
    except (InputError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for failure in summary.failures[:20]:
        print(f"not packed: {failure['source_path']} ({failure['location']}): {failure['kind']}: {failure['reason']}",
              file=sys.stderr)
    print(f"wrote {summary.samples} clips in {summary.shards} shards; {len(summary.failures)} failures "
          f"(all in {os.path.join(args.out, 'failures.jsonl')})")
    print(f"data.shards: {summary.pattern}")
    return 0 if summary.samples else 1


if __name__ == "__main__":
    raise SystemExit(main())
