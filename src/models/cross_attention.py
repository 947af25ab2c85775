"""A pre-norm cross-attention block: text hidden states query (sharded) visual features through LV-XAttn
(ring or gather schedule), the Ring baseline, or plain local attention, with optional activation
recomputation (docs/lv_xattn.md).

Recomputation is a custom autograd Function: its forward runs the whole block without recording a graph
and saves only the block's inputs (text, visual) and the attention's (O, LSE). Backward recomputes Q, K, V
from the inputs, back-propagates through the output projection and layer-scale, runs the attention
backward with the saved (O, LSE), then back-propagates into the projections, the norms, the text states
and the visual features. The attention forward itself is never re-run, and no communication is repeated.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from src.config import XAttnImpl
from src.models.transformer import LayerScale
from src.parallel.xattn.comm import ShardLengths, XAttnEngine, XAttnFunction, make_layout
from src.parallel.xattn.lv import LV_XATTN, LV_XATTN_GATHER
from src.parallel.xattn.ring import RING_XATTN

# "local" runs LV-XAttn's single-process path (make_layout's single_process): the same kernels, no communication.
ENGINES = {XAttnImpl.lv_xattn: LV_XATTN, XAttnImpl.lv_xattn_gather: LV_XATTN_GATHER, XAttnImpl.ring: RING_XATTN,
           XAttnImpl.local: LV_XATTN}
T = TypeVar("T")


class CrossAttentionBlock(nn.Module):
    """text + ls(o_proj(attn(q_proj(ln_q(text)), k_proj/v_proj(ln_kv(visual))))).

    impl: "lv_xattn" (queries travel around a ring), "lv_xattn_gather" (LV-XAttn's gather schedule: queries
    all-gathered, one kernel call per pass; the same as "lv_xattn" when q_sharded=False), "ring" (keys/values
    travel) or "local" (attend this rank's visual tokens only: no communication, `group` is ignored).
    kv_heads < heads gives grouped-query attention.

    Gradients: the visual side (`kv_parameters()`) gets only this rank's shard's share on each rank; sum it
    over the group. With q_sharded=False the text side (ln_q, q_proj, o_proj, ls) is complete and identical
    on every rank; with q_sharded=True it is also per-rank and must be summed.
    """

    def __init__(
        self, width: int, heads: int, kv_width: int | None = None, kv_heads: int | None = None,
        ls_init_value: float | None = 0.0, recompute: bool = True, impl: str = "lv_xattn",
    ):
        super().__init__()
        kv_width = width if kv_width is None else kv_width
        kv_heads = heads if kv_heads is None else kv_heads
        if impl not in XAttnImpl.values():
            raise ValueError(f"impl={impl!r} is not one of {', '.join(XAttnImpl.values())}")
        if width % heads:
            raise ValueError(f"width {width} is not divisible by heads {heads}: pick heads that divide it")
        if heads % kv_heads:
            raise ValueError(f"heads {heads} is not a multiple of kv_heads {kv_heads}: pick kv_heads dividing heads")
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, width // heads
        self.recompute, self.impl = recompute, impl
        self.ln_q = nn.LayerNorm(width)
        self.ln_kv = nn.LayerNorm(kv_width)
        self.q_proj = nn.Linear(width, width)
        self.k_proj = nn.Linear(kv_width, kv_heads * self.head_dim)
        self.v_proj = nn.Linear(kv_width, kv_heads * self.head_dim)
        self.o_proj = nn.Linear(width, width)
        self.ls = LayerScale(width, ls_init_value) if ls_init_value is not None else nn.Identity()

    def kv_parameters(self) -> list[nn.Parameter]:
        """The parameters that only see this rank's visual shard (their gradients are per-shard)."""
        return [*self.ln_kv.parameters(), *self.k_proj.parameters(), *self.v_proj.parameters()]

    def queries(self, text: Tensor) -> Tensor:
        batch, length, _ = text.shape
        return self.q_proj(self.ln_q(text)).view(batch, length, self.heads, self.head_dim).transpose(1, 2)

    def keys_values(self, visual: Tensor) -> tuple[Tensor, Tensor]:
        batch, length, _ = visual.shape
        x = self.ln_kv(visual)
        split = (batch, length, self.kv_heads, self.head_dim)
        return self.k_proj(x).view(split).transpose(1, 2), self.v_proj(x).view(split).transpose(1, 2)

    def branch(self, out: Tensor) -> Tensor:
        """The residual branch after attention: merge heads, output projection, layer-scale."""
        batch, _, length, _ = out.shape
        return self.ls(self.o_proj(out.transpose(1, 2).reshape(batch, length, self.heads * self.head_dim)))

    def forward(
        self, text: Tensor, visual: Tensor, group: ProcessGroup | None = None, *, q_sharded: bool = False,
        key_padding_mask: Tensor | None = None, q_segment_ids: Tensor | None = None,
        kv_segment_ids: Tensor | None = None, lengths: ShardLengths | None = None,
    ) -> Tensor:
        """text [B, Lq, width] (all queries, or this rank's block if q_sharded); visual [B, Skv_local, kv_width],
        this rank's shard; masks and `lengths` as in `lv_xattn`. Returns text + ls(o_proj(attention))."""
        if text.dim() != 3 or visual.dim() != 3 or text.shape[0] != visual.shape[0]:
            raise ValueError(f"text {tuple(text.shape)} and visual {tuple(visual.shape)} must be [B, L, width] "
                             "with the same batch size")
        layout_args = dict(
            group=group, q_sharded=q_sharded, key_padding_mask=key_padding_mask, q_segment_ids=q_segment_ids,
            kv_segment_ids=kv_segment_ids, scale=None, counter=ENGINES[self.impl].counter,
            single_process=self.impl == "local", lengths=lengths)
        if self.recompute:
            return _RecomputedCrossAttention.apply(
                text, visual, self, ENGINES[self.impl], layout_args, *self.parameters())
        q = self.queries(text)
        k, v = self.keys_values(visual)
        out = XAttnFunction.apply(q, k, v, ENGINES[self.impl], make_layout(q, k, v, **layout_args))
        return text + self.branch(out)


class _RecomputedCrossAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, text: Tensor, visual: Tensor, block: CrossAttentionBlock, engine: XAttnEngine,
                layout_args: dict, *params: Tensor) -> Tensor:
        device = text.device.type
        ctx.autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
        q = block.queries(text)
        k, v = block.keys_values(visual)
        layout = make_layout(q, k, v, **layout_args)
        out, lse = engine.forward(q, k, v, layout)
        ctx.save_for_backward(text, visual, out, lse)
        ctx.block, ctx.engine, ctx.layout = block, engine, layout
        return text + block.branch(out)

    @staticmethod
    def backward(ctx, grad: Tensor):
        text, visual, out, lse = ctx.saved_tensors
        block, params = ctx.block, tuple(ctx.block.parameters())
        device, dtype, enabled = ctx.autocast
        with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
            text_in, visual_in, out_in = (t.detach().requires_grad_() for t in (text, visual, out))
            branch = block.branch(out_in)
            q = block.queries(text_in)
            k, v = block.keys_values(visual_in)
        grad_params = [p.requires_grad for p in params]
        dout, *branch_grads = _grads([branch], [out_in, *params], [grad], [True, *grad_params])
        dq, dk, dv = ctx.engine.backward(q.detach(), k.detach(), v.detach(), out, lse, dout, ctx.layout)
        needs = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], *grad_params]
        dtext, dvisual, *proj_grads = _grads([q, k, v], [text_in, visual_in, *params], [dq, dk, dv], needs)
        param_grads = [a if b is None else b if a is None else a + b for a, b in zip(branch_grads, proj_grads)]
        dtext = grad if dtext is None else dtext + grad  # the residual
        return (dtext if ctx.needs_input_grad[0] else None), dvisual, None, None, None, *param_grads


def _grads(outputs: list[Tensor], inputs: list[Tensor], grad_outputs: list[Tensor],
           needed: list[bool]) -> list[Tensor | None]:
    """torch.autograd.grad for the `needed` inputs only; None for the others and for unused ones."""
    wanted = [x for x, need in zip(inputs, needed) if need]
    found = iter(torch.autograd.grad(outputs, wanted, grad_outputs, allow_unused=True) if wanted else ())
    return [next(found) if need else None for need in needed]


def saved_activation_bytes(fn: Callable[[], T], exclude: Iterable[Tensor] = ()) -> tuple[T, int]:
    """Run fn() and return (its result, bytes of the distinct storages autograd saved for backward), leaving
    out the storages of `exclude` (pass the parameters: they are not activations)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    saved: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return result, sum(saved.values())
