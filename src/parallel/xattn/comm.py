"""The distributed plumbing shared by LV-XAttn and the Ring baseline: who holds what, the ring pass, byte
counting, and the autograd wrapper around an implementation's forward/backward pair."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from src.parallel.xattn.core import check_inputs

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# One row per rank of the shape exchange; a mismatch in any field but the two lengths is an error.
FIELDS = ("Sq_local", "Skv_local", "B", "H", "Hkv", "D", "dtype", "key_padding_mask", "segment_ids")

# PyTorch 2.14 renamed these (and deprecated the old names); earlier releases know only the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class ByteCounter:
    """Payload bytes this process sent, by pass. Point-to-point sends count their tensor bytes; collectives
    count what their ring algorithm sends per rank: 2·(P-1)·n/P for an all-reduce of n bytes, (P-1)·c for an
    all-gather of c bytes per rank and for a reduce-scatter that leaves c bytes on each rank (an all-reduce
    is the two in turn, at c = n/P). Shape and length exchanges (a few int64 per rank) are not counted."""

    forward: int = 0
    backward: int = 0

    def reset(self) -> None:
        self.forward = self.backward = 0

    def add(self, phase: str, nbytes: int) -> None:
        setattr(self, phase, getattr(self, phase) + nbytes)


@dataclass
class ShardLayout:
    """One call's view of the group: this rank, the per-rank query and key lengths, and the masks."""

    group: dist.ProcessGroup | None
    rank: int
    world: int
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    q_sharded: bool
    scale: float
    counter: ByteCounter
    key_padding_mask: Tensor | None = None
    q_segment_ids: Tensor | None = None
    kv_segment_ids: Tensor | None = None

    def peer(self, offset: int) -> int:
        """Global rank of the group member `offset` places after this one on the ring."""
        group_rank = (self.rank + offset) % self.world
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def all_reduce(self, x: Tensor, phase: str, op: dist.ReduceOp = dist.ReduceOp.SUM) -> Tensor:
        if self.world > 1:
            self.counter.add(phase, 2 * (self.world - 1) * x.numel() * x.element_size() // self.world)
            dist.all_reduce(x, op=op, group=self.group)
        return x

    def all_gather_queries(self, tensors: list[Tensor], phase: str) -> list[Tensor]:
        """Every rank's query-side tensors ([B, H, Sq_local, ...], or [B, Sq_local] ids), concatenated in rank
        order on the sequence dim: [B, H, Sq_global, ...] / [B, Sq_global].

        The collective needs equal blocks, so each rank sends its rows padded to the longest shard, sequence
        dim first; the padding is dropped on arrival. The results are contiguous again, the layout the local
        kernels receive from the ring (some fused kernels are particular about strides)."""
        if self.world == 1:
            return tensors
        longest, index = max(self.q_lens), self._real_rows(tensors[0].device)
        gathered = []
        for x in tensors:
            dim = _seq_dim(x)
            rows = x.movedim(dim, 0)
            send = rows.new_zeros((longest, *rows.shape[1:]))
            send[: rows.shape[0]] = rows
            receive = send.new_empty((self.world * longest, *send.shape[1:]))
            if send.numel():  # every rank knows every shape, so all of them skip together
                self.counter.add(phase, (self.world - 1) * send.numel() * send.element_size())
                _all_gather_single(receive, send, group=self.group)
            gathered.append((receive if index is None else receive[index]).movedim(0, dim).contiguous())
        return gathered

    def reduce_scatter_queries(self, x: Tensor, phase: str) -> Tensor:
        """x [B, H, Sq_global, ...] holds this rank's term for every global query row; returns the sum over
        the ranks of this rank's rows, [B, H, Sq_local, ...]. Padded to the longest shard, as
        `all_gather_queries` is."""
        if self.world == 1:
            return x
        longest, index = max(self.q_lens), self._real_rows(x.device)
        rows = x.movedim(2, 0)
        if index is None:
            padded = rows.contiguous()
        else:
            padded = rows.new_zeros((self.world * longest, *rows.shape[1:]))
            padded[index] = rows
        mine = padded.new_empty((longest, *rows.shape[1:]))
        if mine.numel():
            self.counter.add(phase, (self.world - 1) * mine.numel() * mine.element_size())
            _reduce_scatter_single(mine, padded, group=self.group)
        return mine[: self.q_lens[self.rank]].movedim(0, 2)

    def own_rows(self) -> slice:
        """This rank's query rows within the global sequence of `all_gather_queries`."""
        start = sum(self.q_lens[: self.rank])
        return slice(start, start + self.q_lens[self.rank])

    def _real_rows(self, device: torch.device) -> Tensor | None:
        """Positions of the real rows among the P padded blocks of max(q_lens) rows; None when none is padded."""
        longest = max(self.q_lens)
        if all(n == longest for n in self.q_lens):
            return None
        return torch.cat([torch.arange(j * longest, j * longest + n, device=device) for j, n in enumerate(self.q_lens)])


@dataclass(frozen=True)
class ShardLengths:
    """Every rank's local query and key lengths, in group rank order."""

    q: tuple[int, ...]
    kv: tuple[int, ...]


def shard_lengths(sq_local: int, skv_local: int, device: torch.device,
                  group: dist.ProcessGroup | None = None) -> ShardLengths:
    """Exchange this rank's query and key lengths with the group (on `device`, which the group's backend must
    reach): one small all-gather and one host synchronisation. Compute them once and pass them as `lengths=`
    to every cross-attention call that shares them (the layers of a head), so those calls neither exchange
    shapes nor wait for the GPU."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world == 1:
        return ShardLengths((sq_local,), (skv_local,))
    mine = torch.tensor([sq_local, skv_local], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    rows = torch.stack(gathered).tolist()
    return ShardLengths(tuple(r[0] for r in rows), tuple(r[1] for r in rows))


def make_layout(
    q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup | None, *, q_sharded: bool,
    key_padding_mask: Tensor | None, q_segment_ids: Tensor | None, kv_segment_ids: Tensor | None,
    scale: float | None, counter: ByteCounter, single_process: bool = False, lengths: ShardLengths | None = None,
) -> ShardLayout:
    """Validate the local inputs and learn every rank's shard lengths, so that receive buffers can be sized for
    uneven and empty shards. Without `lengths`, every rank's full shape is exchanged (one small all-gather and
    a host synchronisation), and a mismatch in any other field fails loudly instead of hanging. With
    `lengths` (from `shard_lengths`) nothing is exchanged: the lengths are checked against this rank's
    tensors, and the caller vouches that the ranks agree on batch, heads, head dim, dtype and masks."""
    check_inputs(q, k, v, key_padding_mask, q_segment_ids, kv_segment_ids)
    if q.dtype not in DTYPES:
        raise ValueError(f"q dtype {q.dtype} is not one of {DTYPES}")
    batch, heads, sq, dim = q.shape
    kv_heads, skv = k.shape[1], k.shape[2]
    mine = [sq, skv, batch, heads, kv_heads, dim, DTYPES.index(q.dtype), key_padding_mask is not None,
            q_segment_ids is not None]
    if single_process or not dist.is_initialized():
        rank, world, rows = 0, 1, [mine]
    elif lengths is not None:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        if len(lengths.q) != world or len(lengths.kv) != world:
            raise ValueError(f"lengths {lengths} name {len(lengths.q)} ranks but the group has {world}: "
                             "compute them with shard_lengths() on the same group")
        if (lengths.q[rank], lengths.kv[rank]) != (sq, skv):
            raise ValueError(f"lengths say rank {rank} holds {lengths.q[rank]} queries and {lengths.kv[rank]} "
                             f"keys, but it holds {sq} and {skv}: recompute them with shard_lengths()")
        rows = [[a, b, *mine[2:]] for a, b in zip(lengths.q, lengths.kv)]
    else:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        gathered = [q.new_empty(len(mine), dtype=torch.int64) for _ in range(world)]
        dist.all_gather(gathered, torch.tensor(mine, dtype=torch.int64, device=q.device), group=group)
        rows = torch.stack(gathered).tolist()
    for other, row in enumerate(rows):
        for name, a, b in zip(FIELDS[2:], row[2:], mine[2:]):
            if a != b:
                raise ValueError(f"rank {other} has {name}={a} but rank {rank} has {b}: all ranks must agree")
        if not q_sharded and row[0] != sq:
            raise ValueError(f"q_sharded=False needs the same queries on every rank, but rank {other} has "
                             f"Sq_local={row[0]} and rank {rank} has {sq}: pass q_sharded=True for sharded queries")
    # The masks travel (point-to-point or gathered), and gloo and NCCL send only contiguous tensors; a caller's
    # masks are often views (a slice of a batch's mask), so they are made contiguous here, once per call.
    return ShardLayout(
        group, rank, world, tuple(r[0] for r in rows), tuple(r[1] for r in rows), q_sharded,
        dim ** -0.5 if scale is None else scale, counter, _contiguous(key_padding_mask),
        _contiguous(q_segment_ids, torch.long), _contiguous(kv_segment_ids, torch.long))


def _contiguous(x: Tensor | None, dtype: torch.dtype | None = None) -> Tensor | None:
    return None if x is None else x.to(dtype or x.dtype).contiguous()


def ring_pass(
    layout: ShardLayout, phase: str, own_message: list[Tensor], message_like: Callable[[int], list[Tensor]],
    compute: Callable[[int, list[Tensor]], list[Tensor]], initial: Callable[[int], list[Tensor]],
    merge: Callable[[list[Tensor], list[Tensor]], list[Tensor]],
) -> list[Tensor]:
    """Circulate every rank's `own_message` once around the ring; return the accumulator of this rank's own
    message after all P ranks have contributed.

    At step t this rank holds the message of rank j = rank - t and computes `compute(j, message)`, a partial
    result merged into j's travelling accumulator. Rank j's accumulator starts as `initial(j)` on rank j+1,
    picks up one partial per rank, and returns home, where j's own step-0 partial is merged last. Each step
    posts, in one batch_isend_irecv and before the local compute, the transfers it needs next: the
    accumulator merged at the previous step out, the incoming one for this step, and the message for the next
    step in. The block being computed on and the block arriving are separate buffers (double buffering); a
    buffer is reused only after its transfer has completed. `compute` may return [] (nothing travels,
    e.g. the Ring forward, whose accumulator stays on the rank that owns the queries)."""
    world, rank = layout.world, layout.rank
    if world == 1:
        return merge(initial(rank), compute(rank, own_message))
    nxt, prv = layout.peer(1), layout.peer(-1)
    message, outgoing, own_partial = own_message, [], []
    for step in range(world):
        origin = (rank - step) % world
        last = step == world - 1
        incoming = initial(origin) if step >= 2 else []  # receive buffers: step 1 starts j's accumulator
        next_message = [] if last else message_like((origin - 1) % world)
        pending = _post(layout, phase, nxt, prv, outgoing + ([] if last else message), incoming + next_message)
        partial = compute(origin, message)
        _wait(pending)
        if step == 0:
            own_partial = partial
        else:
            outgoing = merge(incoming if step >= 2 else initial(origin), partial)
        message = next_message
    home = initial(rank)
    _wait(_post(layout, phase, nxt, prv, outgoing, home))
    return merge(home, own_partial)


def resized(x: Tensor, length: int) -> Tensor:
    """An empty receive buffer like x with `length` positions on its sequence dim: dim 2 of [B, H, S, D] and
    [B, H, S], dim 1 of [B, S] masks and ids."""
    shape = list(x.shape)
    shape[_seq_dim(x)] = length
    return x.new_empty(shape)


def _seq_dim(x: Tensor) -> int:
    return 2 if x.dim() > 2 else 1


def _post(layout: ShardLayout, phase: str, nxt: int, prv: int, sends: list[Tensor], receives: list[Tensor]):
    # Empty tensors are skipped on both sides: both know every shard's length, so the pairing still matches.
    ops = [dist.P2POp(dist.isend, t, nxt, layout.group) for t in sends if t.numel()]
    ops += [dist.P2POp(dist.irecv, t, prv, layout.group) for t in receives if t.numel()]
    layout.counter.add(phase, sum(t.numel() * t.element_size() for t in sends if t.numel()))
    return dist.batch_isend_irecv(ops) if ops else []


def _wait(works) -> None:
    for work in works:
        work.wait()


@dataclass(frozen=True)
class XAttnEngine:
    """An implementation: forward_impl(q, k, v, layout) -> (out in q's dtype, lse in fp32+) and
    backward_impl(q, k, v, out, lse, dout, layout) -> (dq, dk, dv); bytes sent go to `counter`."""

    name: str
    forward_impl: Callable[[Tensor, Tensor, Tensor, ShardLayout], tuple[Tensor, Tensor]]
    backward_impl: Callable[..., tuple[Tensor, Tensor, Tensor]]
    counter: ByteCounter

    # Autocast is switched off inside: the kernels pick their own precision (fp32+ accumulation).
    def forward(self, q: Tensor, k: Tensor, v: Tensor, layout: ShardLayout) -> tuple[Tensor, Tensor]:
        with torch.autocast(q.device.type, enabled=False):
            return self.forward_impl(q, k, v, layout)

    def backward(
        self, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, layout: ShardLayout,
    ) -> tuple[Tensor, Tensor, Tensor]:
        with torch.autocast(q.device.type, enabled=False):
            return self.backward_impl(q, k, v, out, lse, dout.to(q.dtype).contiguous(), layout)


class XAttnFunction(torch.autograd.Function):
    """Saves q, k, v and (out, lse); backward hands them to the engine."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, engine: XAttnEngine, layout: ShardLayout) -> Tensor:
        out, lse = engine.forward(q, k, v, layout)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.engine, ctx.layout = engine, layout
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.engine.backward(q, k, v, out, lse, dout, ctx.layout)
        return dq, dk, dv, None, None


def attend(
    engine: XAttnEngine, q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup | None, *, q_sharded: bool,
    key_padding_mask: Tensor | None, q_segment_ids: Tensor | None, kv_segment_ids: Tensor | None,
    scale: float | None, lengths: ShardLengths | None,
) -> Tensor:
    layout = make_layout(
        q, k, v, group, q_sharded=q_sharded, key_padding_mask=key_padding_mask, q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids, scale=scale, counter=engine.counter, lengths=lengths)
    return XAttnFunction.apply(q, k, v, engine, layout)
