"""Loss scalers for fp16: none, torch's dynamic GradScaler, and the paper's fixed per-tensor scalar.

All three share one interface, so the trainer's step reads the same for each:
    scaler.scale(loss).backward(); scaler.unscale_(optimizer); ...clip...; scaler.step(optimizer, found_inf)

- `dynamic` (torch.amp.GradScaler): an Inf/NaN anywhere skips the whole step and halves the scale.
- `fixed` (Wortsman et al. 2023, §3.6): `(scale · loss).backward()`; the optimizer divides each gradient
  by the scale and a tensor whose gradient holds an Inf/NaN skips only its own update (moments untouched)
  while the others step. Needs our StableAdamW (which `optim=adamw` also uses in that mode, without
  update clipping).
"""

from __future__ import annotations

import torch

from src.config import PrecisionConfig, Scaler
from src.optim.factory import optimizer_step
from src.optim.stable_adamw import StableAdamW

SCALERS = Scaler.values()


class NoScaler:
    divisor: float = 1.0
    skips_tensors = False

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def step(self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
        optimizer_step(optimizer, found_inf)

    def current_scale(self) -> torch.Tensor | None:
        return None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class DynamicScaler(NoScaler):
    def __init__(self, device: torch.device):
        self.grad_scaler = torch.amp.GradScaler(device.type)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.grad_scaler.scale(loss)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self.grad_scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
        # GradScaler found any Inf/NaN gradient itself; a non-finite loss always makes one.
        self.grad_scaler.step(optimizer)
        self.grad_scaler.update()

    def current_scale(self) -> torch.Tensor | None:
        return self.grad_scaler._get_scale_async()

    def state_dict(self) -> dict:
        return self.grad_scaler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.grad_scaler.load_state_dict(state)


class FixedScaler(NoScaler):
    skips_tensors = True

    def __init__(self, scale: float, device: torch.device):
        self.divisor = scale
        self.scale_tensor = torch.tensor(scale, device=device)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_tensor

    def step(self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
        if not isinstance(optimizer, StableAdamW):
            raise TypeError(
                f"precision.scaler=fixed needs optim=adamw or optim=stable_adamw, not {type(optimizer).__name__}"
            )
        optimizer.step(grad_scale=self.scale_tensor, skip_nonfinite=True, found_inf=found_inf)

    def current_scale(self) -> torch.Tensor | None:
        return self.scale_tensor


def build_scaler(cfg: PrecisionConfig, device: torch.device) -> NoScaler:
    if cfg.scaler not in SCALERS:
        raise ValueError(f"precision.scaler={cfg.scaler!r} is not one of {', '.join(SCALERS)}")
    if cfg.dtype == "fp16" and cfg.scaler == "none":
        raise ValueError("precision.dtype=fp16 needs a loss scaler: set precision.scaler=dynamic or fixed")
    if cfg.scaler == "dynamic":
        return DynamicScaler(device)
    if cfg.scaler == "fixed":
        if cfg.fixed_scale <= 0:
            raise ValueError(f"precision.fixed_scale={cfg.fixed_scale} must be positive (the paper uses 65536)")
        return FixedScaler(cfg.fixed_scale, device)
    return NoScaler()
