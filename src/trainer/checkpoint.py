"""Atomic checkpoints: written to `step_N.tmp/`, fsynced, then renamed; a directory without the
suffix is always complete, so a crash mid-save never produces a broken "latest".

Layout of `checkpoints/step_00000500/`: `model.pt` and `train_state.pt` (optimizer, scheduler, step,
...) from rank 0, and `rank_R.pt` (RNG states, data position) from every rank. All files hold only
tensors and plain Python types and load with `torch.load(weights_only=True)`. Which part goes where is
src/trainer/state.py's `TrainState`, the one list of what a checkpoint holds.

A write that fails (disk full, quota, permissions) removes its `.tmp` directory and raises on every rank;
the previous checkpoint stays as it was. See docs/reliability.md.

Under FSDP2 (`trainer.data_parallel=fsdp2`) the model and optimizer state are gathered whole to rank 0's CPU and
written in the layout DDP writes (`model_state`, `optimizer_state`), so a checkpoint moves freely between
FSDP2, DDP and single-process runs, at any world size the loader allows.
"""

from __future__ import annotations

import errno
import functools
import os
import pickle
import re
import shutil
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule

from src.parallel.distributed import any_rank, barrier, broadcast_object
from src.trainer.state import TrainState

STEP_DIR = re.compile(r"^step_(\d+)$")
DEBRIS = re.compile(r"^step_\d+\.(tmp|deleting)$")  # left by a save or a prune that was killed
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written; nothing was renamed or pruned."""


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


def find_resume(checkpoints: str, resume: str | None, required: bool) -> str | None:
    """The checkpoint directory `trainer.resume` names, or None to start from step 0. Cheap (no loading), so
    a bad value fails before any expensive work."""
    if not resume:
        return None
    path = latest_checkpoint(checkpoints) if resume == "latest" else resume
    if path is None:
        if required:
            raise FileNotFoundError(
                f"trainer.resume=latest but {checkpoints} holds no complete checkpoint, and "
                "trainer.resume_required=true: set trainer.run_dir to the run to continue, or "
                "trainer.resume_required=false to start from step 0"
            )
        return None
    if not os.path.isfile(os.path.join(path, "model.pt")):
        raise FileNotFoundError(
            f"trainer.resume={resume!r}: {path!r} is not a checkpoint directory (it has no model.pt); "
            "pass trainer.resume=latest or a checkpoints/step_N directory"
        )
    return path


def fsync_save(obj, path: str) -> None:
    with open(path, "wb") as f:
        try:
            torch.save(obj, f)
        except RuntimeError as err:
            # torch reports a failed write as its own error; the file's OSError (ENOSPC, ...) is its context.
            if isinstance(err.__context__, OSError):
                raise err.__context__ from None
            raise
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

    def make_tmp() -> None:
        os.makedirs(checkpoints, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)

    def write_files() -> None:
        fsync_save(per_rank, os.path.join(tmp, f"rank_{rank}.pt"))
        if rank == 0:
            for stem, state in shared.items():
                fsync_save(state, os.path.join(tmp, f"{stem}.pt"))

    write_on_every_rank(make_tmp if rank == 0 else None, rank, checkpoints, tmp)
    write_on_every_rank(write_files, rank, checkpoints, tmp)
    if rank == 0:
        if os.path.exists(final):  # saving the same step twice (e.g. the final save): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(checkpoints)
        retire_old(checkpoints, keep_last_k)
        remove_debris(checkpoints)
    barrier()
    return final


def write_on_every_rank(write: Callable[[], None] | None, rank: int, checkpoints: str, tmp: str) -> None:
    """Run this rank's part of a write, then learn whether any rank failed (which is also the barrier
    between the phases of a save). On a failure the partial `tmp` goes and every rank raises."""
    error = None
    if write is not None:
        try:
            write()
        except OSError as err:
            error = err
    if not any_rank(error is not None):
        return
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    found = complete_checkpoints(checkpoints)
    previous = f"the previous checkpoint {found[-1]} is intact" if found else "there is no earlier checkpoint"
    hint = ""
    if error is not None and error.errno in DISK_FULL:
        hint = (f" The disk is full (or a quota or file-size limit was reached): free space under {checkpoints}, "
                "or keep fewer checkpoints with a lower trainer.keep_last_k, then resume with trainer.resume=latest.")
    raise CheckpointWriteError(
        f"could not write checkpoint {tmp}: {error or 'another rank failed to write its part'}; removed the "
        f"partial directory, nothing was pruned and {previous}.{hint}"
    ) from error


def retire_old(checkpoints: str, keep_last_k: int) -> None:
    """Rename all but the newest `keep_last_k` to `.deleting`, only once the newest is complete: a crash
    mid-delete then leaves no half-deleted directory that looks complete."""
    if keep_last_k <= 0:
        return
    for old in complete_checkpoints(checkpoints)[:-keep_last_k]:
        os.replace(old, old + ".deleting")


def remove_debris(checkpoints: str) -> None:
    """Delete retired checkpoints, and whatever a killed save or prune left behind."""
    for name in os.listdir(checkpoints):
        if DEBRIS.match(name):
            shutil.rmtree(os.path.join(checkpoints, name))


def save_train_state(checkpoints: str, step: int, state: TrainState, *, rank: int, keep_last_k: int) -> str:
    """Every part `state` registers, at `step`; returns the checkpoint directory."""
    return save_checkpoint(checkpoints, step, rank=rank, shared=state.shared_files(), per_rank=state.rank_file(),
                           keep_last_k=keep_last_k)


def load_train_state(path: str, state: TrainState, *, rank: int) -> None:
    """Restore every part `state` registers from the checkpoint directory `path`."""
    if not os.path.isfile(os.path.join(path, f"rank_{rank}.pt")):
        raise FileNotFoundError(
            f"{path!r} has no state for rank {rank}: it was saved with fewer ranks; resume with the world size it "
            "was saved with"
        )
    state.load(functools.partial(load_file, path), f"rank_{rank}")


def load_file(directory: str, stem: str) -> dict:
    path = os.path.join(directory, f"{stem}.pt")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise pickle.UnpicklingError(
            f"refusing to load {path}: it holds objects other than tensors and plain Python types, and "
            "unpickling those could run arbitrary code. stableclip never writes such files: delete it, or "
            "resume from another checkpoint with trainer.resume=PATH"
        ) from err


# Gathering: whole tensors, one at a time, onto rank 0's CPU (the other ranks get {}). Loading: every rank
# passes the whole state and keeps its own shards.
GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)
SCATTER = StateDictOptions(full_state_dict=True)


def model_state(model: nn.Module) -> dict:
    """The state dict of the whole model (under FSDP2: on rank 0, {} on the others; collective)."""
    if isinstance(model, FSDPModule):
        return get_model_state_dict(model, options=GATHER)
    return model.state_dict()


def load_model_state(model: nn.Module, state: dict) -> None:
    if isinstance(model, FSDPModule):
        set_model_state_dict(model, state, options=SCATTER)
    else:
        model.load_state_dict(state)


class ModelState:
    """The model as a stateful part of a checkpoint: whole, in DDP's layout, also under FSDP2."""

    def __init__(self, model: nn.Module):
        self.model = model

    def state_dict(self) -> dict:
        return model_state(self.model)

    def load_state_dict(self, state: dict) -> None:
        load_model_state(self.model, state)


class OptimizerState:
    """The optimizer as a stateful part of a checkpoint: indexed by parameter as DDP's, also under FSDP2."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        return optimizer_state(self.model, self.optimizer)

    def load_state_dict(self, state: dict) -> None:
        load_optimizer_state(self.model, self.optimizer, state)


def param_indices(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Parameter name -> the index `optimizer.state_dict()` gives it (param_groups order)."""
    names = {id(p): name for name, p in model.named_parameters()}
    return {names[id(p)]: i for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """`optimizer.state_dict()` of the whole model. Under FSDP2 (collective) torch keys it by parameter name;
    it is renumbered to DDP's layout, on rank 0 only."""
    if not isinstance(model, FSDPModule) or not optimizer.state:
        # Without state (every step so far skipped by the dynamic scaler) there is nothing to gather, and torch
        # would make some with a zero-lr step, which counts as a step.
        return optimizer.state_dict()
    state = get_optimizer_state_dict(model, optimizer, options=GATHER)
    if not state:
        return state
    index = param_indices(model, optimizer)
    return {
        "state": dict(sorted((index[name], s) for name, s in state["state"].items())),
        "param_groups": [{**g, "params": [index[name] for name in g["params"]]} for g in state["param_groups"]],
    }


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    if not isinstance(model, FSDPModule):
        optimizer.load_state_dict(state)
        return
    name = {i: n for n, i in param_indices(model, optimizer).items()}
    by_name = {
        "state": {name[i]: s for i, s in state["state"].items()},
        "param_groups": [{**g, "params": [name[i] for i in g["params"]]} for g in state["param_groups"]],
    }
    set_optimizer_state_dict(model, optimizer, by_name, options=SCATTER)
    # It rebuilds the groups' tuples (betas) as lists; take the hyperparameters as saved, as load_state_dict does.
    for group, saved in zip(optimizer.param_groups, state["param_groups"], strict=True):
        group.update((key, value) for key, value in saved.items() if key != "params")
