"""`model.init_from`: start from pre-trained weights, ours or OpenCLIP's. Our checkpoints are verified first
(src/trainer/checkpoint.py): only their model.pt, the one file read."""

from __future__ import annotations

import logging
import os

from torch import nn

from src.models.clip import CLIP
from src.models.openclip_interop import load_openclip_checkpoint
from src.trainer.checkpoint import (
    MANIFEST,
    CheckpointError,
    checkpoint_problem,
    complete_checkpoints,
    file_problem,
    load_torch_file,
    log_unverified,
    newest_intact,
    read_manifest,
)
from src.trainer.state import MODEL_FILE

log = logging.getLogger(__name__)

OPENCLIP = "openclip:"
MODEL_PT = f"{MODEL_FILE}.pt"
FORMS = ("a checkpoints/step_N directory, its model.pt, a run directory or its checkpoints/ directory (the newest "
         "intact checkpoint is taken), or openclip:FILE for an OpenCLIP checkpoint")


def model_file(path: str) -> str:
    """The model.pt that `path` names (see FORMS), verified against its checkpoint's manifest."""
    if os.path.isfile(path):
        directory, name = os.path.split(path)
        try:
            manifest = read_manifest(directory)
        except CheckpointError as err:
            raise CheckpointError(f"model.init_from={path!r} cannot be loaded: {err}") from None
        problem = file_problem(directory, name, manifest["files"].get(name) if manifest else None, checksums=True)
    elif os.path.isfile(os.path.join(path, MODEL_PT)) or os.path.lexists(os.path.join(path, MANIFEST)):
        directory, name = path, MODEL_PT
        problem = checkpoint_problem(path, checksums=True, files=[MODEL_PT])
    else:
        for checkpoints in (path, os.path.join(path, "checkpoints")):
            if not complete_checkpoints(checkpoints):
                continue
            directory, skipped = newest_intact(checkpoints, checksums=True, files=[MODEL_PT])
            for bad, problem in skipped:
                log.warning("model.init_from: skipping %s: %s", bad, problem)
            if directory is None:
                raise CheckpointError(f"model.init_from={path!r}: no checkpoint in {checkpoints} is intact ("
                                      + "; ".join(problem for _, problem in skipped) + ")")
            name, problem = MODEL_PT, None
            break
        else:
            raise FileNotFoundError(f"model.init_from={path!r} names no checkpoint: give {FORMS}")
    if problem is not None:
        raise CheckpointError(f"model.init_from={path!r} cannot be loaded: {problem}")
    log_unverified(directory)
    return os.path.join(directory, name)


def load_pretrained(model: nn.Module, spec: str) -> str:
    """Load `spec` into `model`, a CLIP or a model holding one as `.clip` (the video model). A video model's
    own checkpoint loads whole into a video model; into a CLIP, its towers load. Returns the file read."""
    clip = model if isinstance(model, CLIP) else model.clip
    if spec.startswith(OPENCLIP):
        path = spec.removeprefix(OPENCLIP)
        load_openclip_checkpoint(clip, path)
        return path
    path = model_file(spec)
    state = load_torch_file(path)
    target = clip
    if any(name.startswith("clip.") for name in state):  # saved from a video model
        if model is not clip:
            target = model
        else:
            state = {name.removeprefix("clip."): v for name, v in state.items() if name.startswith("clip.")}
    try:
        target.load_state_dict(state)
    except RuntimeError as err:
        raise ValueError(f"model.init_from={spec!r} does not fit this model: use the model= preset (and "
                         f"model.video settings, and loss= for a logit_bias) it was trained with.\n{err}") from None
    return path
