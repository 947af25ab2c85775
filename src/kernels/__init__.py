"""Our kernels (Triton attention, fused residual + LayerNorm, GELU, SwitchBack linear layers) and `apply_kernels`,
which puts them into a plain model. The names below load on first use, so importing this package needs no Triton
(a GPU extra)."""

from __future__ import annotations

import importlib

_HOMES = {
    "apply_kernels": "src.kernels.dispatch",
    "convert_to_switchback": "src.kernels.switchback.convert",
    "SwitchBackLinear": "src.kernels.switchback.convert",
    "switchback_linear": "src.kernels.switchback.functions",
}

__all__ = list(_HOMES)


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
