"""Single-process math shared by every cross-attention implementation, and the reference they are tested against.

One *block* is a query block attending one key/value shard. `block_forward` returns the block's normalized
output `o` and row-wise log-sum-exp `lse`; `merge_partials` combines two such partials exactly; and
`block_backward` takes the *global* output and LSE of the query rows, so that the gradients of every block
sum to the gradients of the full softmax. LV-XAttn, the Ring baseline and the layer's "local" mode all
build on these three functions.

Local kernel:
- CUDA, fp16/bf16, head dim a multiple of 8 up to 256: without a mask, PyTorch's FlashAttention-2 op
  (`aten._scaled_dot_product_flash_attention` and its backward, which handle GQA natively); with a mask,
  the memory-efficient op (`aten._scaled_dot_product_efficient_attention`) with an additive -inf bias,
  K/V repeated to H heads. Both return the LSE in fp32.
- Everything else (CPU, fp32/fp64, odd head dims): a math path in max(input, fp32) precision.

Masks depend only on per-token ids and padding flags, never on local indices, so a block gets the same
mask whichever rank computes it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

NEG_INF = float("-inf")


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulators (O, LSE, dQ, dK, dV) are at least fp32 whatever the input dtype."""
    return torch.promote_types(dtype, torch.float32)


def check_inputs(
    q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, q_segment_ids: Tensor | None,
    kv_segment_ids: Tensor | None,
) -> None:
    """Shape checks with messages that name the bad value and the fix."""
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [B, H, S, D]: transpose to heads first")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape [B, Hkv, Skv, D]")
    (batch, heads, sq, dim), (kbatch, kv_heads, skv, kdim) = q.shape, k.shape
    if (kbatch, kdim) != (batch, dim):
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head dim")
    if heads % kv_heads:
        raise ValueError(f"q has H={heads} heads, not a multiple of k/v's Hkv={kv_heads}: choose H = n·Hkv (GQA)")
    if q.dtype != k.dtype or k.dtype != v.dtype:
        raise ValueError(f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}): cast them to one dtype")
    padding = key_padding_mask
    if padding is not None and (padding.shape != (batch, skv) or padding.dtype != torch.bool):
        raise ValueError(
            f"key_padding_mask is {padding.dtype} {tuple(padding.shape)}, expected bool "
            f"{(batch, skv)} for this rank's keys (True = ignore)")
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("pass both q_segment_ids and kv_segment_ids, or neither")
    if q_segment_ids is not None and (q_segment_ids.shape != (batch, sq) or kv_segment_ids.shape != (batch, skv)):
        raise ValueError(
            f"q_segment_ids {tuple(q_segment_ids.shape)} / kv_segment_ids {tuple(kv_segment_ids.shape)} must be "
            f"{(batch, sq)} / {(batch, skv)}: one id per local query / key")


def visible_keys(q_segment_ids: Tensor | None, kv_segment_ids: Tensor | None,
                 key_padding_mask: Tensor | None) -> Tensor | None:
    """Boolean [B, 1, Sq or 1, Skv] (broadcast over heads), True where a query may attend a key; None = all."""
    visible = None
    if q_segment_ids is not None:
        visible = q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
    if key_padding_mask is not None:
        keep = ~key_padding_mask[:, None, :]
        visible = keep if visible is None else visible & keep
    return None if visible is None else visible[:, None]


def _blocked_rows_to_inf(lse: Tensor) -> Tensor:
    """Rows with no visible key have LSE = -inf; +inf instead makes exp(s - lse) = 0 for them, not NaN."""
    return lse.masked_fill(lse == NEG_INF, float("inf"))


def empty_partial(q: Tensor, sq: int | None = None) -> tuple[Tensor, Tensor]:
    """The merge identity O = 0, LSE = -inf for q's rows, or for `sq` rows of q's batch, heads and dim."""
    batch, heads, length, dim = q.shape
    sq = length if sq is None else sq
    acc = acc_dtype(q.dtype)
    return q.new_zeros((batch, heads, sq, dim), dtype=acc), q.new_full((batch, heads, sq), NEG_INF, dtype=acc)


def merge_partials(o_a: Tensor, lse_a: Tensor, o_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Online-softmax merge of two normalized partials, in the accumulator dtype.

    L = logaddexp(La, Lb) never overflows. The weights exp(La - L) and exp(Lb - L) are computed as
    sigmoid(±(La - Lb)), which needs no subtraction of the (possibly huge) L; where both are -inf the weights
    are 0, so a query row with no visible key so far stays O = 0."""
    acc = acc_dtype(o_a.dtype)
    lse_a, lse_b = lse_a.to(acc), lse_b.to(acc)
    lse = torch.logaddexp(lse_a, lse_b)
    blocked = lse == NEG_INF
    diff = (lse_a - lse_b).masked_fill(blocked, 0.0)
    weight_a, weight_b = (torch.sigmoid(x).masked_fill(blocked, 0.0)[..., None] for x in (diff, -diff))
    return weight_a * o_a.to(acc) + weight_b * o_b.to(acc), lse


def _fused_kernel(q: Tensor) -> bool:
    dim = q.shape[-1]
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and dim % 8 == 0 and dim <= 256


def _repeat_heads(x: Tensor, heads: int) -> Tensor:
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def _sum_head_groups(x: Tensor, kv_heads: int) -> Tensor:
    batch, heads, length, dim = x.shape
    return x.view(batch, kv_heads, heads // kv_heads, length, dim).sum(2)


def _additive_bias(visible: Tensor, q: Tensor) -> Tensor:
    """-inf where blocked, [B, H, Sq, Skv] (stride 0 over heads). The efficient kernel reads the bias in
    rows aligned to 16 elements, so the storage is padded and sliced, as F.scaled_dot_product_attention does."""
    batch, heads, sq, _ = q.shape
    skv = visible.shape[-1]
    storage = q.new_zeros((batch, 1, sq, -(-skv // 16) * 16))[..., :skv]
    return storage.masked_fill_(~visible, NEG_INF).expand(batch, heads, sq, skv)


def _math_scores(q: Tensor, k: Tensor, visible: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    """Scores [B, Hkv, G, Sq, Skv] in the accumulator dtype (GQA by grouping, no K copies), and grouped Q."""
    batch, heads, sq, dim = q.shape
    kv_heads = k.shape[1]
    acc = acc_dtype(q.dtype)
    qg = q.to(acc).reshape(batch, kv_heads, heads // kv_heads, sq, dim)
    scores = qg @ k.to(acc).unsqueeze(2).transpose(-1, -2) * scale
    if visible is not None:
        scores = scores.masked_fill(~visible.unsqueeze(1), NEG_INF)
    return scores, qg


def block_forward(q: Tensor, k: Tensor, v: Tensor, visible: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    """(o [B, H, Sq, D], lse [B, H, Sq]) of q against one K/V shard; rows with no visible key give (0, -inf).
    o is in the kernel's dtype (the input dtype on the fused kernels), lse in fp32 or wider."""
    if q.shape[2] == 0 or k.shape[2] == 0:
        return empty_partial(q)
    batch, heads, sq, dim = q.shape
    if _fused_kernel(q) and visible is None:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)[:2]
        return out, lse
    if _fused_kernel(q):
        bias = _additive_bias(visible, q)
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, _repeat_heads(k, heads), _repeat_heads(v, heads), bias, True, 0.0, False, scale=scale)[:2]
        # Don't rely on the kernel's convention for rows with no visible key: force (0, -inf).
        blocked = ~visible.any(-1)
        return out.masked_fill(blocked[..., None], 0.0), lse[..., :sq].masked_fill(blocked, NEG_INF)
    scores, _ = _math_scores(q, k, visible, scale)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - _blocked_rows_to_inf(lse)[..., None])
    out = probs @ v.to(scores.dtype).unsqueeze(2)
    return out.reshape(batch, heads, sq, dim), lse.reshape(batch, heads, sq)


def block_backward(
    q: Tensor, k: Tensor, v: Tensor, visible: Tensor | None, scale: float, dout: Tensor, out: Tensor, lse: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """This shard's share of (dq, dk, dv), given the *global* output and LSE of the query rows.

    With the global LSE, exp(s - lse) are the true softmax probabilities restricted to this shard, so the
    blocks' dq add up to the full dq, and dk/dv of the shard are exact once all query blocks are added."""
    batch, heads, sq, dim = q.shape
    kv_heads, skv = k.shape[1], k.shape[2]
    if sq == 0 or skv == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    lse = _blocked_rows_to_inf(lse.float() if _fused_kernel(q) else lse.to(acc_dtype(q.dtype)))
    if _fused_kernel(q) and visible is None:
        seed, offset = (q.new_empty(2, dtype=torch.uint64), q.new_empty((), dtype=torch.uint64))
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.contiguous(), None, None, sq, skv, 0.0, False, seed, offset, scale=scale)
    if _fused_kernel(q):
        # The kernel reads the LSE in rows padded to 32, as its forward returns it.
        padded = lse.new_full((batch, heads, -(-sq // 32) * 32), float("inf"))
        padded[..., :sq] = lse
        seed, offset = q.new_zeros((), dtype=torch.long), q.new_zeros((), dtype=torch.long)
        # The kernel reads O with packed heads ([B, S, H, D] memory, as its forward writes it); any other
        # layout gives wrong dQ and dK (measured on an H200).
        packed_out = out.transpose(1, 2).contiguous().transpose(1, 2)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout, q, _repeat_heads(k, heads), _repeat_heads(v, heads), _additive_bias(visible, q), packed_out,
            padded, seed, offset, 0.0, [True, True, True, False], False, scale=scale)
        return dq, _sum_head_groups(dk, kv_heads), _sum_head_groups(dv, kv_heads)
    scores, qg = _math_scores(q, k, visible, scale)
    acc = scores.dtype
    group = heads // kv_heads
    probs = torch.exp(scores - lse.reshape(batch, kv_heads, group, sq)[..., None])
    dout_g = dout.to(acc).reshape(batch, kv_heads, group, sq, dim)
    delta = (dout_g * out.to(acc).reshape(batch, kv_heads, group, sq, dim)).sum(-1, keepdim=True)
    dv = (probs.transpose(-1, -2) @ dout_g).sum(2)
    dscores = probs * (dout_g @ v.to(acc).unsqueeze(2).transpose(-1, -2) - delta)
    dq = (dscores @ k.to(acc).unsqueeze(2)) * scale
    dk = (dscores.transpose(-1, -2) @ qg).sum(2) * scale
    return dq.reshape(batch, heads, sq, dim), dk, dv


def cross_attention_reference(
    q: Tensor, k_global: Tensor, v_global: Tensor, key_padding_mask: Tensor | None = None,
    q_segment_ids: Tensor | None = None, kv_segment_ids: Tensor | None = None, scale: float | None = None,
) -> Tensor:
    """softmax(q·Kᵀ·scale + mask)·V on one process with plain autograd ops; rows with no visible key give 0.

    Deliberately independent of the block kernels and the merge: it materializes the full score matrix."""
    check_inputs(q, k_global, v_global, key_padding_mask, q_segment_ids, kv_segment_ids)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    heads = q.shape[1]
    scores = q @ _repeat_heads(k_global, heads).transpose(-1, -2) * scale
    visible = visible_keys(q_segment_ids, kv_segment_ids, key_padding_mask)
    if visible is None:
        return F.softmax(scores, dim=-1) @ _repeat_heads(v_global, heads)
    any_visible = visible.any(-1, keepdim=True)
    # Rows with no visible key keep finite scores (no NaN in softmax or its gradient) and are zeroed after.
    scores = scores.masked_fill(~visible & any_visible, NEG_INF)
    return (F.softmax(scores, dim=-1) * any_visible) @ _repeat_heads(v_global, heads)
