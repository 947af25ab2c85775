"""The per-tensor RMS statistic of Wortsman et al. 2023, RMS_t = sqrt(mean(g_t² / max(û_t, ε²))), for the
step an Adam-family optimizer just took; it is what loss spikes follow and StableAdamW clips on."""

from __future__ import annotations

import math

import torch

from src.optim.sharded import local, whole_norms
from src.optim.stable_adamw import StableAdamW


def update_rms(optimizer: torch.optim.Optimizer) -> tuple[list[torch.nn.Parameter], torch.Tensor] | None:
    """(parameters, 1-D RMS tensor on their device) after `optimizer.step()` and before `zero_grad()`;
    None for optimizers whose second moment is not available (bitsandbytes' 8-bit state). No host sync.
    The RMS of an FSDP2-sharded parameter is that of the whole tensor, the same on every rank."""
    if isinstance(optimizer, StableAdamW):
        pairs = optimizer.rms_by_param()
        return [p for p, _ in pairs], optimizer.last_rms
    if not isinstance(optimizer, torch.optim.AdamW):
        return None
    params, ratios = [], []
    for group in optimizer.param_groups:
        beta2, eps = group["betas"][1], group["eps"]
        members = [p for p in group["params"] if p.grad is not None and optimizer.state.get(p)]
        if not members:
            continue
        states = [optimizer.state[p] for p in members]
        # A few multi-tensor kernels per group, not a handful of launches per tensor: a Python loop over the
        # tensors here left the GPU waiting on the host for ~10% of a compiled ViT-B/32 step.
        denoms = torch._foreach_sqrt([local(s["exp_avg_sq"]) for s in states])
        # torch keeps the biased second moment; sqrt(û) = sqrt(u) / sqrt(1 − β2^t), t per tensor (fused and
        # capturable AdamW keep it on the device, where reading it would wait for the GPU).
        steps = torch.stack([s["step"] for s in states]).to(denoms[0].device, torch.float64, non_blocking=True)
        torch._foreach_div_(denoms, list((1 - beta2**steps).sqrt().to(denoms[0].dtype).unbind()))
        torch._foreach_clamp_min_(denoms, eps)
        torch._foreach_reciprocal_(denoms)
        torch._foreach_mul_(denoms, [local(p.grad) for p in members])
        params += members
        ratios += denoms
    if not params:
        return None
    norms = whole_norms(torch.stack(torch._foreach_norm(ratios)), params)
    # non_blocking: a plain copy to the GPU waits for all queued work, which left the GPU idle after it.
    sizes = torch.tensor([math.sqrt(p.numel()) for p in params]).to(ratios[0].device, non_blocking=True)
    return params, norms / sizes
