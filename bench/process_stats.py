"""CPU accounting shared by the CPU benchmarks: CPU seconds of this process and its DataLoader workers, and
the CPU model. Per-image CPU time is the figure least disturbed by other work on a shared machine."""

from __future__ import annotations

import gc
import os
import platform
import time


def children_pids() -> list[int]:
    """Live child processes of this one (the DataLoader workers)."""
    me, pids = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:  # field 4, ppid
            pids.append(int(entry))
    return pids


def cpu_seconds() -> float:
    """User+system CPU seconds of this process and its live children (the workers are long-lived)."""
    total = 0
    for pid in [os.getpid(), *children_pids()]:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # fields 14, 15: utime, stime in clock ticks
    return total / os.sysconf("SC_CLK_TCK")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def time_batches(batches, warmup: int, seconds: float, rounds: int = 1) -> dict:
    """Pull `warmup` batches untimed, then batches for at least `seconds` of wall time, ending on a whole number
    of `rounds` (DataLoader workers hand out batches in turn). Returns the first batch, the items counted,
    wall and CPU seconds."""
    start = time.perf_counter()
    for _ in range(warmup):
        first = next(batches)
    started = time.perf_counter()
    cpu_start = cpu_seconds()
    items = count = 0
    now = started
    while now - started < seconds or count % rounds:
        items += len(next(batches))
        count += 1
        now = time.perf_counter()
    return {"first": first, "items": items, "batches": count, "seconds": now - started,
            "cpu_s": cpu_seconds() - cpu_start, "warmup_s": started - start}


def stop_workers(batches, name: str) -> None:
    """Drop the DataLoader iterator and wait for its workers to exit, so they do not compete with the next run."""
    batches.close()
    del batches
    gc.collect()
    for _ in range(50):
        if not children_pids():
            return
        time.sleep(0.1)
    print(f"warning: {len(children_pids())} worker processes still alive after {name}")
