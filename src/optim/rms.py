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
    params, grads, denoms = [], [], []
    for group in optimizer.param_groups:
        beta2, eps = group["betas"][1], group["eps"]
        for p in group["params"]:
            state = optimizer.state.get(p)
            if p.grad is None or not state:
                continue
            # torch keeps the biased second moment; û = u / (1 − β2^t).
            u_hat = local(state["exp_avg_sq"]) / (1 - beta2 ** state["step"].to(p.device))
            params.append(p)
            grads.append(local(p.grad))
            denoms.append(u_hat.sqrt_().clamp_min_(eps))
    if not params:
        return None
    norms = whole_norms(torch.stack(torch._foreach_norm(torch._foreach_div(grads, denoms))), params)
    return params, norms / torch.tensor([math.sqrt(p.numel()) for p in params], device=grads[0].device)
