"""A tensor passed round the ranks of a group, with gradient: each rank sees every other rank's tensor once,
holding at most two at a time, never the gathered whole (SigLIP's chunked loss, src/trainer/siglip_loss.py).

Each round is one neighbour exchange (torch.distributed P2P, `batch_isend_irecv`). As in OpenCLIP's `bidir`
form, tensors travel both ways round the ring at once, so W ranks need ceil((W - 1) / 2) rounds, not W - 1. The
backward of an exchange sends each gradient back the way its tensor came, so a rank's tensor receives the
gradients that every other rank's loss gives it (summed by autograd), as an all-gather's backward does."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist


def _exchange(sends: list[tuple[torch.Tensor, int]], sources: list[int], group: dist.ProcessGroup | None,
              ) -> list[torch.Tensor]:
    """Send each (tensor, group rank) and receive one tensor, shaped like the first sent, from each source."""
    to_global = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    received = [torch.empty_like(sends[0][0]) for _ in sources]
    ops = [dist.P2POp(dist.isend, tensor.contiguous(), to_global(peer), group=group) for tensor, peer in sends]
    ops += [dist.P2POp(dist.irecv, buffer, to_global(peer), group=group) for buffer, peer in zip(received, sources)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return received


class _Shift(torch.autograd.Function):
    """Forward: send `x` to `to_rank`, receive from `from_rank`. Backward: the reverse."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, from_rank: int, to_rank: int, group: dist.ProcessGroup | None):
        ctx.from_rank, ctx.to_rank, ctx.group = from_rank, to_rank, group
        return _exchange([(x, to_rank)], [from_rank], group)[0]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange([(grad, ctx.from_rank)], [ctx.to_rank], ctx.group)[0], None, None, None


class _ShiftBothWays(torch.autograd.Function):
    """Forward: send `to_left` to the left neighbour and `to_right` to the right one; returns what came from the
    left and from the right. Backward: each gradient goes back to the neighbour its tensor came from."""

    @staticmethod
    def forward(ctx, to_left: torch.Tensor, to_right: torch.Tensor, left: int, right: int,
                group: dist.ProcessGroup | None):
        ctx.left, ctx.right, ctx.group = left, right, group
        from_left, from_right = _exchange([(to_left, left), (to_right, right)], [left, right], group)
        return from_left, from_right

    @staticmethod
    def backward(ctx, grad_from_left: torch.Tensor, grad_from_right: torch.Tensor):
        grad_to_left, grad_to_right = _exchange(
            [(grad_from_left, ctx.left), (grad_from_right, ctx.right)], [ctx.left, ctx.right], ctx.group)
        return grad_to_left, grad_to_right, None, None, None


def ring_pass(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> Iterator[torch.Tensor]:
    """Yield the `x` of every other rank of `group` (default: all ranks) once each, with gradient; all ranks'
    tensors must have one shape. Yields nothing on a single process. Every rank must consume the whole iterator
    (each step is a collective), and then run its backward."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    left, right = (rank - 1) % world, (rank + 1) % world
    to_left = to_right = x
    rounds, odd_one = divmod(world - 1, 2)
    for _ in range(rounds):
        # Round k brings the tensors of the ranks k to the left and k to the right.
        from_left, from_right = _ShiftBothWays.apply(to_left, to_right, left, right, group)
        yield from_left
        yield from_right
        to_left, to_right = from_right, from_left
    if odd_one:  # an even world: the rank opposite, the same distance both ways, comes once, from the left
        yield _Shift.apply(to_right, left, right, group)
