"""`model.init_from`: start from pre-trained weights, ours or OpenCLIP's."""

from __future__ import annotations

import os

import torch
from torch import nn

from src.models.clip import CLIP
from src.models.openclip_interop import load_openclip_checkpoint
from src.trainer.checkpoint import complete_checkpoints

OPENCLIP = "openclip:"
FORMS = ("a checkpoints/step_N directory, its model.pt, a run directory or its checkpoints/ directory (the newest "
         "complete checkpoint is taken), or openclip:FILE for an OpenCLIP checkpoint")


def model_file(path: str) -> str:
    """The model.pt that `path` names (see FORMS)."""
    if os.path.isfile(path):
        return path
    if os.path.isfile(os.path.join(path, "model.pt")):
        return os.path.join(path, "model.pt")
    for checkpoints in (path, os.path.join(path, "checkpoints")):
        found = complete_checkpoints(checkpoints)
        if found:
            return os.path.join(found[-1], "model.pt")
    raise FileNotFoundError(f"model.init_from={path!r} names no checkpoint: give {FORMS}")


def load_pretrained(model: nn.Module, spec: str) -> str:
    """Load `spec` into `model`, a CLIP or a model holding one as `.clip` (the video model). A video model's
    own checkpoint loads whole into a video model; into a CLIP, its towers load. Returns the file read."""
    clip = model if isinstance(model, CLIP) else model.clip
    if spec.startswith(OPENCLIP):
        path = spec.removeprefix(OPENCLIP)
        load_openclip_checkpoint(clip, path)
        return path
    path = model_file(spec)
    state = torch.load(path, map_location="cpu", weights_only=True)
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
                         f"model.video settings) it was trained with.\n{err}") from None
    return path
