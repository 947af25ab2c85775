"""Process-group setup and the collectives the trainer needs; every function also works on one process."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_rank() -> int:
    """The rank torchrun gives this process, readable before any process group exists."""
    return int(os.environ.get("RANK", "0"))


def pick_device(name: str, local_rank: int) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("trainer.device=cuda but no CUDA device is visible: use trainer.device=cpu")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if name != "cpu":
        raise ValueError(f"trainer.device={name!r} is not one of auto, cpu, cuda")
    return torch.device("cpu")


def init_distributed(device_name: str) -> DistInfo:
    """Join torchrun's process group (NCCL on GPU, gloo on CPU) when WORLD_SIZE > 1."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_name, local_rank)
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(minutes=30))
    return DistInfo(env_rank(), world_size, local_rank, device)


def broadcast_object(obj, src: int = 0):
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


class _AllGather(torch.autograd.Function):
    """Forward: concatenate every rank's rows. Backward: each rank gets the sum over ranks of the gradient
    of its own rows (all-reduce then slice, which gloo supports, unlike reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.rows = x.shape[0]
        out = x.new_empty((dist.get_world_size() * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad)
        start = dist.get_rank() * ctx.rows
        return grad[start : start + ctx.rows]


def all_gather_with_grad(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's `x` along dim 0 (equal sizes); gradients flow back to each rank's rows."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return x
    return _AllGather.apply(x)


def all_reduce_mean(x: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        x = x.clone()
        dist.all_reduce(x)
        x /= dist.get_world_size()
    return x


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
