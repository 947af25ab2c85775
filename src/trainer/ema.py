"""`trainer.ema_decay`: an exponential moving average of the weights, ema = d·ema + (1 − d)·weights after every
optimizer step.

The average lives on the training device in the parameters' dtype (float32: parameters stay float32 under every
precision, autocast computes in 16 bits), one tensor per trainable parameter, and is updated with one `_foreach_lerp_`
(a multi-tensor kernel on a GPU, no host sync). Under FSDP2 each rank averages its own shards (the local tensors
of the parameters' DTensors), so the average costs 1/world of the weights per rank, as the weights do.

A step the scaler skipped leaves the weights as they were, so the average still moves toward those (finite)
weights, as timm's ModelEmaV3 and OpenCLIP's users of it do.

To evaluate or save it, `swapped()` exchanges the average and the weights in place, tensor by tensor (one tensor's
copy of extra memory, the same storage: a CUDA graph and FSDP2's shards stay valid), so the model's own evaluation
and state-dict code run on the average, and a second exchange puts everything back bit for bit. Checkpoints hold
it as `ema.pt`, in model.pt's layout (gathered whole under FSDP2): `model.init_from=.../step_N/ema.pt` starts a
run from it, and `export_ema` writes it as a model.pt of its own (also OpenCLIP's parameter names).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from src.trainer.checkpoint import fsync_save, load_model_state, load_torch_file, model_state
from src.trainer.pretrained import model_file

log = logging.getLogger(__name__)

EMA_FILE = "ema"  # the checkpoint's ema.pt


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter: its shard under FSDP2 (read anew each time: FSDP2 may replace the local
    tensor when it first runs), the tensor itself otherwise."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class ModelEMA:
    """The EMA of `model`'s parameters, a stateful part of the checkpoint (TrainState's `files`)."""

    def __init__(self, model: nn.Module, decay: float):
        """`decay` in (0, 1): preflight checks trainer.ema_decay's range."""
        self.model, self.decay = model, decay
        # Frozen parameters (a locked tower, the video run's frozen blocks) are their own average: no copy of them.
        self.parameters = [p for p in model.parameters() if p.requires_grad]
        with torch.no_grad():
            self.average = [local(p).detach().clone() for p in self.parameters]

    @torch.no_grad()
    def reset(self) -> None:
        """Start the average again from the weights as they are now (a resume from a checkpoint without one)."""
        torch._foreach_copy_(self.average, [local(p) for p in self.parameters])

    @torch.no_grad()
    def update(self) -> None:
        torch._foreach_lerp_(self.average, [local(p) for p in self.parameters], 1 - self.decay)

    @torch.no_grad()
    def exchange(self) -> None:
        for weights, average in zip((local(p) for p in self.parameters), self.average, strict=True):
            held = weights.clone()
            weights.copy_(average)
            average.copy_(held)

    @contextlib.contextmanager
    def swapped(self) -> Iterator[nn.Module]:
        """The model with the average as its weights, inside the block; its own weights again after it."""
        self.exchange()
        try:
            yield self.model
        finally:
            self.exchange()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The average as the model's state dict (model.pt's layout), copied to the CPU: the model's tensors get
        their weights back at the end of the block. Collective under FSDP2 (gathered to rank 0, {} elsewhere)."""
        with self.swapped() as model:
            return {name: t.detach().to("cpu", copy=True) for name, t in model_state(model).items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """The average from `state`. The model's frozen parameters get `state`'s values too: load the model's own
        weights after this (TrainState does)."""
        with self.swapped() as model:
            load_model_state(model, state)


def export_ema(checkpoint_dir: str, out: str) -> str:
    """Write the EMA weights of the checkpoint `checkpoint_dir` (a checkpoints/step_N directory) as `out`, a
    model.pt that `model.init_from` takes (scripts/export_openclip.py --ema writes an OpenCLIP model file). Returns
    `out`."""
    if not os.path.isdir(checkpoint_dir):
        raise FileNotFoundError(f"{checkpoint_dir} is not a checkpoint directory: give a checkpoints/step_N directory")
    source = os.path.join(checkpoint_dir, f"{EMA_FILE}.pt")
    if not os.path.isfile(source):
        raise FileNotFoundError(f"{checkpoint_dir} holds no {EMA_FILE}.pt: its run had trainer.ema_decay=null (give a "
                                "checkpoints/step_N directory of a run with an EMA)")
    source = model_file(source)  # verified against the checkpoint's manifest
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fsync_save(load_torch_file(source), out)
    log.info("wrote the EMA weights of %s to %s", checkpoint_dir, out)
    return out
