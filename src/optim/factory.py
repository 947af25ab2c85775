"""Build the optimizer named by `optim.name`, and step it without syncing on a non-finite loss."""

from __future__ import annotations

import torch
from torch import nn

from src.config import OptimConfig
from src.optim.param_groups import param_groups_for_weight_decay

OPTIMIZERS = ("adamw",)


def build_optimizer(cfg: OptimConfig, model: nn.Module) -> torch.optim.Optimizer:
    groups = param_groups_for_weight_decay(model, cfg.weight_decay)
    if cfg.name == "adamw":
        # fused=True runs on CPU and CUDA and accepts a device-side found_inf flag (see optimizer_step).
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=True)
    raise ValueError(f"optim.name={cfg.name!r} is not a known optimizer: choose one of {', '.join(OPTIMIZERS)}")


def optimizer_step(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
    """Step, unless the 0-dim `found_inf` is nonzero. The flag stays on the device: no host sync."""
    optimizer.found_inf = found_inf
    try:
        optimizer.step()
    finally:
        optimizer.found_inf = None
