"""The per-tensor RMS statistic of Wortsman et al. 2023, RMS_t = sqrt(mean(g_t² / max(û_t, ε²))), for the
step an Adam-family optimizer just took; it is what loss spikes follow and StableAdamW clips on."""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

from src.kernels.triton_interpreter import interpreting
from src.optim.stable_adamw import StableAdamW
from src.optim.stable_adamw_triton import fused_adamw_rms, triton_available
from src.parallel.sharded_norms import local, whole_norms


def update_rms(optimizer: torch.optim.Optimizer) -> tuple[list[torch.nn.Parameter], torch.Tensor] | None:
    """(parameters, 1-D RMS tensor on their device) after `optimizer.step()` and before `zero_grad()`;
    None for optimizers whose second moment is not available (bitsandbytes' 8-bit state). No host sync.
    The RMS of an FSDP2-sharded parameter is that of the whole tensor, the same on every rank."""
    if isinstance(optimizer, StableAdamW):
        pairs = optimizer.rms_by_param()
        return [p for p, _ in pairs], optimizer.last_rms
    if not isinstance(optimizer, torch.optim.AdamW):
        return None
    params, rms = [], []
    for group in optimizer.param_groups:
        members = [p for p in group["params"] if p.grad is not None and optimizer.state.get(p)]
        if members:
            params += members
            rms.append(_fused_rms(optimizer, group, members))
            if rms[-1] is None:
                rms[-1] = _multi_tensor_rms(optimizer, group, members)
    if not params:
        return None
    return params, torch.cat(rms)


def _fused_rms(optimizer: torch.optim.AdamW, group: dict, members: list[torch.nn.Parameter]) -> torch.Tensor | None:
    """The RMS of whole float32 tensors on one GPU from one Triton pass over g and u (8 bytes per element), or
    None where that pass does not apply: sharded or other tensors, step counts on the host, no Triton."""
    device = members[0].device
    if not (triton_available() and (device.type == "cuda" or interpreting())):
        return None
    if any(isinstance(p, DTensor) or p.device != device or p.dtype != torch.float32 for p in members):
        return None
    states = [optimizer.state[p] for p in members]
    try:
        return fused_adamw_rms(members, [p.grad for p in members], [s["exp_avg"] for s in states],
                               [s["exp_avg_sq"] for s in states], [s["step"] for s in states],
                               beta2=group["betas"][1], eps=group["eps"])
    except ValueError:  # layouts the kernels do not take (e.g. a gradient with other strides)
        return None


def _multi_tensor_rms(optimizer: torch.optim.AdamW, group: dict, members: list[torch.nn.Parameter]) -> torch.Tensor:
    """The same RMS from multi-tensor ops, for any tensors (FSDP2 shards included): 48 bytes per element."""
    beta2, eps = group["betas"][1], group["eps"]
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
    norms = whole_norms(torch.stack(torch._foreach_norm(denoms)), members)
    # non_blocking: a plain copy to the GPU waits for all queued work, which left the GPU idle after it.
    sizes = torch.tensor([math.sqrt(p.numel()) for p in members]).to(norms.device, non_blocking=True)
    return norms / sizes
