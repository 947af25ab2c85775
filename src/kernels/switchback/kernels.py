"""Triton kernels of SwitchBack's `cuda` backend, with the arithmetic of `reference.py` step for step.

- `quantize_rows`: one pass over X (or G): each row's absmax, scale, rounding and cast, and optionally the
  column sums of the input (G's column sums are the bias gradient, so G is read once instead of twice).
- `quantize_tensor`: W with one scale (an absmax pass with an atomic max, then a quantize pass), writing W
  and, on request, Wᵀ: the input-gradient matmul needs W with its output dimension contiguous, because
  Hopper's 8-bit tensor-core instructions read both operands along the inner dimension. The scale is written
  once per row and once per column of W, the vectors cuBLAS's row-wise scaled matmuls take.
- `int8_matmul`: int8 × int8 → int32 tiles, dequantized by the row and column scales and biased in the
  epilogue, so the int32 product never goes to memory.

Rounding to integers: libdevice's rint on the GPU. Triton's CPU interpreter has no libdevice, so there
`x + 1.5·2²³ − 1.5·2²³` does it (exact for float32 below 2²², ties to even, as `torch.round`).
The GPU's cast to e4m3 rounds to nearest even; the interpreter's does not, so there fp8 values are first
rounded onto the e4m3 grid the same way (scaled by their power-of-two spacing), which makes its cast exact.
The per-row reciprocal is `div_rn` (correctly rounded, as PyTorch's), since Triton's `/` is approximate.
The kernels run on CPU tensors under TRITON_INTERPRET=1, which is how CI tests them.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:
    triton = None
try:  # host-side TMA descriptors: Triton 3.4 and later
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None

from src.kernels.switchback.reference import FP8_DTYPE
from src.kernels.triton_interpreter import interpreting

_ROWS_PER_PROGRAM = 64  # rows one program quantizes when it also sums columns: the rows behind each partial sum
_TILE = 64  # square tiles of the tensor-wise quantizer


def require_triton() -> None:
    if triton is None:
        raise RuntimeError(
            "model.linear_backend=cuda needs Triton (installed with PyTorch's CUDA wheels on Linux): install "
            "triton, or use model.linear_backend=reference"
        )


if triton is not None:
    _ROUND_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23
    _INTERPRETING = tl.constexpr(interpreting())

    @triton.jit
    def _round_to_e4m3(v):
        """v (|v| <= 448) rounded to the nearest e4m3 value, ties to even: to a multiple of its spacing,
        2^(exponent - 3) for normal values and 2^-9 below e4m3's smallest normal, 2^-6."""
        exponent_bits = v.to(tl.int32, bitcast=True) & 0x7F800000
        spacing_bits = tl.maximum(exponent_bits - (3 << 23), (127 - 9) << 23)
        spacing = spacing_bits.to(tl.float32, bitcast=True)
        inverse = ((254 << 23) - spacing_bits).to(tl.float32, bitcast=True)  # 2^-k: products by it are exact
        rounded = tl.abs(((v * inverse + _ROUND_MAGIC) - _ROUND_MAGIC) * spacing)
        return tl.where(v < 0, -rounded, rounded)  # tiny negatives round to -0, as PyTorch's cast gives

    @triton.jit
    def _quantize_values(x, amax, FP8: tl.constexpr):
        """x (float32) scaled by its absmax and cast: x · (448 · (1/amax)) to e4m3, x · (127 · (1/amax)) to int8."""
        inverse = tl.math.div_rn(1.0, amax)
        if FP8:
            v = tl.minimum(tl.maximum(x * (448.0 * inverse), -448.0), 448.0)
            if _INTERPRETING:
                v = _round_to_e4m3(v)
            q = v.to(tl.float8e4nv)
        else:
            v = x * (127.0 * inverse)
            if _INTERPRETING:
                v = (v + _ROUND_MAGIC) - _ROUND_MAGIC
            else:  # not the magic number: the GPU compiler would fuse x · s + magic into one FMA, one rounding
                v = libdevice.rint(v)
            q = tl.minimum(tl.maximum(v, -127.0), 127.0).to(tl.int8)
        return q

    @triton.jit
    def _nonzero(amax):
        return tl.where(amax > 0, amax, 1.0)  # an all-zero row quantizes to zeros, not NaN

    @triton.jit
    def _dequantize_scale(amax, FP8: tl.constexpr):
        scale = amax
        if FP8:
            scale = amax * (1.0 / 448.0)
        return scale

    def _rows_configs():
        if interpreting():
            return [triton.Config({"BLOCK_R": 2}, num_warps=4)]
        return [triton.Config({"BLOCK_R": r}, num_warps=w) for r in (1, 2, 4, 8) for w in (4, 8, 16)]

    def _tiles_that_fit(configs, named_args, **kwargs):
        """At most 16K float32 values per tile: more spills registers."""
        block_c = {**named_args, **kwargs}["BLOCK_C"]
        fit = [c for c in configs if c.kwargs["BLOCK_R"] * block_c <= 16384]
        return fit or configs[:1]

    @triton.autotune(configs=_rows_configs(), key=["C", "FP8", "COLSUM"],
                     prune_configs_by={"early_config_prune": _tiles_that_fit})
    # Without column sums a program takes one tile of rows, so that many programs keep many loads in flight;
    # with them it walks _ROWS_PER_PROGRAM rows, which bounds the partial sums written per column.
    @triton.heuristics({"ROWS": lambda args: _ROWS_PER_PROGRAM if args["COLSUM"] else args["BLOCK_R"]})
    @triton.jit
    def _quantize_rows_kernel(
        x_ptr, q_ptr, scale_ptr, colsum_ptr, R, C, stride_r, stride_c,
        ROWS: tl.constexpr, BLOCK_C: tl.constexpr, FP8: tl.constexpr, COLSUM: tl.constexpr, BLOCK_R: tl.constexpr,
    ):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_C)
        colsum = tl.zeros((BLOCK_C,), dtype=tl.float32)
        # Software-pipelined: the next rows load while these are reduced and stored (1.2-1.5x faster with column
        # sums, where a program walks many rows; docs/BENCHMARKS.md).
        for start in tl.range(0, ROWS, BLOCK_R, num_stages=3):
            rows = pid.to(tl.int64) * ROWS + start + tl.arange(0, BLOCK_R)
            mask = (rows[:, None] < R) & (cols[None, :] < C)
            x = tl.load(x_ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=mask, other=0.0)
            x = x.to(tl.float32)
            amax = _nonzero(tl.max(tl.abs(x), axis=1))
            tl.store(q_ptr + rows[:, None] * C + cols[None, :], _quantize_values(x, amax[:, None], FP8), mask=mask)
            tl.store(scale_ptr + rows, _dequantize_scale(amax, FP8), mask=rows < R)
            if COLSUM:
                colsum += tl.sum(x, axis=0)
        if COLSUM:
            tl.store(colsum_ptr + pid.to(tl.int64) * C + cols, colsum, mask=cols < C)

    @triton.jit
    def _absmax_kernel(x_ptr, amax_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offsets, mask=offsets < n, other=0.0).to(tl.float32)
        tl.atomic_max(amax_ptr, tl.max(tl.abs(x), axis=0))

    @triton.jit
    def _quantize_tensor_kernel(
        x_ptr, amax_ptr, q_ptr, qt_ptr, row_scale_ptr, column_scale_ptr, R, C,
        TILE: tl.constexpr, FP8: tl.constexpr, TRANSPOSE: tl.constexpr,
    ):
        rows = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
        cols = tl.program_id(1).to(tl.int64) * TILE + tl.arange(0, TILE)
        mask = (rows[:, None] < R) & (cols[None, :] < C)
        amax = _nonzero(tl.load(amax_ptr))
        x = tl.load(x_ptr + rows[:, None] * C + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        q = _quantize_values(x, amax, FP8)
        tl.store(q_ptr + rows[:, None] * C + cols[None, :], q, mask=mask)
        if TRANSPOSE:
            # The tile read again in transposed order (W is small) rather than tl.trans of 8-bit values, which
            # gave wrong bytes on an H200; the stores stay contiguous along qᵀ's rows.
            mask_t = (cols[:, None] < C) & (rows[None, :] < R)
            xt = tl.load(x_ptr + rows[None, :] * C + cols[:, None], mask=mask_t, other=0.0).to(tl.float32)
            tl.store(qt_ptr + cols[:, None] * R + rows[None, :], _quantize_values(xt, amax, FP8), mask=mask_t)
        scale = _dequantize_scale(amax, FP8) + tl.zeros((TILE,), dtype=tl.float32)
        if tl.program_id(1) == 0:
            tl.store(row_scale_ptr + rows, scale, mask=rows < R)
        if tl.program_id(0) == 0:
            tl.store(column_scale_ptr + cols, scale, mask=cols < C)

    def _matmul_configs(pre_hook=None):
        """The int8 matmuls' autotuning space; `pre_hook` adapts per-config state (the TMA boxes)."""
        if interpreting():
            return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4}, pre_hook=pre_hook)]
        shapes = [(128, 256, 128, 8, 3), (256, 128, 128, 8, 3), (128, 128, 128, 4, 4), (128, 256, 64, 8, 4),
                  (256, 128, 64, 8, 4), (128, 128, 256, 8, 3), (128, 256, 128, 8, 4), (256, 256, 64, 8, 3)]
        return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8}, num_warps=w,
                              num_stages=s, pre_hook=pre_hook) for m, n, k, w, s in shapes]

    @triton.jit
    def _grouped_tile(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """Tile number `tile`'s (row-block, column-block): GROUP_M row-blocks share each column-block while it is
        in L2."""
        grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
        first_m = tile // (GROUP_M * grid_n) * GROUP_M
        group_size = min(grid_m - first_m, GROUP_M)
        return first_m + (tile % (GROUP_M * grid_n)) % group_size, (tile % (GROUP_M * grid_n)) // group_size

    @triton.jit
    def _dequantize_store(
        acc, rm, rn, M, N, sa_ptr, sb_ptr, bias_ptr, out_ptr, stride_om, stride_on,
        SB_PER_COLUMN: tl.constexpr, HAS_BIAS: tl.constexpr,
    ):
        """Dequantize as reference.int8_matmul_dequant does, acc · (scale_a · scale_b · (1/127²)) + bias, and
        store the rows `rm` and columns `rn` that lie inside [M, N]."""
        sa = tl.load(sa_ptr + rm, mask=rm < M, other=1.0)
        sb = tl.load(sb_ptr + rn, mask=rn < N, other=1.0) if SB_PER_COLUMN else tl.load(sb_ptr)
        out = acc.to(tl.float32) * (sa[:, None] * sb * (1.0 / 16129.0))
        if HAS_BIAS:
            out += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :] * stride_on,
                 out.to(out_ptr.dtype.element_ty), mask=mask)

    # Tuned per power-of-two bucket of M (M_BUCKET, not read by the kernels), not per row count, and compiled
    # without specializing on M (1, a multiple of 16, or neither): an evaluation's partial and prompt batches would
    # otherwise benchmark every config for each new count and compile every config again for each new kind
    # (about 9 s a kind on an H100, docs/switchback.md).
    @triton.autotune(configs=_matmul_configs(), key=["M_BUCKET", "N", "K", "HAS_BIAS"])
    @triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
    @triton.jit(do_not_specialize=["M", "M_BUCKET"])
    def _int8_matmul_kernel(
        a_ptr, b_ptr, out_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, K, M_BUCKET,
        stride_am, stride_bn, stride_om, stride_on, SB_PER_COLUMN: tl.constexpr,
        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
    ):
        pid_m, pid_n = _grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
        rm = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        # Rows and columns past the edge wrap around instead of being masked: the loads stay unmasked and
        # vectorised, and what they compute is never stored. Both operands are contiguous along K.
        a_ptrs = a_ptr + (rm % M)[:, None] * stride_am + rk[None, :]
        b_ptrs = b_ptr + rk[:, None] + (rn % N)[None, :] * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            if EVEN_K:
                a, b = tl.load(a_ptrs), tl.load(b_ptrs)
            else:
                a = tl.load(a_ptrs, mask=rk[None, :] < K - k * BLOCK_K, other=0)
                b = tl.load(b_ptrs, mask=rk[:, None] < K - k * BLOCK_K, other=0)
            acc = tl.dot(a, b, acc, out_dtype=tl.int32)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        _dequantize_store(acc, rm, rn, M, N, sa_ptr, sb_ptr, bias_ptr, out_ptr, stride_om, stride_on,
                          SB_PER_COLUMN, HAS_BIAS)

    def _set_block_shapes(nargs: dict) -> None:
        """The TMA descriptors' box shapes follow the config being tried."""
        nargs["a_desc"].block_shape = [nargs["BLOCK_M"], nargs["BLOCK_K"]]
        nargs["b_desc"].block_shape = [nargs["BLOCK_N"], nargs["BLOCK_K"]]

    @triton.autotune(configs=_matmul_configs(pre_hook=_set_block_shapes), key=["M_BUCKET", "N", "K", "HAS_BIAS"])
    @triton.jit(do_not_specialize=["M", "M_BUCKET"])
    def _int8_matmul_tma_kernel(
        a_desc, b_desc, out_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, K, M_BUCKET, stride_om, stride_on,
        SB_PER_COLUMN: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        """`_int8_matmul_kernel` with the operands loaded by Hopper's tensor memory accelerator (TMA): the
        copy engine fetches whole tiles into shared memory, zero-filled past the edges, while the warps
        multiply. B is read as [N, K], contiguous along K. Persistent: one program per SM walks the output
        tiles, and the flattened loop lets the next tile's loads start during this tile's epilogue (measured
        at the MLP's shapes with bf16 operands: 0.88-0.98x cuBLAS's time against 0.73-0.93x one tile per
        program, docs/BENCHMARKS.md)."""
        tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        k_steps = tl.cdiv(K, BLOCK_K)
        for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=True):
            pid_m, pid_n = _grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
            for k in range(0, k_steps):
                a = a_desc.load([off_m, k * BLOCK_K])
                b = b_desc.load([off_n, k * BLOCK_K])
                acc = tl.dot(a, b.T, acc, out_dtype=tl.int32)
            rm = off_m.to(tl.int64) + tl.arange(0, BLOCK_M)
            rn = off_n.to(tl.int64) + tl.arange(0, BLOCK_N)
            _dequantize_store(acc, rm, rn, M, N, sa_ptr, sb_ptr, bias_ptr, out_ptr, stride_om, stride_on,
                              SB_PER_COLUMN, HAS_BIAS)


def _quantized_dtype(fp8: bool) -> torch.dtype:
    return FP8_DTYPE if fp8 else torch.int8


def quantize_rows(
    x: torch.Tensor, fp8: bool, column_sums: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Row-wise quantization of a 2-D tensor (any strides; the output is contiguous): (q, scale [R, 1]
    float32, and with `column_sums` the float32 sums over rows [C], else None)."""
    require_triton()
    rows, cols = x.shape
    q = torch.empty((rows, cols), dtype=_quantized_dtype(fp8), device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    partial = torch.empty((triton.cdiv(rows, _ROWS_PER_PROGRAM), cols) if column_sums else (1,),
                          dtype=torch.float32, device=x.device)
    _quantize_rows_kernel[lambda meta: (triton.cdiv(rows, meta["ROWS"]),)](
        x, q, scale, partial, rows, cols, x.stride(0), x.stride(1),
        BLOCK_C=triton.next_power_of_2(cols), FP8=fp8, COLSUM=column_sums,
    )
    # Partial sums of a fixed number of rows, added in a fixed order: deterministic, unlike atomics.
    return q, scale, partial.sum(0) if column_sums else None


def quantize_tensor(
    x: torch.Tensor, fp8: bool, transpose: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Tensor-wise quantization of a contiguous 2-D tensor [R, C]: (q, qᵀ contiguous or None, the scale repeated
    per row [1, R], and per column [1, C]). The vectors save the scaled matmuls a copy each."""
    require_triton()
    rows, cols = x.shape
    x = x.contiguous()
    amax = torch.zeros(1, dtype=torch.float32, device=x.device)
    block = 4096
    _absmax_kernel[(triton.cdiv(x.numel(), block),)](x, amax, x.numel(), BLOCK=block, num_warps=8)
    q = torch.empty((rows, cols), dtype=_quantized_dtype(fp8), device=x.device)
    qt = torch.empty((cols, rows), dtype=q.dtype, device=x.device) if transpose else None
    row_scale = torch.empty((1, rows), dtype=torch.float32, device=x.device)
    column_scale = torch.empty((1, cols), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(rows, _TILE), triton.cdiv(cols, _TILE))
    _quantize_tensor_kernel[grid](x, amax, q, q if qt is None else qt, row_scale, column_scale, rows, cols,
                                  TILE=_TILE, FP8=fp8, TRANSPOSE=transpose)
    return q, qt, row_scale, column_scale


def int8_matmul(
    qa: torch.Tensor, scale_a: torch.Tensor, qb: torch.Tensor, scale_b: torch.Tensor,
    bias: torch.Tensor | None, out_dtype: torch.dtype, kernel: str = "auto",
) -> torch.Tensor:
    """(qa @ qb) · scale_a · scale_b / 127² + bias, as `reference.int8_matmul_dequant`. qa [M, K] and qb
    [K, N] int8, both best contiguous along K (else copied so); scale_a [M, 1]; scale_b [1, N] or [1, 1];
    float32 scales. kernel: "tma" (Hopper's tensor memory accelerator loads), "pointer" (plain loads, any
    GPU), or "auto": TMA where it can run."""
    require_triton()
    (m, k), (k2, n) = qa.shape, qb.shape
    if k != k2:
        raise ValueError(f"int8_matmul: inner dimensions differ, {tuple(qa.shape)} @ {tuple(qb.shape)}")
    # Hopper's 8-bit tensor-core instructions read both operands along K.
    qa = qa if qa.stride(1) == 1 else qa.contiguous()
    qb = qb if qb.stride(0) == 1 else qb.t().contiguous().t()
    out = torch.empty((m, n), dtype=out_dtype, device=qa.device)
    per_column = scale_b.numel() != 1
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    common = (scale_a.contiguous(), scale_b.contiguous(), out if bias is None else bias, m, n, k,
              triton.next_power_of_2(m))
    if kernel == "auto":
        kernel = "tma" if _tma_fits(qa, qb) else "pointer"
    if kernel == "tma" and not _tma_fits(qa, qb):
        raise ValueError(f"int8_matmul kernel='tma' needs a GPU of compute capability >= 9.0, K a multiple of 16 "
                         f"(K={k}) and 16-byte aligned operands: use kernel='auto' or 'pointer'")
    if kernel == "tma":
        # Box shapes are placeholders until the autotuner's pre-hook sets each config's.
        a_desc = TensorDescriptor.from_tensor(qa, [32, 32])
        b_desc = TensorDescriptor.from_tensor(qb.t(), [32, 32])
        programs = _persistent_programs(qa.device)
        _int8_matmul_tma_kernel[lambda meta: (min(programs, grid(meta)[0]),)](
            a_desc, b_desc, out, *common, out.stride(0), out.stride(1), SB_PER_COLUMN=per_column,
            HAS_BIAS=bias is not None)
    elif kernel == "pointer":
        _int8_matmul_kernel[grid](qa, qb, out, *common, qa.stride(0), qb.stride(1), out.stride(0), out.stride(1),
                                  SB_PER_COLUMN=per_column, HAS_BIAS=bias is not None)
    else:
        raise ValueError(f"int8_matmul kernel={kernel!r} is not one of 'auto', 'tma', 'pointer'")
    return out


def _persistent_programs(device: torch.device) -> int:
    """Programs of a persistent kernel: one per SM. Under the interpreter, a few, so that tests walk several
    tiles per program."""
    if device.type != "cuda":
        return 3
    return torch.cuda.get_device_properties(device).multi_processor_count


def _tma_fits(qa: torch.Tensor, qb: torch.Tensor) -> bool:
    """TMA needs a Hopper-class GPU (or the interpreter), 16-byte aligned rows (K a multiple of 16 int8s) and
    16-byte aligned base addresses."""
    if TensorDescriptor is None or qa.shape[1] % 16 or qa.data_ptr() % 16 or qb.data_ptr() % 16:
        return False
    return interpreting() or (qa.is_cuda and torch.cuda.get_device_capability(qa.device) >= (9, 0))

