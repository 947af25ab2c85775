"""Self-attention for short sequences (at most 128 tokens: ViT-B/32's 50 patches, every text tower's 77
tokens) as one Triton program per (sample, head) that holds the whole sequence, reading the fused QKV
projection's output and writing the gradient of that output directly.

Why: at these lengths the generic SDPA kernels (cuDNN, flash) tile for long sequences and run far below the
GPU's memory bandwidth, and their gradients come back as three tensors that the QKV projection's backward
then copies into one. Here a sequence fits one tile, so the forward pass is one read of Q, K, V and one write
of the output, and the backward pass one read of Q, K, V, O, dO and one write of dQKV: no split softmax, no
atomics, no copies. The arithmetic is FlashAttention's (fp32 scores and softmax, 16-bit probabilities into
the second matmul, the backward pass recomputing P from the saved log-sum-exp).

`model.attention_backend=auto` (the default) takes it wherever it applies: on a CUDA GPU, with 16-bit
activations (bf16 or fp16 autocast), for sequences of at most 128 tokens; elsewhere PyTorch picks an SDPA
kernel. `triton_short` asks for it explicitly, and fails with the reason where it cannot run (CI runs it on
CPU tensors through Triton's interpreter). A pair of torch.library custom ops, so torch.compile keeps a block
in one graph around it.
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

from src.triton_interpreter import interpreting

MAX_LENGTH = 128  # the longest sequence the kernel takes: its one tile, and the rows of its saved statistics
# The longest sequence `auto` gives it; longer ones go to tiled_attention.py's kernel. On an H200 this kernel beat
# cuDNN's on CLIP's towers of 50 and 77 tokens (docs/BENCHMARKS.md, session 6). The tiled kernel, which would take 77
# causal tokens as 64 + 16 rows rather than one tile of 128, has not been timed there:
# `bench/throughput.py --set "py:src.models.short_attention.AUTO_MAX_LENGTH=64"` would.
AUTO_MAX_LENGTH = MAX_LENGTH


def kernel_unsupported_reason(qkv: torch.Tensor, heads: int) -> str | None:
    """Why our Triton attention kernels (this one-tile kernel and tiled_attention's) cannot run on `qkv`,
    whatever its length (with the fix), or None where they can."""
    head_dim = qkv.shape[-1] // 3 // heads
    if triton is None:
        return "it needs Triton (installed with PyTorch's CUDA wheels on Linux): install triton"
    if qkv.device.type != "cuda" and not interpreting():
        return f"it needs a CUDA GPU, but the model is on {qkv.device}"
    if qkv.dtype not in (torch.bfloat16, torch.float16):
        return (f"it needs bf16 or fp16 activations, got {qkv.dtype}: train under autocast "
                "(trainer.precision=bf16 or fp16)")
    if not 16 <= head_dim <= 128:
        return f"it needs a head size of 16 to 128, got {head_dim}"
    return None


def unsupported_reason(qkv: torch.Tensor, heads: int) -> str | None:
    """Why this kernel cannot run on `qkv` (with the fix), or None where it can."""
    if qkv.shape[1] > MAX_LENGTH:
        return f"it takes sequences of at most {MAX_LENGTH} tokens, got {qkv.shape[1]}"
    return kernel_unsupported_reason(qkv, heads)


def applies(qkv: torch.Tensor, heads: int) -> bool:
    """Whether `model.attention_backend=auto` takes the kernel for `qkv`: on a GPU (not the interpreter), in
    16 bits, up to AUTO_MAX_LENGTH tokens."""
    return (qkv.device.type == "cuda" and qkv.shape[1] <= AUTO_MAX_LENGTH
            and unsupported_reason(qkv, heads) is None)


def power_of_2(n: int) -> int:
    """n rounded up to a power of 2, at least 16 (the smallest tensor-core tile)."""
    return max(16, 1 << (n - 1).bit_length())


def _launch_config(length: int, head_dim: int) -> tuple[int, int, int]:
    """(the one tile's rows: the sequence padded to a power of 2, the head size padded likewise, warps)."""
    block = power_of_2(length)
    return block, power_of_2(head_dim), 4 if block <= 64 else 8


if triton is not None:
    _INTERPRETING = tl.constexpr(interpreting())
    _MAX_LENGTH = tl.constexpr(MAX_LENGTH)

    @triton.jit
    def _dot(a, b):
        """a @ b with fp32 accumulation. Triton's CPU interpreter multiplies bf16 operands wrongly (NumPy has
        no bf16), so there they are widened first: exact, as the tensor cores' products are."""
        if _INTERPRETING:
            a, b = a.to(tl.float32), b.to(tl.float32)
        return tl.dot(a, b)

    @triton.jit
    def _load_tiles(base, rows, cols, length, head_dim, stride_token, heads):
        """Q, K and V of one (sample, head): [BLOCK, BLOCK_D] each, zero past the sequence and the head."""
        inside = (rows[:, None] < length) & (cols[None, :] < head_dim)
        offsets = rows[:, None] * stride_token + cols[None, :]
        q = tl.load(base + offsets, mask=inside, other=0.0)
        k = tl.load(base + heads * head_dim + offsets, mask=inside, other=0.0)
        v = tl.load(base + 2 * heads * head_dim + offsets, mask=inside, other=0.0)
        return q, k, v, inside

    @triton.jit
    def _scores_log2(q, k, rows, length, scale_log2, CAUSAL: tl.constexpr):
        """QKᵀ · scale in log2 units (fp32), −inf where a query may not see a key."""
        s = _dot(q, tl.trans(k)) * scale_log2
        visible = rows[None, :] < length
        if CAUSAL:
            visible = visible & (rows[None, :] <= rows[:, None])
        return tl.where(visible, s, float("-inf"))

    @triton.jit
    def _short_attention_forward_kernel(
        qkv, out, lse, length, heads, head_dim, scale_log2,
        BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    ):
        program = tl.program_id(0)
        sample, head = program // heads, program % heads
        width = heads * head_dim
        rows, cols = tl.arange(0, BLOCK), tl.arange(0, BLOCK_D)
        base = qkv + sample.to(tl.int64) * length * 3 * width + head * head_dim
        q, k, v, inside = _load_tiles(base, rows, cols, length, head_dim, 3 * width, heads)
        s = _scores_log2(q, k, rows, length, scale_log2, CAUSAL)
        row_max = tl.max(s, 1)
        p = tl.exp2(s - row_max[:, None])
        row_sum = tl.sum(p, 1)
        o = _dot(p.to(v.dtype), v) / row_sum[:, None]
        out_base = out + sample.to(tl.int64) * length * width + head * head_dim
        tl.store(out_base + rows[:, None] * width + cols[None, :], o.to(out.dtype.element_ty), mask=inside)
        tl.store(lse + program.to(tl.int64) * _MAX_LENGTH + rows, row_max + tl.log2(row_sum))

    @triton.jit
    def _short_attention_backward_kernel(
        qkv, out, grad_out, lse, grad_qkv, length, heads, head_dim, scale, scale_log2,
        BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    ):
        program = tl.program_id(0)
        sample, head = program // heads, program % heads
        width = heads * head_dim
        rows, cols = tl.arange(0, BLOCK), tl.arange(0, BLOCK_D)
        qkv_offset = sample.to(tl.int64) * length * 3 * width + head * head_dim
        q, k, v, inside = _load_tiles(qkv + qkv_offset, rows, cols, length, head_dim, 3 * width, heads)
        out_offsets = sample.to(tl.int64) * length * width + head * head_dim + rows[:, None] * width + cols[None, :]
        o = tl.load(out + out_offsets, mask=inside, other=0.0)
        do = tl.load(grad_out + out_offsets, mask=inside, other=0.0)
        row_lse = tl.load(lse + program.to(tl.int64) * _MAX_LENGTH + rows)
        # Past the sequence, dO is zero, so those rows add nothing to dK or dV.
        s = _scores_log2(q, k, rows, length, scale_log2, CAUSAL)
        p = tl.exp2(s - row_lse[:, None])
        dv = _dot(tl.trans(p.to(do.dtype)), do)
        dp = _dot(do, tl.trans(v))
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # rowsum(dO ∘ O) = rowsum(P ∘ dP)
        ds = (p * (dp - delta[:, None])).to(q.dtype)
        dq = _dot(ds, k) * scale
        dk = _dot(tl.trans(ds), q) * scale
        dtype = grad_qkv.dtype.element_ty
        grad_base = grad_qkv + qkv_offset + rows[:, None] * 3 * width + cols[None, :]
        tl.store(grad_base, dq.to(dtype), mask=inside)
        tl.store(grad_base + width, dk.to(dtype), mask=inside)
        tl.store(grad_base + 2 * width, dv.to(dtype), mask=inside)


def _shape(qkv: torch.Tensor, heads: int) -> tuple[int, int, int, int]:
    batch, length, three_width = qkv.shape
    width = three_width // 3
    return batch, length, width, width // heads


@torch.library.custom_op("stableclip::short_attention_forward", mutates_args=())
def _forward(qkv: torch.Tensor, heads: int, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv [B, L, 3·W] (contiguous, laid out as the QKV projection writes it) -> (out [B, L, W], the
    log-sum-exp of each query's scores in log2 units [B·heads, MAX_LENGTH], fp32, the tile's rows first)."""
    batch, length, width, head_dim = _shape(qkv, heads)
    block, block_d, warps = _launch_config(length, head_dim)
    out = qkv.new_empty(batch, length, width)
    lse = torch.empty(batch * heads, MAX_LENGTH, device=qkv.device, dtype=torch.float32)
    scale = head_dim ** -0.5
    _short_attention_forward_kernel[(batch * heads,)](
        qkv, out, lse, length, heads, head_dim, scale * math.log2(math.e),
        BLOCK=block, BLOCK_D=block_d, CAUSAL=causal, num_warps=warps,
    )
    return out, lse


@_forward.register_fake
def _(qkv, heads, causal):
    batch, length, width, head_dim = _shape(qkv, heads)
    # No tile arithmetic here: under dynamic shapes `length` is symbolic.
    return qkv.new_empty(batch, length, width), qkv.new_empty(batch * heads, MAX_LENGTH, dtype=torch.float32)


@torch.library.custom_op("stableclip::short_attention_backward", mutates_args=())
def _backward(
    grad_out: torch.Tensor, qkv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, heads: int, causal: bool
) -> torch.Tensor:
    """The gradient of qkv, in qkv's layout."""
    batch, length, width, head_dim = _shape(qkv, heads)
    block, block_d, warps = _launch_config(length, head_dim)
    grad_qkv = torch.empty_like(qkv)
    scale = head_dim ** -0.5
    _short_attention_backward_kernel[(batch * heads,)](
        qkv, out, grad_out, lse, grad_qkv, length, heads, head_dim, scale, scale * math.log2(math.e),
        BLOCK=block, BLOCK_D=block_d, CAUSAL=causal, num_warps=warps,
    )
    return grad_qkv


@_backward.register_fake
def _(grad_out, qkv, out, lse, heads, causal):
    return torch.empty_like(qkv)


def register_autograd(forward_op, backward_op) -> None:
    """Autograd for a pair of custom ops: forward_op(qkv, heads, causal) -> (out, lse) and
    backward_op(grad_out, qkv, out, lse, heads, causal) -> grad_qkv."""

    def setup_context(ctx, inputs, output) -> None:
        qkv, heads, causal = inputs
        out, lse = output
        ctx.heads, ctx.causal = heads, causal
        ctx.save_for_backward(qkv, out, lse)

    def grads(ctx, grad_out, _grad_lse):
        qkv, out, lse = ctx.saved_tensors
        return backward_op(grad_out.to(qkv.dtype).contiguous(), qkv, out, lse, ctx.heads, ctx.causal), None, None

    forward_op.register_autograd(grads, setup_context=setup_context)


register_autograd(_forward, _backward)


def run_checked(forward_op, backend: str, reason: str | None, qkv: torch.Tensor, heads: int, causal: bool):
    """forward_op's attention output for qkv, or a ValueError naming why `backend` cannot run here (`reason`)."""
    if reason is not None:
        raise ValueError(f"model.attention_backend={backend} cannot run here: {reason}; or use "
                         "model.attention_backend=auto")
    return forward_op(qkv.contiguous(), heads, causal)[0]


def short_attention(qkv: torch.Tensor, heads: int, causal: bool = False) -> torch.Tensor:
    """Multi-head self-attention of qkv [B, L, 3·W] (Q, K, V side by side, each head's D = W / heads features
    contiguous, as `Attention`'s fused projection writes them) for L <= 128: the output [B, L, W], equal to
    `F.scaled_dot_product_attention` over the heads up to 16-bit rounding."""
    return run_checked(_forward, "triton_short", unsupported_reason(qkv, heads), qkv, heads, causal)
