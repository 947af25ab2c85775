"""Global gradient norm and norm clipping, on the device."""

from __future__ import annotations

import torch

from src.parallel.sharded_norms import local, whole_norms


def clip_grad_norm(
    grads: list[torch.Tensor], max_norm: float | None, *, divisor: float = 1.0, ignore_nonfinite: bool = False
) -> torch.Tensor:
    """Return the global L2 norm of `grads / divisor`, and scale `grads` in place so it is at most
    `max_norm` (when given). No host sync.

    With the fixed fp16 loss scale, gradients still carry the scale (`divisor`), and a tensor holding an
    Inf/NaN is skipped alone by the optimizer, so `ignore_nonfinite` leaves such tensors out of the norm
    instead of letting one bad tensor zero every other tensor's update.

    FSDP2-sharded (DTensor) gradients count whole: a tensor is non-finite on every rank when any shard is, and
    every rank returns the same norm."""
    local_grads = [local(g) for g in grads]
    norms = whole_norms(torch.stack(torch._foreach_norm(local_grads)).float(), grads)
    if ignore_nonfinite:
        norms = torch.where(norms.isfinite(), norms, 0.0)
    total = norms.square().sum().sqrt() / divisor
    if max_norm is not None:
        torch._foreach_mul_(local_grads, (max_norm / (total + 1e-6)).clamp(max=1.0))
    return total
