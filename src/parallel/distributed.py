"""Process-group setup and the collectives the trainer needs; every function also works on one process."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.rendezvous import rendezvous

# Control flags (a stop was requested, a checkpoint write failed) are agreed on over gloo, on the CPU, even
# when training runs on NCCL: agreeing on them then never waits for the GPU. None: the default group (gloo).
_flag_group = None


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
        timeout = timedelta(minutes=30)
        store, rank, world_size = next(rendezvous("env://", timeout=timeout))
        # torchrun keeps one store across the restarts of a group (--max-restarts): without a prefix of its own,
        # a restarted group reads the dead group's addresses from it and cannot connect.
        store = dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        if backend == "nccl":
            global _flag_group
            _flag_group = dist.new_group(backend="gloo")
    return DistInfo(env_rank(), world_size, local_rank, device)


def free_port() -> int:
    """A TCP port that nothing on this machine listens on, for the rendezvous of ranks started on one host."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def broadcast_object(obj, src: int = 0):
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is true on any rank; also a barrier. One all-reduce of a CPU integer."""
    if not dist.is_initialized():
        return flag
    box = torch.tensor([int(flag)])
    dist.all_reduce(box, op=dist.ReduceOp.MAX, group=_flag_group)
    return bool(box.item())


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


class _AllGather(torch.autograd.Function):
    """Forward: concatenate every rank's rows. Backward: each rank gets the sum over ranks of the gradient
    of its own rows (all-reduce then slice, which gloo supports, unlike reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.rows, ctx.group = x.shape[0], group
        out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        start = dist.get_rank(ctx.group) * ctx.rows
        return grad[start : start + ctx.rows], None


def all_gather_with_grad(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Concatenate the `x` of every rank of `group` (default: all ranks) along dim 0 (equal sizes); gradients
    flow back to each rank's rows."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return x
    return _AllGather.apply(x, group)


class _AllReduce(torch.autograd.Function):
    """Sum over the ranks of `group`. Backward sums every rank's gradient of the result, the exact adjoint, so
    gradients stay exact when each rank computes its own copy of the loss (docs/video.md, "Parallelism")."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def all_reduce_with_grad(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The sum of the `x` of every rank of `group`, with gradient; `x` itself for None (a single process, as
    in `Mesh`)."""
    return x if group is None else _AllReduce.apply(x, group)


def all_gather_columns(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Concatenate the `x` of every rank of `group` along dim 1, without gradient; the ranks' column counts may
    differ. `x` itself for None (a single process, as in `Mesh`) or a group of one."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    # Shares may differ in size, which the tensor collectives do not allow: they travel as objects.
    shares: list[torch.Tensor] = [None] * dist.get_world_size(group)
    dist.all_gather_object(shares, x, group=group)
    return torch.cat(shares, dim=1)


def all_gather_rows(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Concatenate the `x` of every rank of `group` (default: all ranks) along dim 0, without gradient; the ranks'
    row counts may differ (each is padded to the largest for the collective)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return x
    world = dist.get_world_size(group)
    count = torch.tensor([x.shape[0]], device=x.device)
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    rows = [int(c) for c in counts]
    padded = x.new_zeros((max(rows), *x.shape[1:]))
    padded[: x.shape[0]] = x
    shares = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(shares, padded, group=group)
    return torch.cat([share[:n] for share, n in zip(shares, rows)])


def all_reduce_mean(x: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        x = x.clone()
        dist.all_reduce(x)
        x /= dist.get_world_size()
    return x


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
