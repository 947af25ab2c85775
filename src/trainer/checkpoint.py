"""Atomic checkpoints: written to `step_N.tmp/`, fsynced, then renamed; a directory without the
suffix is always complete, so a crash mid-save never produces a broken "latest".

Layout of `checkpoints/step_00000500/`: `model.pt` and `train_state.pt` (optimizer, scheduler, step,
...) from rank 0, and `rank_R.pt` (RNG states, data position) from every rank. All files hold only
tensors and plain Python types and load with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import os
import re
import shutil

import torch

from src.trainer.distributed import barrier, broadcast_object

STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir(checkpoints: str, step: int) -> str:
    return os.path.join(checkpoints, f"step_{step:08d}")


def complete_checkpoints(checkpoints: str) -> list[str]:
    """Complete checkpoint directories, oldest first."""
    if not os.path.isdir(checkpoints):
        return []
    found = [(int(m.group(1)), name) for name in os.listdir(checkpoints) if (m := STEP_DIR.match(name))]
    return [os.path.join(checkpoints, name) for _, name in sorted(found)]


def latest_checkpoint(checkpoints: str) -> str | None:
    """Decided on rank 0 and broadcast, so every rank resumes from the same one."""
    found = complete_checkpoints(checkpoints)
    return broadcast_object(found[-1] if found else None)


def fsync_save(obj, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    checkpoints: str, step: int, *, rank: int, shared: dict[str, dict], per_rank: dict, keep_last_k: int
) -> str:
    """`shared` maps file stem -> state, written by rank 0; `per_rank` is written by every rank."""
    final = step_dir(checkpoints, step)
    tmp = final + ".tmp"
    if rank == 0:
        os.makedirs(checkpoints, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier()
    fsync_save(per_rank, os.path.join(tmp, f"rank_{rank}.pt"))
    if rank == 0:
        for stem, state in shared.items():
            fsync_save(state, os.path.join(tmp, f"{stem}.pt"))
    barrier()
    if rank == 0:
        if os.path.exists(final):  # saving the same step twice (e.g. the final save): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(checkpoints)
        prune(checkpoints, keep_last_k)
    barrier()
    return final


def prune(checkpoints: str, keep_last_k: int) -> None:
    """Remove all but the newest `keep_last_k`, only once the newest is complete. Renaming first means
    a crash mid-delete leaves no half-deleted directory that looks complete."""
    if keep_last_k <= 0:
        return
    for old in complete_checkpoints(checkpoints)[:-keep_last_k]:
        doomed = old + ".deleting"
        os.replace(old, doomed)
        shutil.rmtree(doomed)


def load_file(directory: str, stem: str) -> dict:
    return torch.load(os.path.join(directory, f"{stem}.pt"), map_location="cpu", weights_only=True)
