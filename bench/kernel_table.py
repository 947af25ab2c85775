"""GPU time per step by kernel name, from the Chrome traces `bench/throughput.py --profile N --trace DIR` writes
(three profiled steps each); with two traces, also the kernels whose time changed most between them; with
`--groups`, the time per kind of kernel (matmul, attention, Inductor's fused kernels, optimizer, copies); with
`--callers REGEX`, the kernels whose name matches, each split by the two innermost CPU ops that launched it
(e.g. an eager `reduce_kernel` under `aten::sum` < `stableclip::residual_norm_backward`), and with `--shapes`
also by the innermost op's input shapes (the profiler records them), e.g. SwitchBack's row quantizer by layer;
with `--gaps`, where the GPU sat idle waiting for the host, and the CPU ops that launched the kernel after each
long wait; with `--threads`, each host thread's CUDA calls by name (the profiler records every thread's, those of
libraries such as nvImageCodec included), e.g. a decode thread's per-image `cudaEventSynchronize`.

    python bench/kernel_table.py DIR/0.json [DIR/1.json] [--rows 22] [--groups] [--callers 'reduce|copy'] [--shapes]
        [--gaps] [--threads]
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import re

PROFILED_STEPS = 3  # bench/throughput.py's print_profile runs three steps


def kernel_ms_per_step(path: str) -> collections.Counter:
    events = json.load(open(path))["traceEvents"]
    table = collections.Counter()
    for event in events:
        if event.get("ph") == "X" and event.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            table[event["name"][:110]] += event["dur"] / 1e3 / PROFILED_STEPS
    return table


# First match wins; names as CUDA, cuBLAS, cuDNN, Inductor and our Triton kernels call themselves.
KERNEL_GROUPS = (
    ("attention", re.compile(r"attention|_tiled_forward_kernel|_grad_query_kernel|_grad_key_kernel|sdpa|flash|fmha")),
    ("residual + LayerNorm (our kernels)", re.compile(r"residual_norm")),
    ("SwitchBack quantization", re.compile(r"quantize|absmax")),
    ("Inductor reductions (LayerNorm, sums)", re.compile(r"^triton_(red|per)_")),
    ("Inductor element-wise (GELU, residual, casts)", re.compile(r"^triton_poi_")),
    ("matmul", re.compile(r"gemm|nvjet|xmma|cutlass|cublas|matmul|^triton_tem_", re.IGNORECASE)),
    ("optimizer and RMS (multi-tensor)", re.compile(r"multi_tensor|foreach|fused_adam|adam", re.IGNORECASE)),
    ("copies and fills", re.compile(r"copy|memcpy|memset|fill|cat", re.IGNORECASE)),
)


def kernel_group(name: str) -> str:
    return next((group for group, pattern in KERNEL_GROUPS if pattern.search(name)), "other")


def print_groups(table: collections.Counter) -> None:
    groups = collections.Counter()
    for name, ms in table.items():
        groups[kernel_group(name)] += ms
    total = sum(groups.values())
    for group, ms in groups.most_common():
        print(f"  {ms:7.1f} ms {ms / total:6.1%}  {group}")


def _innermost_ops(ops: list[tuple[float, float, str]], starts: list[float], time: float) -> str:
    """The innermost two of a thread's CPU ops (sorted by start) that are running at `time`, inner first. The
    latest-starting op that has not ended is the innermost; its parent started before it."""
    names = []
    for index in range(bisect.bisect_right(starts, time) - 1, -1, -1):
        _, end, name = ops[index]
        if end >= time:
            names.append(name)
            if len(names) == 2:
                break
    return " < ".join(names) or "no CPU op"


class Launchers:
    """Which CPU ops launched a GPU event: the event and its launch share a correlation id, and the launch's time
    places it inside the CPU ops of its thread. `shapes`: each op named with its input shapes."""

    def __init__(self, events: list[dict], shapes: bool = False):
        self.launches = {event["args"]["correlation"]: event for event in events
                         if event.get("cat") in ("cuda_runtime", "cuda_driver")
                         and "correlation" in event.get("args", {})}
        self.ops = collections.defaultdict(list)
        for event in events:
            if event.get("ph") == "X" and event.get("cat") == "cpu_op":
                dims = event.get("args", {}).get("Input Dims") if shapes else None
                name = event["name"] + (f" {dims}" if dims else "")
                self.ops[event["pid"], event["tid"]].append((event["ts"], event["ts"] + event["dur"], name))
        for thread_ops in self.ops.values():
            thread_ops.sort()
        self.starts = {thread: [op[0] for op in thread_ops] for thread, thread_ops in self.ops.items()}

    def of(self, event: dict) -> str:
        launch = self.launches.get(event.get("args", {}).get("correlation"))
        if launch is None:
            return "no launch found"
        thread = launch["pid"], launch["tid"]
        return _innermost_ops(self.ops[thread], self.starts.get(thread, []), launch["ts"])


def kernel_callers(path: str, pattern: re.Pattern, shapes: bool = False) -> collections.Counter:
    """ms per step of each (kernel, the CPU ops that launched it), for kernels whose name matches `pattern`."""
    events = json.load(open(path))["traceEvents"]
    launchers = Launchers(events, shapes)
    table = collections.Counter()
    for event in events:
        if event.get("ph") == "X" and event.get("cat") == "kernel" and pattern.search(event["name"]):
            table[event["name"][:80], launchers.of(event)] += event["dur"] / 1e3 / PROFILED_STEPS
    return table


def idle_gaps(path: str) -> tuple[float, list[tuple[float, str, str]]]:
    """(ms per step from the first GPU event to the last, and every stretch where the GPU ran nothing: (µs, the
    event before it, the event after it with the CPU ops that launched that one)). A gap is time the GPU waited
    for the host: to queue the next kernel, or to start a step where the host waits for the last to end."""
    events = json.load(open(path))["traceEvents"]
    gpu = sorted(((event["ts"], event["ts"] + event["dur"], event) for event in events
                  if event.get("ph") == "X" and event.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                 key=lambda item: item[:2])  # events that tie on both times are not comparable
    launchers = Launchers(events)
    gaps = []
    first, end, before = gpu[0][0], gpu[0][1], gpu[0][2]["name"]
    for start, stop, event in gpu[1:]:
        if start > end:
            gaps.append((start - end, before[:60], f"{event['name'][:60]}  <-  {launchers.of(event)}"))
        if stop > end:
            end, before = stop, event["name"]
    return (end - first) / 1e3 / PROFILED_STEPS, gaps


def thread_calls(path: str) -> dict[tuple, tuple[float, collections.Counter, collections.Counter]]:
    """For each host thread that made CUDA calls: (ms from its first call's start to its last call's end, calls
    per step by name, ms per step in them by name)."""
    events = json.load(open(path))["traceEvents"]
    spans, counts, ms = {}, collections.defaultdict(collections.Counter), collections.defaultdict(collections.Counter)
    for event in events:
        if event.get("ph") == "X" and event.get("cat") in ("cuda_runtime", "cuda_driver"):
            thread, start, end = (event["pid"], event["tid"]), event["ts"], event["ts"] + event["dur"]
            first, last = spans.get(thread, (start, end))
            spans[thread] = min(first, start), max(last, end)
            counts[thread][event["name"]] += 1 / PROFILED_STEPS
            ms[thread][event["name"]] += event["dur"] / 1e3 / PROFILED_STEPS
    return {thread: ((last - first) / 1e3, counts[thread], ms[thread]) for thread, (first, last) in spans.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("traces", nargs="+", help="one or two trace files")
    parser.add_argument("--rows", type=int, default=22)
    parser.add_argument("--groups", action="store_true", help="also print the time per kind of kernel")
    parser.add_argument("--callers", metavar="REGEX",
                        help="also split the kernels whose name matches by the CPU ops that launched them")
    parser.add_argument("--shapes", action="store_true", help="with --callers: name the ops with their input shapes")
    parser.add_argument("--gaps", action="store_true",
                        help="also print where the GPU sat idle: in all, and the longest stretches with what is "
                             "around them")
    parser.add_argument("--threads", action="store_true",
                        help="also print each host thread's CUDA calls by name, per step: how many, how long")
    args = parser.parse_args()
    if len(args.traces) > 2:
        parser.error(f"give one or two traces, got {len(args.traces)}")
    tables = [kernel_ms_per_step(path) for path in args.traces]
    for path, table in zip(args.traces, tables):
        print(f"{path}: GPU busy {sum(table.values()):.1f} ms per step")
        for name, ms in table.most_common(args.rows):
            print(f"  {ms:7.2f} {name}")
        if args.groups:
            print_groups(table)
        if args.callers:
            print(f"kernels matching {args.callers!r}, by the CPU ops that launched them (inner < outer)")
            callers = kernel_callers(path, re.compile(args.callers), args.shapes)
            for (name, caller), ms in callers.most_common(args.rows):
                print(f"  {ms:7.2f} {name}  <-  {caller}")
        if args.gaps:
            span, gaps = idle_gaps(path)
            per_step = 1e3 * PROFILED_STEPS
            long = [gap for gap in gaps if gap[0] >= 20]
            print(f"GPU span {span:.1f} ms per step, idle {sum(g[0] for g in gaps) / per_step:.1f} ms per step: "
                  f"{len(gaps) / PROFILED_STEPS:.1f} gaps, {len(long) / PROFILED_STEPS:.1f} of them 20 µs or longer "
                  f"({sum(g[0] for g in long) / per_step:.1f} ms)")
            for micros, before, after in sorted(long, reverse=True)[:args.rows]:
                print(f"  {micros:8.0f} µs after {before}  before {after}")
        if args.threads:
            calls = thread_calls(path)
            for (_pid, tid), (span, counts, ms) in sorted(calls.items(), key=lambda item: -sum(item[1][2].values())):
                print(f"thread {tid}: CUDA calls over {span:.1f} ms, per step: {sum(counts.values()):.0f} calls, "
                      f"{sum(ms.values()):.1f} ms in them")
                for name, total in ms.most_common(args.rows):
                    print(f"  {counts[name]:8.1f} x {total:8.2f} ms  {name}")
    if len(tables) == 2:
        first, second = tables
        change = {name: first[name] - second[name] for name in set(first) | set(second)}
        print("largest differences, first minus second, ms per step")
        for name, ms in sorted(change.items(), key=lambda item: -abs(item[1]))[:args.rows]:
            print(f"  {ms:+7.2f} {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
