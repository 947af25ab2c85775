"""LV-XAttn: exact distributed cross-attention that keeps each rank's keys/values local and moves the
(small) query blocks instead (docs/lv_xattn.md).

q_sharded=True, schedule="ring" (the paper's): rank j's query block Q_j circulates; each rank adds its K/V
shard's partial (o, lse) to Q_j's travelling accumulator with the log-sum-exp merge, and the accumulator
returns home after P-1 hops. Backward circulates (Q, dO, O, LSE); dQ accumulates on the way and returns home,
dK and dV never leave their rank. Transfers overlap the P per-block kernel calls.

q_sharded=True, schedule="gather": every rank all-gathers the query blocks and runs ONE kernel call of all
queries against its K/V shard; the partials are merged exactly by an all-reduce of the LSEs' max and a
reduce-scatter of the rescaled outputs, which leaves each rank only its own rows. Backward all-gathers
(Q, dO, O, LSE), runs one backward call (dK, dV final) and reduce-scatters dQ. Nothing overlaps, but each
pass is one full-size kernel, as in the local computation, instead of P smaller ones.

q_sharded=False (e.g. 77 CLIP text tokens on every rank): each rank attends its shard, then two all-reduces
(the max of the LSEs, then the sum of the rescaled outputs with their weights) give the exact result.
Backward: each rank's dQ share is all-reduced; dK and dV are local. Every rank must back-propagate the same
dO, as it does when the loss is computed identically on every rank.

Bytes sent by this process are added to `BYTES_SENT` (forward and backward).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from src.parallel.xattn.comm import ByteCounter, ShardLayout, ShardLengths, XAttnEngine, attend, resized, ring_pass
from src.parallel.xattn.core import (
    NEG_INF,
    acc_dtype,
    block_backward,
    block_forward,
    empty_partial,
    merge_partials,
    visible_keys,
)

BYTES_SENT = ByteCounter()


def _ids(layout: ShardLayout) -> list[Tensor]:
    return [] if layout.q_segment_ids is None else [layout.q_segment_ids]


def _visible(layout: ShardLayout, message: list[Tensor], position: int) -> Tensor | None:
    """Mask of a query block (its ids travel at `position` of the message) against this rank's keys."""
    q_ids = message[position] if layout.q_segment_ids is not None else None
    return visible_keys(q_ids, layout.kv_segment_ids, layout.key_padding_mask)


def _cross_rank_merge(out: Tensor, lse: Tensor, layout: ShardLayout, scatter: bool) -> tuple[Tensor, Tensor]:
    """Exact merge of every rank's partial for the same queries: shift by the global max LSE (so nothing
    overflows), sum the weighted outputs and weights, renormalize. Rows no rank can see stay (0, -inf).
    The sums are all-reduced, or with `scatter` (out, lse cover the gathered queries of all ranks)
    reduce-scattered so that each rank receives only its own rows. The weights have the LSE's dtype
    (acc_dtype), so the products and sums are in it whatever out's dtype."""
    shift = layout.all_reduce(lse.clone(), "forward", dist.ReduceOp.MAX)
    shift = shift.masked_fill(shift == NEG_INF, 0.0)
    weight = torch.exp(lse - shift)[..., None]
    packed = torch.cat([out * weight, weight], dim=-1)
    if scatter:
        packed, shift = layout.reduce_scatter_queries(packed, "forward"), shift[..., layout.own_rows()]
    else:
        packed = layout.all_reduce(packed, "forward")
    total = packed[..., -1:]
    merged = torch.where(total > 0, packed[..., :-1] / total, 0.0)
    return merged, shift + torch.log(total[..., 0])


def _forward(q: Tensor, k: Tensor, v: Tensor, layout: ShardLayout) -> tuple[Tensor, Tensor]:
    if not layout.q_sharded:
        visible = visible_keys(layout.q_segment_ids, layout.kv_segment_ids, layout.key_padding_mask)
        out, lse = merge_partials(*empty_partial(q), *block_forward(q, k, v, visible, layout.scale))
        out, lse = _cross_rank_merge(out, lse, layout, scatter=False)
        return out.to(q.dtype), lse

    def compute(origin: int, message: list[Tensor]) -> list[Tensor]:
        return list(block_forward(message[0], k, v, _visible(layout, message, 1), layout.scale))

    own = [q.contiguous(), *_ids(layout)]
    out, lse = ring_pass(
        layout, "forward", own,
        message_like=lambda origin: [resized(t, layout.q_lens[origin]) for t in own],
        compute=compute,
        initial=lambda origin: list(empty_partial(q, layout.q_lens[origin])),
        merge=lambda a, b: list(merge_partials(*a, *b)))
    return out.to(q.dtype), lse


def _backward(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, layout: ShardLayout,
) -> tuple[Tensor, Tensor, Tensor]:
    acc = acc_dtype(q.dtype)
    if not layout.q_sharded:
        visible = visible_keys(layout.q_segment_ids, layout.kv_segment_ids, layout.key_padding_mask)
        dq, dk, dv = block_backward(q, k, v, visible, layout.scale, dout, out, lse)
        dq = layout.all_reduce(dq.to(acc).contiguous(), "backward")
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    # dK and dV are the size of the whole local shard, so their sums cost memory traffic at every step: the
    # first term is taken as it is, and with two ranks (two terms) the one add rounds once in the input dtype,
    # exactly as a float32 sum cast back would.
    sums: list[Tensor] = []

    def compute(origin: int, message: list[Tensor]) -> list[Tensor]:
        q_j, dout_j, out_j, lse_j = message[:4]
        dq, dk, dv = block_backward(q_j, k, v, _visible(layout, message, 4), layout.scale, dout_j, out_j, lse_j)
        if not sums:
            sums.extend((dk, dv) if layout.world <= 2 else (dk.to(acc), dv.to(acc)))
        else:
            sums[0].add_(dk)
            sums[1].add_(dv)
        return [dq.to(acc)]

    own = [q.contiguous(), dout, out, lse, *_ids(layout)]
    (dq,) = ring_pass(
        layout, "backward", own,
        message_like=lambda origin: [resized(t, layout.q_lens[origin]) for t in own],
        compute=compute,
        initial=lambda origin: [q.new_zeros((q.shape[0], q.shape[1], layout.q_lens[origin], q.shape[3]), dtype=acc)],
        merge=lambda a, b: [a[0] + b[0]])
    return dq.to(q.dtype), sums[0].to(k.dtype), sums[1].to(v.dtype)


def _gather_forward(q: Tensor, k: Tensor, v: Tensor, layout: ShardLayout) -> tuple[Tensor, Tensor]:
    if not layout.q_sharded:  # the queries are on every rank already: nothing to gather
        return _forward(q, k, v, layout)
    q_all, *ids = layout.all_gather_queries([q, *_ids(layout)], "forward")
    visible = visible_keys(ids[0] if ids else None, layout.kv_segment_ids, layout.key_padding_mask)
    out, lse = _cross_rank_merge(*block_forward(q_all, k, v, visible, layout.scale), layout, scatter=True)
    return out.to(q.dtype), lse


def _gather_backward(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, layout: ShardLayout,
) -> tuple[Tensor, Tensor, Tensor]:
    if not layout.q_sharded:
        return _backward(q, k, v, out, lse, dout, layout)
    q_all, dout_all, out_all, lse_all, *ids = layout.all_gather_queries([q, dout, out, lse, *_ids(layout)], "backward")
    visible = visible_keys(ids[0] if ids else None, layout.kv_segment_ids, layout.key_padding_mask)
    dq, dk, dv = block_backward(q_all, k, v, visible, layout.scale, dout_all, out_all, lse_all)
    dq = layout.reduce_scatter_queries(dq.to(acc_dtype(q.dtype)), "backward")
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


LV_XATTN = XAttnEngine("lv_xattn", _forward, _backward, BYTES_SENT)
LV_XATTN_GATHER = XAttnEngine("lv_xattn_gather", _gather_forward, _gather_backward, BYTES_SENT)
SCHEDULES = {"ring": LV_XATTN, "gather": LV_XATTN_GATHER}


def lv_xattn(
    q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup | None = None, *, q_sharded: bool = True,
    key_padding_mask: Tensor | None = None, q_segment_ids: Tensor | None = None,
    kv_segment_ids: Tensor | None = None, scale: float | None = None, schedule: str = "ring",
    lengths: ShardLengths | None = None,
) -> Tensor:
    """Exact softmax(q·K_globalᵀ·scale + mask)·V_global for this rank's queries.

    q [B, H, Sq_local, D]; k, v [B, Hkv, Skv_local, D], this rank's contiguous shard of the global keys (the
    shards in rank order); H a multiple of Hkv. Shards may differ in length, including zero.
    key_padding_mask [B, Skv_local] (True = ignore); q_segment_ids [B, Sq_local] and kv_segment_ids
    [B, Skv_local] let a query see only keys of its own segment. Rows with no visible key return zeros.
    group=None uses the default group, or runs on one process when torch.distributed is not initialized.
    schedule (q_sharded=True): "ring" overlaps the transfers with P kernel calls on S_Q/P queries each;
    "gather" runs one kernel call on all queries between collectives, with nothing overlapped
    (docs/lv_xattn.md, "Two schedules"). With q_sharded=False both are the all-reduce merge.
    lengths: every rank's shard lengths from `shard_lengths`, to skip the per-call shape exchange and its host
    synchronisation when several calls share them.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not one of {sorted(SCHEDULES)}")
    return attend(SCHEDULES[schedule], q, k, v, group, q_sharded=q_sharded, key_padding_mask=key_padding_mask,
                  q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, scale=scale, lengths=lengths)
