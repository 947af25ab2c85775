"""Self-attention for sequences longer than one tile (ViT-L/14's and ViT-H/14's 257 tokens, ViT-B/16's 197), in
tiles of 64 rows plus one narrow tail tile, reading the fused QKV projection's output and writing the gradient of
that output directly.

Why: the SDPA kernels tile a sequence in blocks of 64 or 128 queries and keys (cuDNN's on an H200: 64 × 128
forward, 64 × 64 backward), so 257 tokens leave a last block holding one token; in blocks of 128 that is 384²
scores computed for 257² used. Here the 256 tokens that fill whole tiles go in tiles of 64, and the remainder in
a tail tile of the next power of 2 (at least 16, the smallest tensor-core tile): 272² for 257². Like
short_attention (the one-tile kernel for at most 128 tokens), it reads Q, K, V where the fused projection put
them and writes dQKV in that layout, so no copies assemble the three gradients into one.

A head whose size is not a power of 2 is held as two column blocks (ViT-H/14's 80 features as 64 + 16), so
its matmuls do not pad it to 128.

The arithmetic is FlashAttention-2's: forward with an online softmax over key tiles (fp32 scores, probabilities
rounded to 16 bits before they multiply V), saving each query's log-sum-exp; backward recomputes the
probabilities tile by tile, one program per query tile for dQ (it also writes rowsum(dO ∘ O)) and one per key
tile for dK and dV, so no program adds into another's output. For causal attention, the loops skip the tiles a
program's queries cannot see. `model.attention_backend=triton_tiled` asks for it at any length; `auto` takes it
above short_attention.AUTO_MAX_LENGTH (128) up to AUTO_MAX_LENGTH tokens (on an H200 it made ViT-L/14's compiled
step 1.02x faster and matched cuDNN on ViT-H/14's).
"""

from __future__ import annotations

import math

import torch

from src.kernels.attention.short import _shape, kernel_unsupported_reason, power_of_2, register_autograd, run_checked

try:
    import triton
    import triton.language as tl

    from src.kernels.attention.short import _dot, _store_rows
except ImportError:
    triton = None

# Launch settings (bench/short_attention.py --tiled-configs measures others): rows of each program's tile (its
# queries, or for dK and dV its keys); rows of the other side taken per loop step (None: BLOCK; a divisor of it,
# at least 16); warps per program; software-pipelining stages of the loops (None: 3 where a head's first column
# block has at most 64 features, e.g. 80 as 64 + 16, 1.10x faster than 2 stages on an H200; 2 for wider blocks,
# whose 3 stages ran 1.35x slower, measured with ViT-H/14's heads padded to 128 columns).
BLOCK = 64
STEP = None
WARPS = 4
STAGES = None
AUTO_MAX_LENGTH = 320  # the longest sequence `auto` gives this kernel (measured at 197 and 257 tokens)


def applies(qkv: torch.Tensor, heads: int) -> bool:
    """Whether `model.attention_backend=auto` takes the kernel for `qkv`: on a GPU (not the interpreter), in
    16 bits, up to AUTO_MAX_LENGTH tokens."""
    return (qkv.device.type == "cuda" and qkv.shape[1] <= AUTO_MAX_LENGTH
            and kernel_unsupported_reason(qkv, heads) is None)


def _tiles(length: int, block: int | None = None) -> tuple[int, int]:
    """(full tiles of `block` rows (BLOCK by default), rows of the tail tile or 0 where there is none)."""
    full, rest = divmod(length, block or BLOCK)
    return full, power_of_2(rest) if rest else 0


def _column_blocks(head_dim: int) -> tuple[int, int]:
    """(D0, D1): a head's features as a power-of-2 block and a padded rest (0 where the head is a power of 2),
    where that pads less than rounding the whole head up: 80 -> (64, 16), 96 -> (64, 32), 64 -> (64, 0)."""
    whole = power_of_2(head_dim)
    if whole == head_dim or head_dim <= 16:
        return whole, 0
    first = whole // 2
    rest = power_of_2(head_dim - first)
    return (first, rest) if first + rest < whole else (whole, 0)


def _lse_rows(length) -> int:
    """Row stride of the per-query statistics (log-sum-exp, rowsum(dO ∘ O)): room for the tail tile's padding,
    which is under BLOCK rows. Plain arithmetic, so that it also holds for a symbolic length under dynamic
    shapes (the fake implementation)."""
    return length + BLOCK


if triton is not None:

    @triton.jit
    def _load_rows(base, rows, cols, length, head_dim, stride_token):
        """Rows `rows`, columns `cols` of one head's Q, K, V, O or dO, zero past the sequence and the head."""
        inside = (rows[:, None] < length) & (cols[None, :] < head_dim)
        return tl.load(base + rows[:, None] * stride_token + cols[None, :], mask=inside, other=0.0)

    # A head's features are held as two column blocks: D0 (a power of 2) and D1 (the rest, padded to a power of 2;
    # 0 where D0 is the whole head), so that ViT-H/14's heads of 80 cost 64 + 16 columns, not 128. Where D1 is 0
    # the second block is a placeholder that no code reads.

    @triton.jit
    def _load_head(base, rows, length, head_dim, stride_token, D0: tl.constexpr, D1: tl.constexpr):
        x0 = _load_rows(base, rows, tl.arange(0, D0), length, head_dim, stride_token)
        x1 = 0.0
        if D1 > 0:
            x1 = _load_rows(base, rows, D0 + tl.arange(0, D1), length, head_dim, stride_token)
        return x0, x1

    @triton.jit
    def _store_head(base, x0, x1, rows, length, head_dim, stride_token, D0: tl.constexpr, D1: tl.constexpr):
        _store_rows(base, x0, rows, tl.arange(0, D0), length, head_dim, stride_token)
        if D1 > 0:
            _store_rows(base, x1, rows, D0 + tl.arange(0, D1), length, head_dim, stride_token)

    @triton.jit
    def _dot_t(a0, a1, b0, b1, D1: tl.constexpr):
        """a · bᵀ over the head's features, both held as column blocks."""
        product = _dot(a0, tl.trans(b0))
        if D1 > 0:
            product += _dot(a1, tl.trans(b1))
        return product

    @triton.jit
    def _zeros_head(ROWS: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr):
        """fp32 accumulators for a head's two column blocks; with no second block, a 1 × 1 placeholder (an
        accumulator is carried through loops, which takes a tensor)."""
        x1 = tl.zeros([1, 1], tl.float32)
        if D1 > 0:
            x1 = tl.zeros([ROWS, D1], tl.float32)
        return tl.zeros([ROWS, D0], tl.float32), x1

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
    def _key_end(full_keys, start, ROWS: tl.constexpr, CAUSAL: tl.constexpr):
        """Where the loop over whole key tiles stops for the queries start .. start + ROWS - 1: for causal
        attention, after the tile holding the last of them, since no query sees a later key. (The tail key tile
        is always visited: for all but the last query tile it is fully masked, a waste of at most one tail.)"""
        end = full_keys
        if CAUSAL:
            end = tl.minimum(full_keys, start + ROWS)
        return end

    @triton.jit
    def _forward_tile(
        q0, q1, row_max, row_sum, acc0, acc1, k_base, v_base, queries, start, length, head_dim, stride, scale_log2,
        COLS: tl.constexpr, MASK_KEYS: tl.constexpr, CAUSAL: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr,
    ):
        """One key tile of the online softmax: the running max, sum and unnormalized output, updated."""
        keys = start + tl.arange(0, COLS)
        k0, k1 = _load_head(k_base, keys, length, head_dim, stride, D0, D1)
        v0, v1 = _load_head(v_base, keys, length, head_dim, stride, D0, D1)
        s = _masked(_dot_t(q0, q1, k0, k1, D1) * scale_log2, queries, keys, length, MASK_KEYS, CAUSAL)
        new_max = tl.maximum(row_max, tl.max(s, 1))
        rescale = tl.exp2(row_max - new_max)
        p = tl.exp2(s - new_max[:, None])
        row_sum = row_sum * rescale + tl.sum(p, 1)
        acc0 = acc0 * rescale[:, None] + _dot(p.to(v0.dtype), v0)
        if D1 > 0:
            acc1 = acc1 * rescale[:, None] + _dot(p.to(v1.dtype), v1)
        return new_max, row_sum, acc0, acc1

    @triton.jit
    def _forward_rows(
        qkv, out, lse, program, start, length, heads, head_dim, lse_stride, scale_log2,
        ROWS: tl.constexpr, STEP: tl.constexpr, STEP_TAIL: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr,
        CAUSAL: tl.constexpr,
    ):
        sample, head = program // heads, program % heads
        width = heads * head_dim
        stride = 3 * width
        base = qkv + sample.to(tl.int64) * length * stride + head * head_dim
        queries = start + tl.arange(0, ROWS)
        q0, q1 = _load_head(base, queries, length, head_dim, stride, D0, D1)
        row_max = tl.full([ROWS], float("-inf"), tl.float32)
        row_sum = tl.zeros([ROWS], tl.float32)
        acc0, acc1 = _zeros_head(ROWS, D0, D1)
        full_keys = length // STEP * STEP
        for key_start in range(0, _key_end(full_keys, start, ROWS, CAUSAL), STEP):
            row_max, row_sum, acc0, acc1 = _forward_tile(
                q0, q1, row_max, row_sum, acc0, acc1, base + width, base + 2 * width, queries, key_start, length,
                head_dim, stride, scale_log2, COLS=STEP, MASK_KEYS=False, CAUSAL=CAUSAL, D0=D0, D1=D1)
        if STEP_TAIL > 0:
            row_max, row_sum, acc0, acc1 = _forward_tile(
                q0, q1, row_max, row_sum, acc0, acc1, base + width, base + 2 * width, queries, full_keys, length,
                head_dim, stride, scale_log2, COLS=STEP_TAIL, MASK_KEYS=True, CAUSAL=CAUSAL, D0=D0, D1=D1)
        out_base = out + sample.to(tl.int64) * length * width + head * head_dim
        _store_head(out_base, acc0 / row_sum[:, None], acc1 / row_sum[:, None], queries, length, head_dim, width,
                    D0, D1)
        tl.store(lse + program.to(tl.int64) * lse_stride + queries, row_max + tl.log2(row_sum))

    @triton.jit
    def _tiled_forward_kernel(
        qkv, out, lse, length, heads, head_dim, lse_stride, tiles, scale_log2,
        BLOCK: tl.constexpr, TAIL: tl.constexpr, STEP: tl.constexpr, STEP_TAIL: tl.constexpr, D0: tl.constexpr,
        D1: tl.constexpr, CAUSAL: tl.constexpr,
    ):
        # One program per (sample, head, query tile), the tiles of one head next to each other so that its
        # keys and values stay in L2 between them.
        program, tile = tl.program_id(0) // tiles, tl.program_id(0) % tiles
        if tile < length // BLOCK:
            _forward_rows(qkv, out, lse, program, tile * BLOCK, length, heads, head_dim, lse_stride, scale_log2,
                          ROWS=BLOCK, STEP=STEP, STEP_TAIL=STEP_TAIL, D0=D0, D1=D1, CAUSAL=CAUSAL)
        else:
            if TAIL > 0:
                _forward_rows(qkv, out, lse, program, tile * BLOCK, length, heads, head_dim, lse_stride,
                              scale_log2, ROWS=TAIL, STEP=STEP, STEP_TAIL=STEP_TAIL, D0=D0, D1=D1, CAUSAL=CAUSAL)

    @triton.jit
    def _grad_query_tile(
        dq0, dq1, q0, q1, do0, do1, row_lse, delta, k_base, v_base, queries, start, length, head_dim, stride,
        scale_log2, COLS: tl.constexpr, MASK_KEYS: tl.constexpr, CAUSAL: tl.constexpr, D0: tl.constexpr,
        D1: tl.constexpr,
    ):
        keys = start + tl.arange(0, COLS)
        k0, k1 = _load_head(k_base, keys, length, head_dim, stride, D0, D1)
        v0, v1 = _load_head(v_base, keys, length, head_dim, stride, D0, D1)
        # Keys past the sequence are masked here too: exp2(0 - lse) can overflow where every score of a query
        # is very negative, and inf · 0 (their zero K rows) would be NaN.
        s = _masked(_dot_t(q0, q1, k0, k1, D1) * scale_log2, queries, keys, length, MASK_KEYS, CAUSAL)
        p = tl.exp2(s - row_lse[:, None])
        ds = (p * (_dot_t(do0, do1, v0, v1, D1) - delta[:, None])).to(k0.dtype)
        dq0 += _dot(ds, k0)
        if D1 > 0:
            dq1 += _dot(ds, k1)
        return dq0, dq1

    @triton.jit
    def _grad_query_rows(
        qkv, out, grad_out, lse, delta, grad_qkv, program, start, length, heads, head_dim, lse_stride, scale,
        scale_log2, ROWS: tl.constexpr, STEP: tl.constexpr, STEP_TAIL: tl.constexpr, D0: tl.constexpr,
        D1: tl.constexpr, CAUSAL: tl.constexpr,
    ):
        sample, head = program // heads, program % heads
        width = heads * head_dim
        stride = 3 * width
        qkv_offset = sample.to(tl.int64) * length * stride + head * head_dim
        out_offset = sample.to(tl.int64) * length * width + head * head_dim
        base = qkv + qkv_offset
        queries = start + tl.arange(0, ROWS)
        q0, q1 = _load_head(base, queries, length, head_dim, stride, D0, D1)
        do0, do1 = _load_head(grad_out + out_offset, queries, length, head_dim, width, D0, D1)
        o0, o1 = _load_head(out + out_offset, queries, length, head_dim, width, D0, D1)
        row_delta = tl.sum(o0.to(tl.float32) * do0.to(tl.float32), 1)  # rowsum(dO ∘ O) = rowsum(P ∘ dP)
        if D1 > 0:
            row_delta += tl.sum(o1.to(tl.float32) * do1.to(tl.float32), 1)
        tl.store(delta + program.to(tl.int64) * lse_stride + queries, row_delta)
        row_lse = tl.load(lse + program.to(tl.int64) * lse_stride + queries)
        dq0, dq1 = _zeros_head(ROWS, D0, D1)
        full_keys = length // STEP * STEP
        for key_start in range(0, _key_end(full_keys, start, ROWS, CAUSAL), STEP):
            dq0, dq1 = _grad_query_tile(
                dq0, dq1, q0, q1, do0, do1, row_lse, row_delta, base + width, base + 2 * width, queries, key_start,
                length, head_dim, stride, scale_log2, COLS=STEP, MASK_KEYS=False, CAUSAL=CAUSAL, D0=D0, D1=D1)
        if STEP_TAIL > 0:
            dq0, dq1 = _grad_query_tile(
                dq0, dq1, q0, q1, do0, do1, row_lse, row_delta, base + width, base + 2 * width, queries, full_keys,
                length, head_dim, stride, scale_log2, COLS=STEP_TAIL, MASK_KEYS=True, CAUSAL=CAUSAL, D0=D0, D1=D1)
        _store_head(grad_qkv + qkv_offset, dq0 * scale, dq1 * scale, queries, length, head_dim, stride, D0, D1)

    @triton.jit
    def _tiled_grad_query_kernel(
        qkv, out, grad_out, lse, delta, grad_qkv, length, heads, head_dim, lse_stride, tiles, scale, scale_log2,
        BLOCK: tl.constexpr, TAIL: tl.constexpr, STEP: tl.constexpr, STEP_TAIL: tl.constexpr, D0: tl.constexpr,
        D1: tl.constexpr, CAUSAL: tl.constexpr,
    ):
        program, tile = tl.program_id(0) // tiles, tl.program_id(0) % tiles
        if tile < length // BLOCK:
            _grad_query_rows(qkv, out, grad_out, lse, delta, grad_qkv, program, tile * BLOCK, length, heads,
                             head_dim, lse_stride, scale, scale_log2, ROWS=BLOCK, STEP=STEP, STEP_TAIL=STEP_TAIL,
                             D0=D0, D1=D1, CAUSAL=CAUSAL)
        else:
            if TAIL > 0:
                _grad_query_rows(qkv, out, grad_out, lse, delta, grad_qkv, program, tile * BLOCK, length, heads,
                                 head_dim, lse_stride, scale, scale_log2, ROWS=TAIL, STEP=STEP, STEP_TAIL=STEP_TAIL,
                                 D0=D0, D1=D1, CAUSAL=CAUSAL)

    @triton.jit
    def _grad_key_tile(
        dk0, dk1, dv0, dv1, k0, k1, v0, v1, q_base, do_base, lse_base, delta_base, keys, start, length, head_dim,
        stride, width, scale_log2, ROWS: tl.constexpr, CAUSAL: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr,
    ):
        """One query tile's share of this key tile's dK and dV. Keys past the sequence need no mask: each
        key's gradient depends only on its own column of P, and those rows are not stored. Queries past the
        sequence add nothing: their dO and rowsum(dO ∘ O) are zero."""
        queries = start + tl.arange(0, ROWS)
        q0, q1 = _load_head(q_base, queries, length, head_dim, stride, D0, D1)
        do0, do1 = _load_head(do_base, queries, length, head_dim, width, D0, D1)
        row_lse = tl.load(lse_base + queries)
        row_delta = tl.load(delta_base + queries)
        s = _masked(_dot_t(q0, q1, k0, k1, D1) * scale_log2, queries, keys, length, False, CAUSAL)
        p = tl.exp2(s - row_lse[:, None])
        # dV before dS, as in the kernel without a second column block: the other order keeps both transposed
        # tiles alive at once and needs 20% more shared memory.
        dv0 += _dot(tl.trans(p.to(do0.dtype)), do0)
        if D1 > 0:
            dv1 += _dot(tl.trans(p.to(do1.dtype)), do1)
        ds = p * (_dot_t(do0, do1, v0, v1, D1) - row_delta[:, None])
        dk0 += _dot(tl.trans(ds.to(q0.dtype)), q0)
        if D1 > 0:
            dk1 += _dot(tl.trans(ds.to(q1.dtype)), q1)
        return dk0, dk1, dv0, dv1

    @triton.jit
    def _grad_key_rows(
        qkv, grad_out, lse, delta, grad_qkv, program, start, length, heads, head_dim, lse_stride, scale, scale_log2,
        COLS: tl.constexpr, STEP: tl.constexpr, STEP_TAIL: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr,
        CAUSAL: tl.constexpr,
    ):
        sample, head = program // heads, program % heads
        width = heads * head_dim
        stride = 3 * width
        qkv_offset = sample.to(tl.int64) * length * stride + head * head_dim
        base = qkv + qkv_offset
        do_base = grad_out + sample.to(tl.int64) * length * width + head * head_dim
        lse_base, delta_base = lse + program.to(tl.int64) * lse_stride, delta + program.to(tl.int64) * lse_stride
        keys = start + tl.arange(0, COLS)
        k0, k1 = _load_head(base + width, keys, length, head_dim, stride, D0, D1)
        v0, v1 = _load_head(base + 2 * width, keys, length, head_dim, stride, D0, D1)
        dk0, dk1 = _zeros_head(COLS, D0, D1)
        dv0, dv1 = _zeros_head(COLS, D0, D1)
        full_queries = length // STEP * STEP
        query_begin = 0
        if CAUSAL:  # queries before this key tile see none of its keys
            query_begin = start
        for query_start in range(query_begin, full_queries, STEP):
            dk0, dk1, dv0, dv1 = _grad_key_tile(
                dk0, dk1, dv0, dv1, k0, k1, v0, v1, base, do_base, lse_base, delta_base, keys, query_start, length,
                head_dim, stride, width, scale_log2, ROWS=STEP, CAUSAL=CAUSAL, D0=D0, D1=D1)
        if STEP_TAIL > 0:
            dk0, dk1, dv0, dv1 = _grad_key_tile(
                dk0, dk1, dv0, dv1, k0, k1, v0, v1, base, do_base, lse_base, delta_base, keys, full_queries, length,
                head_dim, stride, width, scale_log2, ROWS=STEP_TAIL, CAUSAL=CAUSAL, D0=D0, D1=D1)
        grad_base = grad_qkv + qkv_offset
        _store_head(grad_base + width, dk0 * scale, dk1 * scale, keys, length, head_dim, stride, D0, D1)
        _store_head(grad_base + 2 * width, dv0, dv1, keys, length, head_dim, stride, D0, D1)

    @triton.jit
    def _tiled_grad_key_kernel(
        qkv, grad_out, lse, delta, grad_qkv, length, heads, head_dim, lse_stride, tiles, scale, scale_log2,
        BLOCK: tl.constexpr, TAIL: tl.constexpr, STEP: tl.constexpr, STEP_TAIL: tl.constexpr, D0: tl.constexpr,
        D1: tl.constexpr, CAUSAL: tl.constexpr,
    ):
        program, tile = tl.program_id(0) // tiles, tl.program_id(0) % tiles
        if tile < length // BLOCK:
            _grad_key_rows(qkv, grad_out, lse, delta, grad_qkv, program, tile * BLOCK, length, heads, head_dim,
                           lse_stride, scale, scale_log2, COLS=BLOCK, STEP=STEP, STEP_TAIL=STEP_TAIL, D0=D0, D1=D1,
                           CAUSAL=CAUSAL)
        else:
            if TAIL > 0:
                _grad_key_rows(qkv, grad_out, lse, delta, grad_qkv, program, tile * BLOCK, length, heads,
                               head_dim, lse_stride, scale, scale_log2, COLS=TAIL, STEP=STEP, STEP_TAIL=STEP_TAIL,
                               D0=D0, D1=D1, CAUSAL=CAUSAL)


def _launch_config(length: int, head_dim: int) -> dict:
    """The kernels' shared launch arguments: tiles per head and the compile-time settings."""
    step = STEP or BLOCK
    if BLOCK % step or step < 16 or step != power_of_2(step):
        raise ValueError(f"tiled_attention.STEP={step} must be a power of 2 of at least 16 that divides BLOCK={BLOCK}")
    full, tail = _tiles(length)
    d0, d1 = _column_blocks(head_dim)
    stages = STAGES or (3 if d0 <= 64 else 2)
    return {"tiles": full + (tail > 0), "meta": {
        "BLOCK": BLOCK, "TAIL": tail, "STEP": step, "STEP_TAIL": _tiles(length, step)[1], "D0": d0, "D1": d1,
        "num_warps": WARPS, "num_stages": stages}}


@torch.library.custom_op("stableclip::tiled_attention_forward", mutates_args=())
def _forward(qkv: torch.Tensor, heads: int, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv [B, L, 3·W] (contiguous, laid out as the QKV projection writes it) -> (out [B, L, W], the
    log-sum-exp of each query's scores in log2 units [B·heads, L + BLOCK], fp32, tail tile's padding included)."""
    batch, length, width, head_dim = _shape(qkv, heads)
    config = _launch_config(length, head_dim)
    out = qkv.new_empty(batch, length, width)
    lse = torch.empty(batch * heads, _lse_rows(length), device=qkv.device, dtype=torch.float32)
    scale = head_dim ** -0.5
    _tiled_forward_kernel[(batch * heads * config["tiles"],)](
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
    _tiled_grad_query_kernel[grid](
        qkv, out, grad_out, lse, delta, grad_qkv, length, heads, head_dim, lse.shape[1], config["tiles"],
        scale, scale * math.log2(math.e), CAUSAL=causal, **config["meta"],
    )
    _tiled_grad_key_kernel[grid](
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
    return run_checked(_forward, "triton_tiled", kernel_unsupported_reason(qkv, heads), qkv, heads, causal)
