"""The one registry of what a checkpoint holds: every stateful part of a run, by name and by the file it lives in.

Saving and resuming walk the same `TrainState`, so a part added to a run is saved and restored by adding it here
once. The layout on disk (src/trainer/checkpoint.py) is fixed by the checkpoints already written:

- `model.pt`: the model's state dict, the whole file;
- one more whole file per entry of `files`, written by rank 0 when the run has that part: `ema.pt` (the weights'
  EMA, in model.pt's layout, src/trainer/ema.py). Optional: a checkpoint without one resumes, the part then
  starting afresh;
- `train_state.pt` (rank 0): one key per shared part (`optimizer`, `scheduler`, `scaler`, `spikes`), and the run's
  progress counters (`step`, `world_size`, `nonfinite_streak`, `eval_pending`) at the top level;
- `rank_R.pt` (every rank): one key per per-rank part (`rng`, `data`).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

MODEL_FILE, SHARED_FILE = "model", "train_state"
SHARED_FILES = (MODEL_FILE, SHARED_FILE)  # written by rank 0, read by every rank


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class Progress:
    """Where the run is: the steps done, the non-finite steps skipped in a row, and whether this step's evaluation
    is still owed (a step's checkpoint is written before its evaluation, and a stop signal defers it): the resumed
    run then evaluates first. `world_size` is saved, not restored."""

    world_size: int
    step: int = 0
    nonfinite_streak: int = 0
    eval_pending: bool = False

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "world_size": self.world_size, "nonfinite_streak": self.nonfinite_streak,
                "eval_pending": self.eval_pending}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]
        # Checkpoints written before these keys existed had neither.
        self.nonfinite_streak = state.get("nonfinite_streak", 0)
        self.eval_pending = state.get("eval_pending", False)


class RNGState:
    """This process's random streams: Python's, NumPy's, torch's CPU and CUDA generators."""

    def state_dict(self) -> dict[str, Any]:
        state = {
            "python": random.getstate(),
            # weights_only loading refuses numpy arrays, so the Mersenne-Twister keys travel as a tensor.
            "numpy": [torch.from_numpy(v) if isinstance(v, np.ndarray) else v for v in np.random.get_state()],
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        random.setstate(state["python"])
        np.random.set_state(tuple(v.numpy() if isinstance(v, torch.Tensor) else v for v in state["numpy"]))
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])


@dataclass
class TrainState:
    """name -> stateful part. `model` is model.pt whole; `progress` is spread over train_state.pt's top level;
    `shared` are train_state.pt's other keys (rank 0 writes them); `per_rank` are the keys of every rank's own
    file; `files` are optional whole files beside model.pt (ema.pt). Parts are saved and loaded in this order (model
    before optimizer: loading FSDP2's optimizer state needs the parameters' shards in place), except that `files`
    load before the model (see `load`)."""

    model: Stateful
    progress: Progress
    shared: dict[str, Stateful] = field(default_factory=dict)
    per_rank: dict[str, Stateful] = field(default_factory=dict)
    files: dict[str, Stateful] = field(default_factory=dict)

    def shared_files(self) -> dict[str, dict[str, Any]]:
        """File stem -> contents, for rank 0 to write. Collective under FSDP2 (the model and optimizer are
        gathered): every rank calls it, and under FSDP2 ranks other than 0 get empty states."""
        model = self.model.state_dict()
        files = {stem: part.state_dict() for stem, part in self.files.items()}
        shared = {name: part.state_dict() for name, part in self.shared.items()}
        return {MODEL_FILE: model, **files, SHARED_FILE: {**shared, **self.progress.state_dict()}}

    def rank_file(self) -> dict[str, Any]:
        return {name: part.state_dict() for name, part in self.per_rank.items()}

    def load(self, read: Callable[[str], dict[str, Any]], rank_file: str, holds: Callable[[str], bool]) -> list[str]:
        """Restore every part; `read(stem)` gives a file's contents, `rank_file` is this rank's file stem, `holds(stem)`
        whether the checkpoint has that file. One file at a time, so the host holds one of them, not all (a large
        model's optimizer state is twice its size). Returns the stems of `files` the checkpoint lacks: those parts
        were not restored."""
        # The optional files first: loading the EMA writes through the model's tensors (swapped in), so the model's
        # own file must come after it.
        missing = [stem for stem in self.files if not holds(stem)]
        for stem, part in self.files.items():
            if stem not in missing:
                part.load_state_dict(read(stem))
        self.model.load_state_dict(read(MODEL_FILE))
        shared = read(SHARED_FILE)
        for name, part in self.shared.items():
            part.load_state_dict(shared[name])
        self.progress.load_state_dict(shared)
        del shared
        mine = read(rank_file)
        for name, part in self.per_rank.items():
            part.load_state_dict(mine[name])
        return missing
