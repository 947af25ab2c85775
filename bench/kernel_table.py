"""GPU time per step by kernel name, from the Chrome traces `bench/throughput.py --profile N --trace DIR` writes
(three profiled steps each); with two traces, also the kernels whose time changed most between them.

    python bench/kernel_table.py DIR/0.json [DIR/1.json] [--rows 22]
"""

from __future__ import annotations

import argparse
import collections
import json

PROFILED_STEPS = 3  # bench/throughput.py's print_profile runs three steps


def kernel_ms_per_step(path: str) -> collections.Counter:
    events = json.load(open(path))["traceEvents"]
    table = collections.Counter()
    for event in events:
        if event.get("ph") == "X" and event.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            table[event["name"][:110]] += event["dur"] / 1e3 / PROFILED_STEPS
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("traces", nargs="+", help="one or two trace files")
    parser.add_argument("--rows", type=int, default=22)
    args = parser.parse_args()
    if len(args.traces) > 2:
        parser.error(f"give one or two traces, got {len(args.traces)}")
    tables = [kernel_ms_per_step(path) for path in args.traces]
    for path, table in zip(args.traces, tables):
        print(f"{path}: GPU busy {sum(table.values()):.1f} ms per step")
        for name, ms in table.most_common(args.rows):
            print(f"  {ms:7.2f} {name}")
    if len(tables) == 2:
        first, second = tables
        change = {name: first[name] - second[name] for name in set(first) | set(second)}
        print("largest differences, first minus second, ms per step")
        for name, ms in sorted(change.items(), key=lambda item: -abs(item[1]))[:args.rows]:
            print(f"  {ms:+7.2f} {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
