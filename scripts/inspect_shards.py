"""Check webdataset image-text shards: counts, member types, corrupt images or tars, caption lengths.

    python scripts/inspect_shards.py 'data/laion/{00000..00012}.tar' [--json] [--workers 4] [--max-image-pixels N]

Reads every tar fully (bytes only: nothing is unpickled or executed) and decodes every image, except those
whose header gives more pixels than --max-image-pixels (training's data.max_image_pixels, by default the value
in configs/data/base.yaml): training skips those unread, and so they are reported as oversized_image. Counts are
compared with sizes.json and each {shard}_stats.json when they are present. Prints a table, or one JSON
object with --json. Exit code 0 when the shards are clean, 1 when problems were found, 2 for usage errors.
"""

from __future__ import annotations

import argparse
import json
import os

from omegaconf import OmegaConf

from src.compose import CONFIGS
from src.data.shards import expand_shards, is_local
from src.tools.shard_inspect import inspect_shards

DATA_DEFAULTS = os.path.join(CONFIGS, "data", "base.yaml")  # the one home of data.max_image_pixels's default
SHOWN_PROBLEMS = 50
# Above this many shards the table lists only the shards with problems.
SHOWN_SHARDS = 50


def lengths(stats: dict | None) -> str:
    if stats is None:
        return "-"
    return " / ".join(f"{name} {value:g}" for name, value in stats.items())


def print_table(report: dict) -> None:
    rows = report["per_shard"]
    if len(rows) > SHOWN_SHARDS:
        rows = [row for row in rows if row["problems"]]
        print(f"({report['shards']} shards; listing the {len(rows)} with problems)")
    width = max([len("shard")] + [len(row["shard"]) for row in rows])
    print(f"{'shard':<{width}}  {'samples':>8}  {'sizes.json':>10}  {'_stats.json':>11}  {'problems':>8}")
    for row in rows:
        expected = [str(row[k]) if row[k] is not None else "-" for k in ("sizes.json", "_stats.json")]
        print(f"{row['shard']:<{width}}  {row['samples']:>8}  {expected[0]:>10}  {expected[1]:>11}  "
              f"{row['problems']:>8}")
    print(f"\n{report['shards']} shards, {report['samples']} samples")
    print("members: " + (", ".join(f".{ext} {n}" for ext, n in report["extensions"].items()) or "none"))
    print(f"caption characters: {lengths(report['caption_chars'])}")
    print(f"caption words:      {lengths(report['caption_words'])}")
    if report["clean"]:
        print("no problems found")
        return
    print("problems: " + ", ".join(f"{kind} {n}" for kind, n in report["problem_counts"].items()))
    for problem in report["problems"][:SHOWN_PROBLEMS]:
        where = (problem["shard"] or "sizes.json") + (f" key {problem['key']}" if problem["key"] else "")
        print(f"  {where}: {problem['kind']}: {problem['detail']}")
    if len(report["problems"]) > SHOWN_PROBLEMS:
        print(f"  ... and {len(report['problems']) - SHOWN_PROBLEMS} more (all of them with --json)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("pattern", help="shard brace pattern, e.g. 'data/laion/{00000..00012}.tar' (quote it)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--workers", type=int, default=os.cpu_count(), help="shards read in parallel")
    parser.add_argument("--max-image-pixels", type=int, default=OmegaConf.load(DATA_DEFAULTS).max_image_pixels,
                        help="report images with more pixels as oversized_image (default: data.max_image_pixels)")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    if args.max_image_pixels < 1:
        parser.error("--max-image-pixels must be at least 1")
    try:
        shards = expand_shards(args.pattern, key="pattern")
    except FileNotFoundError as err:
        parser.error(str(err))
    remote = [s for s in shards if not is_local(s)]
    if remote:
        parser.error(f"only local shards can be inspected, not {remote[0]!r}")
    report = inspect_shards(shards, args.max_image_pixels, workers=args.workers)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print_table(report)
    return 0 if report["clean"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
