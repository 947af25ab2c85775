"""Per-tensor statistics of parameters that FSDP2 shards (`trainer.data_parallel=fsdp2`).

FSDP2 holds each parameter, its gradient and its optimizer state as a DTensor whose local part is one dim-0 shard.
Elementwise math runs on the local parts; a per-tensor reduction (a norm, an RMS, "is every element finite")
adds up the shards' partial results with one all-reduce per list of tensors, so every rank gets the statistic
of the whole tensor and takes the same decision. Plain tensors are whole already: unsharded models, and the
0-dim parameters FSDP2 leaves replicated. Without DTensors nothing is communicated and every result is what an
unsharded run computes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard


def local(t: Tensor) -> Tensor:
    """This rank's part of `t`, sharing its storage: in-place updates of it update `t`."""
    return t.to_local() if isinstance(t, DTensor) else t


def _shard_group(sharded: list[Tensor]) -> dist.ProcessGroup:
    meshes = {t.device_mesh for t in sharded}
    if len(meshes) > 1 or any(not isinstance(pl, Shard) for t in sharded for pl in t.placements):
        raise ValueError(
            "per-tensor statistics of DTensors need every tensor sharded over one 1-D mesh, as FSDP2's fully_shard "
            f"makes them; got meshes {meshes} and placements {sorted({str(t.placements) for t in sharded})}"
        )
    return meshes.pop().get_group()


def sum_over_shards(values: Tensor, tensors: Sequence[Tensor]) -> Tensor:
    """`values[i]` holds a sum over this rank's part of `tensors[i]`; returns the sums over the whole tensors.
    One all-reduce, of the entries of DTensors only. No host sync."""
    sharded = [i for i, t in enumerate(tensors) if isinstance(t, DTensor)]
    if not sharded:
        return values
    group = _shard_group([tensors[i] for i in sharded])
    if len(sharded) == len(tensors):
        values = values.clone()
        dist.all_reduce(values, group=group)
        return values
    # Views and stack rather than an index tensor, whose copy to the device would wait for the device.
    part = torch.stack([values[i] for i in sharded])
    dist.all_reduce(part, group=group)
    summed = list(values.unbind())
    for i, total in zip(sharded, part.unbind(), strict=True):
        summed[i] = total
    return torch.stack(summed)


def whole_norms(local_norms: Tensor, tensors: Sequence[Tensor]) -> Tensor:
    """The L2 norms of `tensors` from the L2 norms of their local parts (1-D, one per tensor). A non-finite
    shard makes its tensor's norm non-finite on every rank."""
    if not any(isinstance(t, DTensor) for t in tensors):
        return local_norms  # bit for bit what an unsharded run computes
    return sum_over_shards(local_norms.float().square(), tensors).sqrt()


def all_finite(local_finite: Tensor, tensors: Sequence[Tensor]) -> Tensor:
    """Per tensor (1-D bool): whether every element of the whole tensor is finite, from the same question
    asked of the local parts. Counts of bad shards rather than norms, which a large finite value could overflow."""
    return sum_over_shards((~local_finite).float(), tensors) == 0
