"""The learning-rate schedules of `optim.schedule`, as multipliers of the peak `optim.lr` at each step:

- `cosine`: linear warm-up, then cosine decay to `min_lr_ratio` of the peak at `max_steps`;
- `constant`: linear warm-up, then the peak until the end;
- `const_cooldown`: linear warm-up, the peak, then a cooldown to `min_lr_ratio` over the last `cooldown_steps`
  steps, shaped `linear`, `sqrt` (1 - sqrt, Hägele et al. 2024, "Scaling Laws and Compute-Optimal Training Beyond
  Fixed Training Durations") or `cosine`.

The two constant schedules do not depend on `max_steps` before their end, so a run resumed with a larger
`trainer.max_steps` continues on the same curve (const_cooldown's cooldown moves to the new end): what
scaling-law studies do to extend a run from one checkpoint."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.optim.lr_scheduler import LambdaLR

from src.config import OptimConfig

# Progress p through the cooldown, 0 at its start and 1 at its end -> the share of (peak - floor) kept.
COOLDOWN_SHAPES: dict[str, Callable[[float], float]] = {
    "linear": lambda p: 1 - p,
    "sqrt": lambda p: 1 - math.sqrt(p),
    "cosine": lambda p: 0.5 * (1 + math.cos(math.pi * p)),
}


def warmup_cosine(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def warmup_constant_cooldown(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float, cooldown_steps: int,
                             shape: str) -> float:
    """Warm-up, the peak, then the cooldown over the last `cooldown_steps` steps (0: none, the constant schedule)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    start = max_steps - cooldown_steps
    if cooldown_steps == 0 or step < start:
        return 1.0
    progress = min(1.0, (step - start) / cooldown_steps)
    return min_lr_ratio + (1 - min_lr_ratio) * COOLDOWN_SHAPES[shape](progress)


def lr_multiplier(cfg: OptimConfig, max_steps: int) -> Callable[[int], float]:
    """step -> the multiple of `optim.lr` that `optim.schedule` gives it."""
    if cfg.schedule == "cosine":
        return lambda step: warmup_cosine(step, cfg.warmup_steps, max_steps, cfg.min_lr_ratio)
    cooldown = cfg.cooldown_steps if cfg.schedule == "const_cooldown" else 0
    return lambda step: warmup_constant_cooldown(step, cfg.warmup_steps, max_steps, cfg.min_lr_ratio, cooldown,
                                                 str(cfg.cooldown_shape))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, max_steps: int) -> LambdaLR:
    return LambdaLR(optimizer, lr_multiplier(cfg, max_steps))
