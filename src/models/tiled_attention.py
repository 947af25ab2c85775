"""Self-attention for sequences longer than one tile (ViT-L/14's and ViT-H/14's 257 tokens, ViT-B/16's 197), in
tiles of 64 rows plus one narrow tail tile, reading the fused QKV projection's output and writing the gradient of
that output directly.

Why: the SDPA kernels tile a sequence in blocks of 128 (or 64) queries and keys, so 257 tokens become three
blocks of which the last holds one token: 384² scores computed for 257² used, 2.2 times the work. Here the 256
tokens that fill whole tiles go in tiles of 64, and the remainder in a tail tile of the next power of 2 (at least
16, the smallest tensor-core tile): 272² for 257². Like short_attention (the one-tile kernel for at most 128
tokens), it reads Q, K, V where the fused projection put them and writes dQKV in that layout, so no copies
assemble the three gradients into one.

The arithmetic is FlashAttention-2's: forward with an online softmax over key tiles (fp32 scores, probabilities
rounded to 16 bits before they multiply V), saving each query's log-sum-exp; backward recomputes the
probabilities tile by tile, one program per query tile for dQ (it also writes rowsum(dO ∘ O)) and one per key
tile for dK and dV, so no program adds into another's output. `model.attention_backend=triton_tiled` asks for it
at any length; `auto` takes it from 129 up to AUTO_MAX_LENGTH tokens with heads of 16, 32, 64 or 128 features,
where it was measured faster than SDPA.
"""

from __future__ import annotations

import math

import torch

from src.models.short_attention import _shape, kernel_unsupported_reason, register_autograd, run_checked

try:
    import triton
    import triton.language as tl

    from src.models.short_attention import _dot
except ImportError:
    triton = None

# Launch settings (bench/short_attention.py --tiled-configs measures others): rows of a full tile, of queries and
# of keys alike; warps per program; software-pipelining stages of the loops over tiles (None: 3 for heads of up
# to 64 features, 2 for larger ones, whose 3 stages ran 1.35x slower on an H200).
BLOCK = 64
WARPS = 4
STAGES = None
AUTO_MAX_LENGTH = 320  # the longest sequence `auto` gives this kernel (measured at 197 and 257 tokens)


def unsupported_reason(qkv: torch.Tensor, heads: int) -> str | None:
    """Why the kernel cannot run on `qkv` (with the fix), or None where it can."""
    return kernel_unsupported_reason(qkv, heads)


def applies(qkv: torch.Tensor, heads: int) -> bool:
    """Whether `model.attention_backend=auto` takes the kernel for `qkv`: on a GPU (not the interpreter), in
    16 bits, up to AUTO_MAX_LENGTH tokens, for a head size that is a power of 2. (ViT-H/14's heads of 80
    features pad to tiles of 128, and there the kernel only matched cuDNN on an H200.)"""
    head_dim = qkv.shape[-1] // 3 // heads
    return (qkv.device.type == "cuda" and qkv.shape[1] <= AUTO_MAX_LENGTH and head_dim == _power_of_2(head_dim)
            and unsupported_reason(qkv, heads) is None)


def _power_of_2(n: int) -> int:
    """n rounded up to a power of 2, at least 16 (the smallest tensor-core tile)."""
    return max(16, 1 << (n - 1).bit_length())


def _tiles(length: int) -> tuple[int, int]:
    """(full tiles, rows of the tail tile or 0 where there is none)."""
    full, rest = divmod(length, BLOCK)
    return full, _power_of_2(rest) if rest else 0


def _lse_rows(length) -> int:
    """Row stride of the per-query statistics (log-sum-exp, rowsum(dO ∘ O)): room for the tail tile's padding,
    which is under BLOCK rows. Plain arithmetic, so that it also holds for a symbolic length under dynamic
    shapes (the fake implementation)."""
    return length + BLOCK


if triton is not None:

    @triton.jit
    def _load_rows(base, rows, cols, length, head_dim, stride_token):
        """Rows `rows` of one head's Q, K, V, O or dO: [len(rows), BLOCK_D], zero past the sequence and the head."""
        inside = (rows[:, None] < length) & (cols[None, :] < head_dim)
        return tl.load(base + rows[:, None] * stride_token + cols[None, :], mask=inside, other=0.0)

    @triton.jit
    def _store_rows(base, value, rows, cols, length, head_dim, stride_token):
        inside = (rows[:, None] < length) & (cols[None, :] < head_dim)
        tl.store(base + rows[:, None] * stride_token + cols[None, :], value.to(base.dtype.element_ty), mask=inside)

    @triton.jit
    def _masked(s, queries, keys, length, MASK_KEYS: tl.constexpr, CAUSAL: tl.constexpr):
        """Scores s with −inf where a pair does not count: keys past the sequence (only a tail tile has any)
        and, for causal attention, keys after the query."""
        if MASK_KEYS:
            s = tl.where(keys[None, :] < length, s, float("-inf"))
        if CAUSAL:
            s = tl.where(keys[None, :] <= queries[:, None], s, float("-inf"))
        return s

    @triton.jit
    def _forward_tile(
        q, row_max, row_sum, acc, k_base, v_base, queries, start, cols, length, head_dim, stride, scale_log2,
        COLS: tl.constexpr, MASK_KEYS: tl.constexpr, CAUSAL: tl.constexpr,
    ):
        """One key tile of the online softmax: the running max, sum and unnormalized output, updated."""
        keys = start + tl.arange(0, COLS)
        k = _load_rows(k_base, keys, cols, length, head_dim, stride)
        v = _load_rows(v_base, keys, cols, length, head_dim, stride)
        s = _masked(_dot(q, tl.trans(k)) * scale_log2, queries, keys, length, MASK_KEYS, CAUSAL)
        new_max = tl.maximum(row_max, tl.max(s, 1))
        rescale = tl.exp2(row_max - new_max)
        p = tl.exp2(s - new_max[:, None])
        row_sum = row_sum * rescale + tl.sum(p, 1)
        acc = acc * rescale[:, None] + _dot(p.to(v.dtype), v)
        return new_max, row_sum, acc

    @triton.jit
    def _forward_rows(
        qkv, out, lse, program, start, length, heads, head_dim, lse_stride, scale_log2,
        ROWS: tl.constexpr, BLOCK: tl.constexpr, TAIL: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    ):
        sample, head = program // heads, program % heads
        width = heads * head_dim
        stride = 3 * width
        base = qkv + sample.to(tl.int64) * length * stride + head * head_dim
        queries, cols = start + tl.arange(0, ROWS), tl.arange(0, BLOCK_D)
        q = _load_rows(base, queries, cols, length, head_dim, stride)
        row_max = tl.full([ROWS], float("-inf"), tl.float32)
        row_sum = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
        full_keys = length // BLOCK * BLOCK
        for key_start in range(0, full_keys, BLOCK):
            row_max, row_sum, acc = _forward_tile(
                q, row_max, row_sum, acc, base + width, base + 2 * width, queries, key_start, cols, length,
                head_dim, stride, scale_log2, COLS=BLOCK, MASK_KEYS=False, CAUSAL=CAUSAL)
        if TAIL > 0:
            row_max, row_sum, acc = _forward_tile(
                q, row_max, row_sum, acc, base + width, base + 2 * width, queries, full_keys, cols, length,
                head_dim, stride, scale_log2, COLS=TAIL, MASK_KEYS=True, CAUSAL=CAUSAL)
        out_base = out + sample.to(tl.int64) * length * width + head * head_dim
        _store_rows(out_base, acc / row_sum[:, None], queries, cols, length, head_dim, width)
        tl.store(lse + program.to(tl.int64) * lse_stride + queries, row_max + tl.log2(row_sum))

    @triton.jit
    def _forward_kernel(
        qkv, out, lse, length, heads, head_dim, lse_stride, tiles, scale_log2,
        BLOCK: tl.constexpr, TAIL: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    ):
        # One program per (sample, head, query tile), the tiles of one head next to each other so that its
        # keys and values stay in L2 between them.
        program, tile = tl.program_id(0) // tiles, tl.program_id(0) % tiles
        if tile < length // BLOCK:
            _forward_rows(qkv, out, lse, program, tile * BLOCK, length, heads, head_dim, lse_stride, scale_log2,
                          ROWS=BLOCK, BLOCK=BLOCK, TAIL=TAIL, BLOCK_D=BLOCK_D, CAUSAL=CAUSAL)
        else:
            if TAIL > 0:
                _forward_rows(qkv, out, lse, program, tile * BLOCK, length, heads, head_dim, lse_stride, scale_log2,
                              ROWS=TAIL, BLOCK=BLOCK, TAIL=TAIL, BLOCK_D=BLOCK_D, CAUSAL=CAUSAL)

    @triton.jit
    def _grad_query_tile(
        dq, q, do, row_lse, delta, k_base, v_base, queries, start, cols, length, head_dim, stride, scale_log2,
        COLS: tl.constexpr, MASK_KEYS: tl.constexpr, CAUSAL: tl.constexpr,
    ):
        keys = start + tl.arange(0, COLS)
        k = _load_rows(k_base, keys, cols, length, head_dim, stride)
        v = _load_rows(v_base, keys, cols, length, head_dim, stride)
        # Keys past the sequence are masked here too: exp2(0 - lse) can overflow where every score of a query
        # is very negative, and inf · 0 (their zero K rows) would be NaN.
        s = _masked(_dot(q, tl.trans(k)) * scale_log2, queries, keys, length, MASK_KEYS, CAUSAL)
        p = tl.exp2(s - row_lse[:, None])
        ds = p * (_dot(do, tl.trans(v)) - delta[:, None])
        return dq + _dot(ds.to(k.dtype), k)

    @triton.jit
    def _grad_query_rows(
        qkv, out, grad_out, lse, delta, grad_qkv, program, start, length, heads, head_dim, lse_stride, scale,
        scale_log2, ROWS: tl.constexpr, BLOCK: tl.constexpr, TAIL: tl.constexpr, BLOCK_D: tl.constexpr,
        CAUSAL: tl.constexpr,
    ):
        sample, head = program // heads, program % heads
        width = heads * head_dim
        stride = 3 * width
        qkv_offset = sample.to(tl.int64) * length * stride + head * head_dim
        out_offset = sample.to(tl.int64) * length * width + head * head_dim
        base = qkv + qkv_offset
        queries, cols = start + tl.arange(0, ROWS), tl.arange(0, BLOCK_D)
        q = _load_rows(base, queries, cols, length, head_dim, stride)
        do = _load_rows(grad_out + out_offset, queries, cols, length, head_dim, width)
        o = _load_rows(out + out_offset, queries, cols, length, head_dim, width)
        row_delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # rowsum(dO ∘ O) = rowsum(P ∘ dP)
        tl.store(delta + program.to(tl.int64) * lse_stride + queries, row_delta)
        row_lse = tl.load(lse + program.to(tl.int64) * lse_stride + queries)
        dq = tl.zeros([ROWS, BLOCK_D], tl.float32)
        full_keys = length // BLOCK * BLOCK
        for key_start in range(0, full_keys, BLOCK):
            dq = _grad_query_tile(dq, q, do, row_lse, row_delta, base + width, base + 2 * width, queries, key_start,
                                  cols, length, head_dim, stride, scale_log2, COLS=BLOCK, MASK_KEYS=False,
                                  CAUSAL=CAUSAL)
        if TAIL > 0:
            dq = _grad_query_tile(dq, q, do, row_lse, row_delta, base + width, base + 2 * width, queries, full_keys,
                                  cols, length, head_dim, stride, scale_log2, COLS=TAIL, MASK_KEYS=True,
                                  CAUSAL=CAUSAL)
        _store_rows(grad_qkv + qkv_offset, dq * scale, queries, cols, length, head_dim, stride)

    @triton.jit
    def _grad_query_kernel(
        qkv, out, grad_out, lse, delta, grad_qkv, length, heads, head_dim, lse_stride, tiles, scale, scale_log2,
        BLOCK: tl.constexpr, TAIL: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    ):
        program, tile = tl.program_id(0) // tiles, tl.program_id(0) % tiles
        if tile < length // BLOCK:
            _grad_query_rows(qkv, out, grad_out, lse, delta, grad_qkv, program, tile * BLOCK, length, heads,
                             head_dim, lse_stride, scale, scale_log2, ROWS=BLOCK, BLOCK=BLOCK, TAIL=TAIL,
                             BLOCK_D=BLOCK_D, CAUSAL=CAUSAL)
        else:
            if TAIL > 0:
                _grad_query_rows(qkv, out, grad_out, lse, delta, grad_qkv, program, tile * BLOCK, length, heads,
                                 head_dim, lse_stride, scale, scale_log2, ROWS=TAIL, BLOCK=BLOCK, TAIL=TAIL,
                                 BLOCK_D=BLOCK_D, CAUSAL=CAUSAL)

    @triton.jit
    def _grad_key_tile(
        dk, dv, k, v, q_base, do_base, lse_base, delta_base, keys, start, cols, length, head_dim, stride, width,
        scale_log2, ROWS: tl.constexpr, CAUSAL: tl.constexpr,
    ):
        """One query tile's share of this key tile's dK and dV. Keys past the sequence need no mask: each
        key's gradient depends only on its own column of P, and those rows are not stored. Queries past the
        sequence add nothing: their dO and rowsum(dO ∘ O) are zero."""
        queries = start + tl.arange(0, ROWS)
        q = _load_rows(q_base, queries, cols, length, head_dim, stride)
        do = _load_rows(do_base, queries, cols, length, head_dim, width)
        row_lse = tl.load(lse_base + queries)
        row_delta = tl.load(delta_base + queries)
        s = _masked(_dot(q, tl.trans(k)) * scale_log2, queries, keys, length, False, CAUSAL)
        p = tl.exp2(s - row_lse[:, None])
        dv += _dot(tl.trans(p.to(do.dtype)), do)
        ds = p * (_dot(do, tl.trans(v)) - row_delta[:, None])
        dk += _dot(tl.trans(ds.to(q.dtype)), q)
        return dk, dv

    @triton.jit
    def _grad_key_rows(
        qkv, grad_out, lse, delta, grad_qkv, program, start, length, heads, head_dim, lse_stride, scale, scale_log2,
        COLS: tl.constexpr, BLOCK: tl.constexpr, TAIL: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    ):
        sample, head = program // heads, program % heads
        width = heads * head_dim
        stride = 3 * width
        qkv_offset = sample.to(tl.int64) * length * stride + head * head_dim
        base = qkv + qkv_offset
        do_base = grad_out + sample.to(tl.int64) * length * width + head * head_dim
        lse_base, delta_base = lse + program.to(tl.int64) * lse_stride, delta + program.to(tl.int64) * lse_stride
        keys, cols = start + tl.arange(0, COLS), tl.arange(0, BLOCK_D)
        k = _load_rows(base + width, keys, cols, length, head_dim, stride)
        v = _load_rows(base + 2 * width, keys, cols, length, head_dim, stride)
        dk = tl.zeros([COLS, BLOCK_D], tl.float32)
        dv = tl.zeros([COLS, BLOCK_D], tl.float32)
        full_queries = length // BLOCK * BLOCK
        for query_start in range(0, full_queries, BLOCK):
            dk, dv = _grad_key_tile(dk, dv, k, v, base, do_base, lse_base, delta_base, keys, query_start, cols,
                                    length, head_dim, stride, width, scale_log2, ROWS=BLOCK, CAUSAL=CAUSAL)
        if TAIL > 0:
            dk, dv = _grad_key_tile(dk, dv, k, v, base, do_base, lse_base, delta_base, keys, full_queries, cols,
                                    length, head_dim, stride, width, scale_log2, ROWS=TAIL, CAUSAL=CAUSAL)
        grad_base = grad_qkv + qkv_offset
        _store_rows(grad_base + width, dk * scale, keys, cols, length, head_dim, stride)
        _store_rows(grad_base + 2 * width, dv, keys, cols, length, head_dim, stride)

    @triton.jit
    def _grad_key_kernel(
        qkv, grad_out, lse, delta, grad_qkv, length, heads, head_dim, lse_stride, tiles, scale, scale_log2,
        BLOCK: tl.constexpr, TAIL: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    ):
        program, tile = tl.program_id(0) // tiles, tl.program_id(0) % tiles
        if tile < length // BLOCK:
            _grad_key_rows(qkv, grad_out, lse, delta, grad_qkv, program, tile * BLOCK, length, heads, head_dim,
                           lse_stride, scale, scale_log2, COLS=BLOCK, BLOCK=BLOCK, TAIL=TAIL, BLOCK_D=BLOCK_D,
                           CAUSAL=CAUSAL)
        else:
            if TAIL > 0:
                _grad_key_rows(qkv, grad_out, lse, delta, grad_qkv, program, tile * BLOCK, length, heads,
                               head_dim, lse_stride, scale, scale_log2, COLS=TAIL, BLOCK=BLOCK, TAIL=TAIL,
                               BLOCK_D=BLOCK_D, CAUSAL=CAUSAL)


def _launch_config(length: int, head_dim: int) -> dict:
    """The kernels' shared launch arguments: tiles per head and the compile-time settings."""
    full, tail = _tiles(length)
    block_d = _power_of_2(head_dim)
    stages = STAGES or (3 if block_d <= 64 else 2)
    return {"tiles": full + (tail > 0), "meta": {
        "BLOCK": BLOCK, "TAIL": tail, "BLOCK_D": block_d, "num_warps": WARPS, "num_stages": stages}}


@torch.library.custom_op("stableclip::tiled_attention_forward", mutates_args=())
def _forward(qkv: torch.Tensor, heads: int, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv [B, L, 3·W] (contiguous, laid out as the QKV projection writes it) -> (out [B, L, W], the
    log-sum-exp of each query's scores in log2 units [B·heads, L + BLOCK], fp32, tail tile's padding included)."""
    batch, length, width, head_dim = _shape(qkv, heads)
    config = _launch_config(length, head_dim)
    out = qkv.new_empty(batch, length, width)
    lse = torch.empty(batch * heads, _lse_rows(length), device=qkv.device, dtype=torch.float32)
    scale = head_dim ** -0.5
    _forward_kernel[(batch * heads * config["tiles"],)](
        qkv, out, lse, length, heads, head_dim, lse.shape[1], config["tiles"], scale * math.log2(math.e),
        CAUSAL=causal, **config["meta"],
    )
    return out, lse


@_forward.register_fake
def _(qkv, heads, causal):
    batch, length, width, head_dim = _shape(qkv, heads)
    return qkv.new_empty(batch, length, width), qkv.new_empty(batch * heads, _lse_rows(length), dtype=torch.float32)


@torch.library.custom_op("stableclip::tiled_attention_backward", mutates_args=())
def _backward(
    grad_out: torch.Tensor, qkv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, heads: int, causal: bool
) -> torch.Tensor:
    """The gradient of qkv, in qkv's layout."""
    batch, length, width, head_dim = _shape(qkv, heads)
    config = _launch_config(length, head_dim)
    grad_qkv = torch.empty_like(qkv)
    delta = torch.empty_like(lse)
    scale = head_dim ** -0.5
    grid = (batch * heads * config["tiles"],)
    # dQ first: it also writes rowsum(dO ∘ O), which the dK, dV programs read for every query tile.
    _grad_query_kernel[grid](
        qkv, out, grad_out, lse, delta, grad_qkv, length, heads, head_dim, lse.shape[1], config["tiles"],
        scale, scale * math.log2(math.e), CAUSAL=causal, **config["meta"],
    )
    _grad_key_kernel[grid](
        qkv, grad_out, lse, delta, grad_qkv, length, heads, head_dim, lse.shape[1], config["tiles"],
        scale, scale * math.log2(math.e), CAUSAL=causal, **config["meta"],
    )
    return grad_qkv


@_backward.register_fake
def _(grad_out, qkv, out, lse, heads, causal):
    return torch.empty_like(qkv)


register_autograd(_forward, _backward)


def tiled_attention(qkv: torch.Tensor, heads: int, causal: bool = False) -> torch.Tensor:
    """Multi-head self-attention of qkv [B, L, 3·W] (Q, K, V side by side, each head's D = W / heads features
    contiguous, as `Attention`'s fused projection writes them), any L: the output [B, L, W], equal to
    `F.scaled_dot_product_attention` over the heads up to 16-bit rounding."""
    return run_checked(_forward, "triton_tiled", unsupported_reason(qkv, heads), qkv, heads, causal)
