"""Optimizers and what steps them: StableAdamW (stable_adamw.py, with its fused Triton step in
stable_adamw_triton.py, used only when triton is installed), the optimizer and its weight-decay groups from the
config (factory.py, param_groups.py), the learning-rate schedule (schedule.py), loss scalers (scalers.py), and
the gradient-norm clip and update RMS that the trainer logs (grad_norm.py, rms.py)."""

from src.optim.factory import build_optimizer, optimizer_step
from src.optim.param_groups import param_groups
from src.optim.scalers import build_scaler
from src.optim.schedule import build_scheduler
from src.optim.stable_adamw import StableAdamW

__all__ = [
    "StableAdamW", "build_optimizer", "build_scaler", "build_scheduler", "optimizer_step",
    "param_groups",
]
