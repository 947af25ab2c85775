"""Atomic, verified checkpoints: written to `step_N.tmp/`, fsynced, then renamed; a directory without the
suffix was completely written, so a crash mid-save never produces a broken "latest".

Layout of `checkpoints/step_00000500/`: `model.pt` and `train_state.pt` (optimizer, scheduler, step,
...) from rank 0, and `rank_R.pt` (RNG states, data position) from every rank. All files hold only
tensors and plain Python types and load with `torch.load(weights_only=True)`. Which part goes where is
src/trainer/state.py's `TrainState`, the one list of what a checkpoint holds. `manifest.json`, written last
(after every other file is fsynced, before the rename), lists every file with its size and sha256: a checkpoint
is intact when every file it lists is there with that size and checksum. Disks, copies and file systems damage
files after a save too (a truncated copy, a flipped bit), so a resume verifies before it loads: `latest` takes
the newest intact checkpoint and names the ones it skipped; an explicit path that fails stops with the file and
what is wrong with it. Checkpoints written before manifests existed have none: they load as legacy, checked
with the CRC32 that torch.save stores for every record of its zip archive.

A write that fails (disk full, quota, permissions) removes its `.tmp` directory and raises on every rank;
the previous checkpoint stays as it was. See docs/reliability.md.

Under FSDP2 (`trainer.data_parallel=fsdp2`) the model and optimizer state are gathered whole to rank 0's CPU and
written in the layout DDP writes (`model_state`, `optimizer_state`), so a checkpoint moves freely between
FSDP2, DDP and single-process runs, at any world size the loader allows.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import logging
import os
import pickle
import re
import shutil
import zipfile
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
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
from src.trainer.state import MODEL_FILE, SHARED_FILES, TrainState

log = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step_(\d+)$")
DEBRIS = re.compile(r"^step_\d+\.(tmp|deleting)$")  # left by a save or a prune that was killed
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
HASH_CHUNK = 16 << 20  # large reads: hashlib releases the GIL for them


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written; nothing was renamed or pruned."""


class CheckpointError(ValueError):
    """A checkpoint that fails verification or cannot be read; the message names the file and what is wrong."""


def step_dir(checkpoints: str, step: int) -> str:
    return os.path.join(checkpoints, f"step_{step:08d}")


def step_of(path: str) -> int:
    return int(STEP_DIR.match(os.path.basename(path)).group(1))


def complete_checkpoints(checkpoints: str) -> list[str]:
    """Completely written checkpoint directories (renamed from `.tmp`), oldest first; see `checkpoint_problem` for
    whether one is still intact."""
    if not os.path.isdir(checkpoints):
        return []
    found = [(int(m.group(1)), name) for name in os.listdir(checkpoints) if (m := STEP_DIR.match(name))]
    return [os.path.join(checkpoints, name) for _, name in sorted(found)]


# ------------------------------------------------------------------------------------------------ verification


def file_sha256(path: str) -> str:
    """sha256 rather than a faster CRC: a file's damage is not always a burst of a few bits (a block of another
    file, a bad copy), and it costs about 1 s per 2 GB on a server core, far less than writing the file."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def rank_file(rank: int) -> str:
    return f"rank_{rank}.pt"


def required_files(world_size: int) -> list[str]:
    return [f"{stem}.pt" for stem in SHARED_FILES] + [rank_file(r) for r in range(world_size)]


def read_manifest(directory: str) -> dict | None:
    """The manifest of the checkpoint `directory`, None for one written before manifests existed (no
    manifest.json). Raises CheckpointError for a manifest that is not one (torn, zero bytes, garbage)."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.lexists(path):
        return None
    try:
        with open(path, "rb") as f:
            manifest = json.loads(f.read().decode("utf-8"))
    except OSError as err:
        raise CheckpointError(f"{path} cannot be read: {err}") from None
    except UnicodeDecodeError:
        raise CheckpointError(f"{path} is not text (binary bytes): the checkpoint is damaged") from None
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path} is not valid JSON, torn or overwritten ({err}): the checkpoint is damaged") \
            from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    valid = (isinstance(files, dict) and isinstance(manifest.get("world_size"), int) and manifest["world_size"] >= 1
             and all(isinstance(e, dict) and isinstance(e.get("bytes"), int) and isinstance(e.get("sha256"), str)
                     for e in files.values()))
    if not valid or manifest.get("format") != MANIFEST_FORMAT:
        raise CheckpointError(f"{path} is not a checkpoint manifest of format {MANIFEST_FORMAT}: the checkpoint is "
                              "damaged, or was not written by stableclip")
    return manifest


def archive_problem(path: str, crc: bool) -> str | None:
    """What is wrong with a torch.save file that no manifest describes: torch.save writes a zip archive with a
    CRC32 for every record, checked with `crc`; None when it is sound."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip() if crc else None
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError) as err:
        return (f"{path} is not a file torch.save wrote, or it is truncated ({err}): it may have been cut short by "
                "a copy or overwritten")
    except OSError as err:
        return f"{path} cannot be read: {err}"
    if bad is not None:
        return f"{path} fails the CRC32 of its record {bad}: the file is corrupted"
    return None


def file_problem(directory: str, name: str, entry: dict | None, checksums: bool) -> str | None:
    """What is wrong with file `name` of a checkpoint, None when it is intact. `entry`: its manifest entry (size and
    sha256), None for a legacy checkpoint; `checksums`: compute the checksum (a full read), not only the size."""
    path = os.path.join(directory, name)
    listed = " (its manifest lists it)" if entry is not None else ""
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        return f"{path} is missing{listed}"
    except OSError as err:
        return f"{path} cannot be read: {err}"
    if size == 0:
        return f"{path} is empty (0 bytes" + (f", its manifest says {entry['bytes']})" if entry else ")")
    if entry is None:
        return archive_problem(path, crc=checksums)
    if size < entry["bytes"]:
        return f"{path} is truncated: {size} bytes, its manifest says {entry['bytes']}"
    if size != entry["bytes"]:
        return f"{path} has {size} bytes, its manifest says {entry['bytes']}: it was changed after the save"
    if checksums:
        try:
            digest = file_sha256(path)
        except OSError as err:
            return f"{path} cannot be read: {err}"
        if digest != entry["sha256"]:
            return (f"{path} fails its checksum (sha256 {digest[:16]}..., its manifest says {entry['sha256'][:16]}...):"
                    " its bytes changed after the save (disk or copy corruption)")
    return None


def checkpoint_problem(directory: str, *, checksums: bool, files: Iterable[str] | None = None) -> str | None:
    """What is wrong with the checkpoint `directory`, None when it is intact: every file it must hold is there, with
    its manifest's size and (with `checksums`) sha256. `files`: only these (model.init_from needs model.pt only).
    A checkpoint without manifest.json is legacy: its files must be there, non-empty and sound zip archives."""
    if not os.path.isdir(directory):
        return f"{directory} is not a directory"
    try:
        manifest = read_manifest(directory)
    except CheckpointError as err:
        return str(err)
    if manifest is None:
        if not os.path.lexists(os.path.join(directory, f"{MODEL_FILE}.pt")):
            return f"{directory} is not a checkpoint directory: it holds neither {MANIFEST} nor {MODEL_FILE}.pt"
        # Legacy: the world size is not known without loading train_state.pt; rank 0's file is always there.
        present = [name for name in os.listdir(directory) if re.fullmatch(r"rank_\d+\.pt", name)]
        entries = dict.fromkeys(sorted({*required_files(1), *present}))
    else:
        entries = manifest["files"]
        needed = required_files(manifest["world_size"]) if files is None else files
        unlisted = [name for name in needed if name not in entries]
        if unlisted:
            return f"{os.path.join(directory, MANIFEST)} does not list {', '.join(unlisted)}: the checkpoint is damaged"
    for name in entries if files is None else files:
        problem = file_problem(directory, name, entries.get(name), checksums)
        if problem is not None:
            return problem
    return None


def newest_intact(checkpoints: str, *, checksums: bool,
                  files: Iterable[str] | None = None) -> tuple[str | None, list[tuple[str, str]]]:
    """The newest intact checkpoint in `checkpoints` (None if there is none), and the (newer) ones skipped, each with
    what is wrong with it."""
    skipped = []
    for path in reversed(complete_checkpoints(checkpoints)):
        problem = checkpoint_problem(path, checksums=checksums, files=files)
        if problem is None:
            return path, skipped
        skipped.append((path, problem))
    return None, skipped


def log_unverified(path: str) -> None:
    if read_manifest(path) is None:
        log.warning("%s has no %s (it was written before checkpoints had one): its files were checked with the CRC32s "
                    "torch.save stores in them, not against a manifest", path, MANIFEST)


def choose_resume(checkpoints: str, resume: str, required: bool,
                  checksums: bool) -> tuple[str | None, list[tuple[str, str]], Exception | None]:
    """(the checkpoint to resume from, the ones `latest` skipped, the error to raise instead)."""
    if resume != "latest":
        problem = checkpoint_problem(resume, checksums=checksums)
        if problem is None:
            return resume, [], None
        return None, [], CheckpointError(
            f"trainer.resume={resume!r} cannot be resumed from: {problem}. Pass another checkpoint (a "
            "checkpoints/step_N directory), or trainer.resume=latest for the newest intact one")
    path, skipped = newest_intact(checkpoints, checksums=checksums)
    if path is None and skipped:
        # Starting over would soon prune these, and they may still be repaired or copied back.
        return None, skipped, CheckpointError(
            f"trainer.resume=latest: no checkpoint in {checkpoints} is intact ("
            + "; ".join(problem for _, problem in skipped) + "). Restore one, or move them away to start from step 0")
    if path is None and required:
        return None, [], FileNotFoundError(
            f"trainer.resume=latest but {checkpoints} holds no complete checkpoint, and "
            "trainer.resume_required=true: set trainer.run_dir to the run to continue, or "
            "trainer.resume_required=false to start from step 0")
    return path, skipped, None


def find_resume(checkpoints: str, resume: str | None, required: bool, *, rank: int, checksums: bool) -> str | None:
    """The checkpoint directory `trainer.resume` names, verified, or None to start from step 0. `latest` takes the
    newest intact one. Decided on rank 0 and broadcast (collective), so every rank resumes from the same one or
    raises the same error. `checksums=False` checks sizes only, a quick look that reports nothing (preflight); the
    resume itself checks every checksum and logs each checkpoint it skipped."""
    if not resume:
        return None
    decision = choose_resume(checkpoints, resume, required, checksums) if rank == 0 else None
    path, skipped, error = broadcast_object(decision)
    if error is not None:
        raise error
    if checksums and rank == 0:
        for bad, problem in skipped:
            log.warning("trainer.resume=latest: skipping %s: %s", bad, problem)
        if path is not None:
            log_unverified(path)
    return path


# ------------------------------------------------------------------------------------------------ writing


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


def write_manifest(directory: str, step: int, world_size: int, stems: Iterable[str] = SHARED_FILES) -> None:
    """The last file of a checkpoint: the size and sha256 of every other file (`stems`: rank 0's files, then every
    rank's). Rank 0 reads them back: the checkpoint directory is on a file system every rank writes to, as its
    rename already needs."""
    names = [f"{stem}.pt" for stem in stems] + [rank_file(r) for r in range(world_size)]
    files = {name: {"bytes": os.path.getsize(os.path.join(directory, name)),
                    "sha256": file_sha256(os.path.join(directory, name))} for name in names}
    manifest = {"format": MANIFEST_FORMAT, "step": step, "world_size": world_size, "files": files}
    with open(os.path.join(directory, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(directory)


def save_checkpoint(
    checkpoints: str, step: int, *, rank: int, shared: dict[str, dict], per_rank: dict, keep_last_k: int
) -> str:
    """`shared` maps file stem -> state, written by rank 0; `per_rank` is written by every rank."""
    final = step_dir(checkpoints, step)
    tmp = final + ".tmp"
    world_size = dist.get_world_size() if dist.is_initialized() else 1

    def make_tmp() -> None:
        os.makedirs(checkpoints, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)

    def write_files() -> None:
        fsync_save(per_rank, os.path.join(tmp, rank_file(rank)))
        if rank == 0:
            for stem, state in shared.items():
                fsync_save(state, os.path.join(tmp, f"{stem}.pt"))

    write_on_every_rank(make_tmp if rank == 0 else None, rank, checkpoints, tmp)
    write_on_every_rank(write_files, rank, checkpoints, tmp)
    write_on_every_rank(functools.partial(write_manifest, tmp, step, world_size, shared) if rank == 0 else None,
                        rank, checkpoints, tmp)
    if rank == 0:
        if os.path.exists(final):  # saving the same step twice (e.g. the final save): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(checkpoints)
        retire_newer(checkpoints, step)
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


def retire_newer(checkpoints: str, step: int) -> None:
    """Retire the checkpoints after `step`, which this run has just written: they are from before its resume
    (ones `latest` skipped as damaged, or the rest of a run resumed from an earlier step), and `latest` must never
    pick them over the run's own, nor pruning keep them instead of it."""
    for newer in complete_checkpoints(checkpoints):
        if step_of(newer) > step:
            log.warning("removing %s: it is newer than step %d, which this run resumed before and has now saved",
                        newer, step)
            os.replace(newer, newer + ".deleting")


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


def load_train_state(path: str, state: TrainState, *, rank: int) -> list[str]:
    """Restore every part `state` registers from the checkpoint directory `path` (verified by `find_resume`).
    Returns the optional files (TrainState's `files`) the checkpoint lacks."""
    manifest = read_manifest(path)
    if not os.path.isfile(os.path.join(path, rank_file(rank))):
        saved_by = manifest["world_size"] if manifest else None
        if saved_by is None and rank == 0 or saved_by is not None and rank < saved_by:
            raise CheckpointError(f"{os.path.join(path, rank_file(rank))} is missing: the checkpoint is incomplete")
        raise CheckpointError(
            f"{path!r} has no state for rank {rank}: it was saved with fewer ranks"
            + (f" ({saved_by})" if saved_by else "") + "; resume with the world size it was saved with"
        )
    return state.load(functools.partial(load_file, path), f"rank_{rank}",
                      lambda stem: os.path.isfile(os.path.join(path, f"{stem}.pt")))


def load_torch_file(path: str) -> dict:
    """torch.load(weights_only=True), with every failure named: the file and what is wrong with it."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        if not zipfile.is_zipfile(path):  # not torch.save's archive: damaged bytes, not a hostile pickle
            raise CheckpointError(f"cannot load {path}: {archive_problem(path, crc=False)}") from None
        raise pickle.UnpicklingError(
            f"refusing to load {path}: it holds objects other than tensors and plain Python types, and "
            "unpickling those could run arbitrary code. stableclip never writes such files: delete it, or "
            "resume from another checkpoint with trainer.resume=PATH"
        ) from err
    except Exception as err:  # damaged bytes fail anywhere in torch.load: EOFError, IndexError, UnicodeDecodeError...
        problem = file_problem(os.path.dirname(path), os.path.basename(path), None, checksums=True)
        raise CheckpointError(f"cannot load {path}: {problem or f'{type(err).__name__}: {err}'}") from err


def load_file(directory: str, stem: str) -> dict:
    return load_torch_file(os.path.join(directory, f"{stem}.pt"))


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
