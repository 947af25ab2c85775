"""Build the optimizer named by `optim.name`, and step it without syncing on a non-finite loss."""

from __future__ import annotations

import math

import torch
from torch import nn

from src.config import OptimConfig, OptimizerName
from src.optim.param_groups import param_groups
from src.optim.stable_adamw import StableAdamW

OPTIMIZERS = OptimizerName.values()


def check_optimizer_name(name: str) -> None:
    if name not in OPTIMIZERS:
        raise ValueError(f"optim.name={name!r} is not a known optimizer: choose one of {', '.join(OPTIMIZERS)}")


def build_optimizer(cfg: OptimConfig, model: nn.Module, *, per_tensor_skips: bool = False,
                    depths: dict[str, int] | None = None) -> torch.optim.Optimizer:
    """The optimizer of the model's trainable parameters. `per_tensor_skips` (the fixed fp16 scaler) needs our
    StableAdamW: with update clipping off (clip_threshold = inf) its update is AdamW's, bias correction and
    decoupled decay included. `depths`: each parameter's depth from its tower's top, which `optim.layer_decay`
    scales its lr by (src/models/locking.py's layer_depths); needed when layer_decay < 1."""
    check_optimizer_name(cfg.name)
    if cfg.layer_decay != 1.0 and depths is None:
        raise ValueError(f"optim.layer_decay={cfg.layer_decay} needs each parameter's depth: pass depths "
                         "(src.models.locking.layer_depths(model))")
    groups = param_groups(model, cfg.weight_decay, cfg.lr, cfg.layer_decay, depths, cfg.layer_scale_lr_scale)
    betas = tuple(cfg.betas)
    if cfg.name == "adamw":
        if per_tensor_skips:
            return StableAdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                               clip_threshold=math.inf)
        # fused=True runs on CPU and CUDA and accepts a device-side found_inf flag (see optimizer_step).
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, fused=True)
    if cfg.name == "stable_adamw":
        return StableAdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                           clip_threshold=cfg.clip_threshold)
    return build_adamw8bit(cfg, groups, model, per_tensor_skips)  # the only name left


def build_adamw8bit(cfg: OptimConfig, groups: list[dict], model: nn.Module, per_tensor_skips: bool):
    device = next(model.parameters()).device
    if device.type != "cuda":
        raise ValueError(f"optim=adamw8bit (bitsandbytes) runs on CUDA only, the model is on {device}: "
                         "use optim=adamw or optim=stable_adamw")
    if per_tensor_skips:
        raise ValueError("precision.scaler=fixed cannot skip tensors inside bitsandbytes' AdamW8bit: "
                         "use precision.scaler=dynamic or optim=adamw")
    try:
        import bitsandbytes as bnb
    except ImportError as err:
        raise ImportError("optim=adamw8bit needs bitsandbytes: pip install 'stableclip[gpu]'") from err
    return bnb.optim.AdamW8bit(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)


def optimizer_step(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
    """Step, unless the 0-dim `found_inf` is nonzero. The flag stays on the device: no host sync.

    torch's fused AdamW and our StableAdamW read it as an attribute, the way torch.amp.GradScaler hands it
    over; other optimizers (bitsandbytes) do not, so for them the check costs one sync."""
    if isinstance(optimizer, StableAdamW) or getattr(optimizer, "defaults", {}).get("fused"):
        optimizer.found_inf = found_inf
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
    elif not found_inf.item():
        optimizer.step()
