"""The dtype autocast casts to, tested in a way that older TorchDynamo versions can trace too."""

from __future__ import annotations

import torch


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype autocast casts to on `device`'s type, or None where autocast is off. Not
    torch.amp.is_autocast_available: older TorchDynamo versions cannot trace it, and a
    compiled graph broke at every call. Autocast exists for CUDA and CPU tensors, not for `meta` ones."""
    if device.type in ("cuda", "cpu") and torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return None
