"""Ring-Attention cross-attention, the baseline LV-XAttn is compared against: the queries stay, the K/V shards
(with their padding masks and segment ids) rotate around the ring.

Forward: each rank merges every shard's partial into its own queries' (O, LSE). Backward: K/V rotate again;
with q_sharded=True the dK/dV accumulators travel with them and return home; with q_sharded=False every
rank already sees all queries, so a shard's dK/dV are complete on its own rank and only dQ needs the other
shards. Same signature, masks and exactness as `lv_xattn`; bytes sent are added to `BYTES_SENT`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from src.parallel.xattn.comm import ByteCounter, ShardLayout, ShardLengths, XAttnEngine, attend, resized, ring_pass
from src.parallel.xattn.core import (
    acc_dtype,
    block_backward,
    block_forward,
    empty_partial,
    merge_partials,
    visible_keys,
)

BYTES_SENT = ByteCounter()


def _own_message(k: Tensor, v: Tensor, layout: ShardLayout) -> list[Tensor]:
    masks = [m for m in (layout.key_padding_mask, layout.kv_segment_ids) if m is not None]
    return [k.contiguous(), v.contiguous(), *masks]


def _message_like(own: list[Tensor], layout: ShardLayout):
    return lambda origin: [resized(t, layout.kv_lens[origin]) for t in own]


def _unpack(message: list[Tensor], layout: ShardLayout) -> tuple[Tensor, Tensor, Tensor | None]:
    k, v, *masks = message
    padding = masks.pop(0) if layout.key_padding_mask is not None else None
    kv_ids = masks.pop(0) if layout.kv_segment_ids is not None else None
    return k, v, visible_keys(layout.q_segment_ids, kv_ids, padding)


def _forward(q: Tensor, k: Tensor, v: Tensor, layout: ShardLayout) -> tuple[Tensor, Tensor]:
    state = list(empty_partial(q))

    def compute(origin: int, message: list[Tensor]) -> list[Tensor]:
        k_j, v_j, visible = _unpack(message, layout)
        state[:] = merge_partials(*state, *block_forward(q, k_j, v_j, visible, layout.scale))
        return []  # the accumulator stays with the queries

    own = _own_message(k, v, layout)
    ring_pass(layout, "forward", own, _message_like(own, layout), compute, initial=lambda origin: [],
              merge=lambda a, b: [])
    out, lse = state
    return out.to(q.dtype), lse


def _backward(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, layout: ShardLayout,
) -> tuple[Tensor, Tensor, Tensor]:
    acc = acc_dtype(q.dtype)
    dq_sum = torch.zeros_like(q, dtype=acc)
    own_dkv: list[Tensor] = []

    def compute(origin: int, message: list[Tensor]) -> list[Tensor]:
        k_j, v_j, visible = _unpack(message, layout)
        dq, dk, dv = block_backward(q, k_j, v_j, visible, layout.scale, dout, out, lse)
        dq_sum.add_(dq)
        if layout.q_sharded:
            return [dk.to(acc), dv.to(acc)]
        if origin == layout.rank:
            own_dkv.extend((dk, dv))
        return []

    def initial(origin: int) -> list[Tensor]:
        shape = (*k.shape[:2], layout.kv_lens[origin], k.shape[3])
        return [k.new_zeros(shape, dtype=acc), k.new_zeros(shape, dtype=acc)] if layout.q_sharded else []

    own = _own_message(k, v, layout)
    dkv = ring_pass(layout, "backward", own, _message_like(own, layout), compute, initial,
                    merge=lambda a, b: [x + y for x, y in zip(a, b)])
    dk, dv = dkv if layout.q_sharded else own_dkv
    return dq_sum.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


RING_XATTN = XAttnEngine("ring", _forward, _backward, BYTES_SENT)


def ring_xattn(
    q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup | None = None, *, q_sharded: bool = True,
    key_padding_mask: Tensor | None = None, q_segment_ids: Tensor | None = None,
    kv_segment_ids: Tensor | None = None, scale: float | None = None, lengths: ShardLengths | None = None,
) -> Tensor:
    """Same contract as `src.parallel.xattn.lv.lv_xattn`, computed by rotating K/V instead of Q."""
    return attend(RING_XATTN, q, k, v, group, q_sharded=q_sharded, key_padding_mask=key_padding_mask,
                  q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, scale=scale, lengths=lengths)
