"""Self-attention for short sequences (at most 128 tokens: ViT-B/32's 50 patches, every text tower's 77
tokens) as one Triton program per (sample, head) that holds the whole sequence, reading the fused QKV
projection's output and writing the gradient of that output directly.

Why: at these lengths the generic SDPA kernels (cuDNN, flash) tile for long sequences and run far below the
GPU's memory bandwidth, and their gradients come back as three tensors that the QKV projection's backward
then copies into one. Here a program holds its whole sequence, so the forward pass is one read of Q, K, V and
one write of the output, and the backward pass one read of Q, K, V, O, dO and one write of dQKV: no atomics,
no copies. The arithmetic is FlashAttention's (fp32 scores and softmax, 16-bit probabilities into the second
matmul, the backward pass recomputing P from the saved log-sum-exp).

Up to 64 tokens the sequence is one tile. Longer ones are a first block of 64 rows and a second of the rest,
padded to a power of 2 (FIRST_ROWS): a text tower's 77 causal tokens take 64 + 16 rows, whose score tiles
(64², 16·64 and 16², the first block's queries skipping the second block's keys) hold a third of a 128 × 128
tile's, in a program of 4 warps instead of 8. On an H200 that made the compiled ViT-B/32 step 1.012–1.017×
faster than one tile of 128 (docs/BENCHMARKS.md).

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

from src.kernels.triton_interpreter import interpreting

MAX_LENGTH = 128  # the longest sequence the kernel takes, and the rows of its saved statistics
# Rows of a program's first block of queries and keys; the rest of a longer sequence is a second block of the next
# power of 2 (77 tokens: 64 + 16), so that the score tiles cover 64² + 16·64 + 16² entries, not 128², and a causal
# mask skips the first block's queries against the second block's keys. MAX_LENGTH makes it one tile.
FIRST_ROWS = 64
WARPS = None  # warps per program; None: 4 where the first block has at most 64 rows, else 8 (2 spill at 128)
# The longest sequence `auto` gives it; longer ones go to tiled_attention.py's kernel. On an H200 this kernel beat
# cuDNN's on CLIP's towers of 50 and 77 tokens, and beat the tiled kernel on the text towers' 77 (docs/BENCHMARKS.md;
# `bench/throughput.py --set "py:src.kernels.attention.short.AUTO_MAX_LENGTH=64"`).
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


def _launch_config(length: int, head_dim: int) -> tuple[int, int, int, int]:
    """(rows of the first block: the sequence padded to a power of 2, at most FIRST_ROWS; rows of the second
    block, the rest padded likewise, or 0; the head size padded to a power of 2; warps)."""
    first = min(power_of_2(length), FIRST_ROWS)
    second = power_of_2(length - first) if length > first else 0
    if first + second > MAX_LENGTH:
        raise ValueError(f"short_attention.FIRST_ROWS={FIRST_ROWS} leaves {length} tokens blocks of {first} and "
                         f"{second} rows, more than the {MAX_LENGTH} the statistics hold: use 64 or {MAX_LENGTH}")
    return first, second, power_of_2(head_dim), WARPS or (4 if first <= 64 else 8)


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
    def _scores_log2(q, k, q_rows, k_rows, length, scale_log2, CAUSAL: tl.constexpr):
        """QKᵀ · scale in log2 units (fp32), −inf where a query may not see a key."""
        s = _dot(q, tl.trans(k)) * scale_log2
        visible = k_rows[None, :] < length
        if CAUSAL:
            visible = visible & (k_rows[None, :] <= q_rows[:, None])
        return tl.where(visible, s, float("-inf"))

    @triton.jit
    def _attend(q, k, v, q_rows, k_rows, length, scale_log2, row_max, row_sum, acc, CAUSAL: tl.constexpr):
        """Queries q against one block of keys and values, folded into the running softmax (row_max, row_sum)
        and output accumulator: FlashAttention's online softmax, over at most two blocks."""
        s = _scores_log2(q, k, q_rows, k_rows, length, scale_log2, CAUSAL)
        new_max = tl.maximum(row_max, tl.max(s, 1))
        alpha = tl.exp2(row_max - new_max)
        p = tl.exp2(s - new_max[:, None])
        return new_max, row_sum * alpha + tl.sum(p, 1), acc * alpha[:, None] + _dot(p.to(v.dtype), v)

    @triton.jit
    def _store_rows(base, x, rows, cols, length, head_dim, stride_token):
        """Rows `rows`, columns `cols` of one head's tensor, cast to base's dtype, past the sequence and the head
        left out (tiled_attention.py's kernels store with it too)."""
        inside = (rows[:, None] < length) & (cols[None, :] < head_dim)
        tl.store(base + rows[:, None] * stride_token + cols[None, :], x.to(base.dtype.element_ty), mask=inside)

    @triton.jit
    def _short_attention_forward_kernel(
        qkv, out, lse, length, heads, head_dim, scale_log2,
        BLOCK: tl.constexpr, SECOND: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    ):
        """One (sample, head): queries and keys in a first block of BLOCK rows and, where SECOND > 0, a second
        of SECOND rows; the first block's queries skip the second's keys under a causal mask."""
        program = tl.program_id(0)
        sample, head = program // heads, program % heads
        width = heads * head_dim
        rows, cols = tl.arange(0, BLOCK), tl.arange(0, BLOCK_D)
        base = qkv + sample.to(tl.int64) * length * 3 * width + head * head_dim
        out_base = out + sample.to(tl.int64) * length * width + head * head_dim
        lse_base = lse + program.to(tl.int64) * _MAX_LENGTH
        q, k, v, _ = _load_tiles(base, rows, cols, length, head_dim, 3 * width, heads)
        row_max = tl.full((BLOCK,), float("-inf"), tl.float32)
        row_sum = tl.zeros((BLOCK,), tl.float32)
        acc = tl.zeros((BLOCK, BLOCK_D), tl.float32)
        row_max, row_sum, acc = _attend(q, k, v, rows, rows, length, scale_log2, row_max, row_sum, acc, CAUSAL)
        if SECOND > 0:
            rows2 = BLOCK + tl.arange(0, SECOND)
            q2, k2, v2, _ = _load_tiles(base, rows2, cols, length, head_dim, 3 * width, heads)
            if not CAUSAL:
                row_max, row_sum, acc = _attend(q, k2, v2, rows, rows2, length, scale_log2, row_max, row_sum, acc,
                                                CAUSAL)
            max2 = tl.full((SECOND,), float("-inf"), tl.float32)
            sum2 = tl.zeros((SECOND,), tl.float32)
            acc2 = tl.zeros((SECOND, BLOCK_D), tl.float32)
            max2, sum2, acc2 = _attend(q2, k, v, rows2, rows, length, scale_log2, max2, sum2, acc2, CAUSAL)
            max2, sum2, acc2 = _attend(q2, k2, v2, rows2, rows2, length, scale_log2, max2, sum2, acc2, CAUSAL)
            _store_rows(out_base, acc2 / sum2[:, None], rows2, cols, length, head_dim, width)
            tl.store(lse_base + rows2, max2 + tl.log2(sum2))
        _store_rows(out_base, acc / row_sum[:, None], rows, cols, length, head_dim, width)
        tl.store(lse_base + rows, row_max + tl.log2(row_sum))

    @triton.jit
    def _pair_backward(q, k, v, do, row_lse, delta, q_rows, k_rows, length, scale_log2, CAUSAL: tl.constexpr):
        """One block of queries against one block of keys: its shares of dQ and dK (both still to be scaled)
        and of dV. Query rows past the sequence add nothing: their dO and rowsum(dO ∘ O) are zero."""
        s = _scores_log2(q, k, q_rows, k_rows, length, scale_log2, CAUSAL)
        p = tl.exp2(s - row_lse[:, None])
        dv = _dot(tl.trans(p.to(do.dtype)), do)
        ds = (p * (_dot(do, tl.trans(v)) - delta[:, None])).to(q.dtype)
        return _dot(ds, k), _dot(tl.trans(ds), q), dv

    @triton.jit
    def _load_grad_rows(qkv, out, grad_out, lse_base, qkv_offset, out_offset, rows, cols, length, head_dim,
                        width, heads):
        """A block's Q, K, V, dO, log-sum-exp and rowsum(dO ∘ O) = rowsum(P ∘ dP)."""
        q, k, v, inside = _load_tiles(qkv + qkv_offset, rows, cols, length, head_dim, 3 * width, heads)
        offsets = out_offset + rows[:, None] * width + cols[None, :]
        o = tl.load(out + offsets, mask=inside, other=0.0)
        do = tl.load(grad_out + offsets, mask=inside, other=0.0)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        return q, k, v, do, tl.load(lse_base + rows), delta

    @triton.jit
    def _short_attention_backward_kernel(
        qkv, out, grad_out, lse, grad_qkv, length, heads, head_dim, scale, scale_log2,
        BLOCK: tl.constexpr, SECOND: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    ):
        """dQKV of one (sample, head), over the blocks of the forward kernel."""
        program = tl.program_id(0)
        sample, head = program // heads, program % heads
        width = heads * head_dim
        rows, cols = tl.arange(0, BLOCK), tl.arange(0, BLOCK_D)
        qkv_offset = sample.to(tl.int64) * length * 3 * width + head * head_dim
        out_offset = sample.to(tl.int64) * length * width + head * head_dim
        lse_base = lse + program.to(tl.int64) * _MAX_LENGTH
        q, k, v, do, row_lse, delta = _load_grad_rows(qkv, out, grad_out, lse_base, qkv_offset, out_offset, rows,
                                                      cols, length, head_dim, width, heads)
        dq, dk, dv = _pair_backward(q, k, v, do, row_lse, delta, rows, rows, length, scale_log2, CAUSAL)
        grad_base = grad_qkv + qkv_offset
        if SECOND > 0:
            rows2 = BLOCK + tl.arange(0, SECOND)
            q2, k2, v2, do2, lse2, delta2 = _load_grad_rows(qkv, out, grad_out, lse_base, qkv_offset, out_offset,
                                                            rows2, cols, length, head_dim, width, heads)
            dq2, dk_part, dv_part = _pair_backward(q2, k, v, do2, lse2, delta2, rows2, rows, length, scale_log2,
                                                   CAUSAL)
            dk += dk_part
            dv += dv_part
            dq_part, dk2, dv2 = _pair_backward(q2, k2, v2, do2, lse2, delta2, rows2, rows2, length, scale_log2,
                                               CAUSAL)
            dq2 += dq_part
            if not CAUSAL:
                dq_part, dk_part, dv_part = _pair_backward(q, k2, v2, do, row_lse, delta, rows, rows2, length,
                                                           scale_log2, CAUSAL)
                dq += dq_part
                dk2 += dk_part
                dv2 += dv_part
            _store_rows(grad_base, dq2 * scale, rows2, cols, length, head_dim, 3 * width)
            _store_rows(grad_base + width, dk2 * scale, rows2, cols, length, head_dim, 3 * width)
            _store_rows(grad_base + 2 * width, dv2, rows2, cols, length, head_dim, 3 * width)
        _store_rows(grad_base, dq * scale, rows, cols, length, head_dim, 3 * width)
        _store_rows(grad_base + width, dk * scale, rows, cols, length, head_dim, 3 * width)
        _store_rows(grad_base + 2 * width, dv, rows, cols, length, head_dim, 3 * width)


def _shape(qkv: torch.Tensor, heads: int) -> tuple[int, int, int, int]:
    batch, length, three_width = qkv.shape
    width = three_width // 3
    return batch, length, width, width // heads


@torch.library.custom_op("stableclip::short_attention_forward", mutates_args=())
def _forward(qkv: torch.Tensor, heads: int, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv [B, L, 3·W] (contiguous, laid out as the QKV projection writes it) -> (out [B, L, W], the
    log-sum-exp of each query's scores in log2 units [B·heads, MAX_LENGTH], fp32, the tile's rows first)."""
    batch, length, width, head_dim = _shape(qkv, heads)
    block, second, block_d, warps = _launch_config(length, head_dim)
    out = qkv.new_empty(batch, length, width)
    lse = torch.empty(batch * heads, MAX_LENGTH, device=qkv.device, dtype=torch.float32)
    scale = head_dim ** -0.5
    _short_attention_forward_kernel[(batch * heads,)](
        qkv, out, lse, length, heads, head_dim, scale * math.log2(math.e),
        BLOCK=block, SECOND=second, BLOCK_D=block_d, CAUSAL=causal, num_warps=warps,
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
    block, second, block_d, warps = _launch_config(length, head_dim)
    grad_qkv = torch.empty_like(qkv)
    scale = head_dim ** -0.5
    _short_attention_backward_kernel[(batch * heads,)](
        qkv, out, grad_out, lse, grad_qkv, length, heads, head_dim, scale, scale * math.log2(math.e),
        BLOCK=block, SECOND=second, BLOCK_D=block_d, CAUSAL=causal, num_warps=warps,
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
