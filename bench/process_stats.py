"""CPU accounting shared by the CPU benchmarks: CPU seconds of this process and its DataLoader workers, and
the CPU model. Per-image CPU time is the figure least disturbed by other work on a shared machine."""

from __future__ import annotations

import os
import platform


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
