"""Swap a model's linear layers for SwitchBack ones, keeping parameters, names and dtypes unchanged, so
checkpoints move freely between `model.linear=standard` and any SwitchBack variant."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from src.config import Linear
from src.kernels.switchback.functions import VARIANTS, check_backend, switchback_linear


def check_linear_choice(variant: str, backend: str, device: torch.device) -> None:
    """Fail with the fix where SwitchBack `variant` (a model.linear other than standard) cannot run with `backend`
    on `device` (on `meta` only the names are checked)."""
    if variant not in VARIANTS:
        raise ValueError(f"model.linear={variant!r} is not one of {', '.join(Linear.values())}")
    if device.type != "meta":
        check_backend(VARIANTS[variant], backend, device)


class SwitchBackLinear(nn.Linear):
    """An nn.Linear whose forward runs SwitchBack arithmetic; same parameters, same state-dict keys."""

    def __init__(self, linear: nn.Linear, variant: str, backend: str, fp8_fast_accum: bool = True):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.variant, self.backend, self.fp8_fast_accum = variant, backend, fp8_fast_accum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return switchback_linear(x, self.weight, self.bias, self.variant, self.backend, self.fp8_fast_accum)

    def extra_repr(self) -> str:
        fast_accum = f", fp8_fast_accum={self.fp8_fast_accum}" if VARIANTS[self.variant].fp8 else ""
        return f"{super().extra_repr()}, variant={self.variant}, backend={self.backend}{fast_accum}"


def convert_to_switchback(
    module: nn.Module, variant: str, backend: str = "cuda", fp8_fast_accum: bool = True
) -> nn.Module:
    """Replace, in place, every `nn.Linear` of `module` and the fused QKV projection of our `Attention`
    (any module with a `linear` function attribute) by SwitchBack. Convolutions and bare projection
    matrices (CLIP's patch embedding, `proj`, `text_projection`) are not linear layers and stay as they are,
    as in the paper. `fp8_fast_accum` is `switchback_linear`'s. Returns `module`."""
    check_linear_choice(variant, backend, next(module.parameters()).device)
    for parent in list(module.modules()):
        if getattr(parent, "linear", None) is F.linear:
            parent.linear = partial(switchback_linear, variant=variant, backend=backend, fp8_fast_accum=fp8_fast_accum)
        for name, child in parent.named_children():
            if type(child) is nn.Linear:
                setattr(parent, name, SwitchBackLinear(child, variant, backend, fp8_fast_accum))
    return module
