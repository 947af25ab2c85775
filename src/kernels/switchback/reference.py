"""Quantization and low-precision matmuls of SwitchBack in plain PyTorch: the CPU path and the ground truth
the GPU kernels are tested against (same scales, same rounding).

int8 (Wortsman et al. 2023, §2): q = round(x · (127 · (1 / absmax))), clamped to [-127, 127]; an int32
accumulator is dequantized by scale_a · scale_b / 127². Products of int8 values are summed exactly here (in
float32 for inner dimensions up to 1040, else float64), which equals int32 accumulation.
fp8: e4m3 values q = x · (448 · (1 / absmax)) (448 is e4m3's largest finite value), rounded to nearest even,
with dequantization scale absmax · (1/448); the products are summed in float32 as cuBLAS does.

Every step is one IEEE float32 operation in a fixed order, so the Triton kernels repeat it bit for bit. The
one division is per row (a correctly rounded reciprocal); each element costs a multiply, which keeps the
GPU quantizers bound by memory rather than by arithmetic.
"""

from __future__ import annotations

import torch

INT8_MAX = 127.0
FP8_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn


def absmax(x: torch.Tensor, dim: int | None) -> torch.Tensor:
    """Per-row (dim=1), per-column (dim=0) or whole-tensor (None) absolute maximum, as float32; a zero
    row gets scale 1 so it quantizes to zeros instead of NaN."""
    a = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    a = a.float()
    return torch.where(a > 0, a, torch.ones_like(a))


def quantize_int8(x: torch.Tensor, dim: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values, float32 absmax) along `dim` (1: row-wise, 0: column-wise, None: tensor-wise)."""
    scale = absmax(x, dim)
    q = torch.round(x.float() * (INT8_MAX * torch.reciprocal(scale))).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * (scale / INT8_MAX)


def int8_matmul_dequant(
    qa: torch.Tensor, scale_a: torch.Tensor, qb_t: torch.Tensor, scale_b: torch.Tensor,
    bias: torch.Tensor | None, out_dtype: torch.dtype,
) -> torch.Tensor:
    """(qa @ qb_t) · scale_a · scale_b / 127² (+ bias). qa: [M, K], qb_t: [K, N]; scale_a broadcasts over
    rows ([M, 1] or scalar), scale_b over columns ([1, N] or scalar)."""
    # float32 sums of int8 products are exact while every partial sum stays below 2^24; beyond, use float64.
    exact = torch.float32 if qa.shape[1] * INT8_MAX * INT8_MAX < 2**24 else torch.float64
    acc = qa.to(exact) @ qb_t.to(exact)
    # A multiply by the constant 1/127², not a division: PyTorch's CUDA kernels turn a division by a scalar
    # into a multiply by its reciprocal, so that is the arithmetic every device can repeat exactly.
    out = acc.float() * (scale_a * scale_b * (1.0 / (INT8_MAX * INT8_MAX)))
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def quantize_fp8(x: torch.Tensor, dim: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, float32 scale) with scale = absmax · (1/448) along `dim`."""
    amax = absmax(x, dim)
    q = (x.float() * (FP8_MAX * torch.reciprocal(amax))).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, amax * (1.0 / FP8_MAX)


def fp8_matmul_dequant(
    qa: torch.Tensor, scale_a: torch.Tensor, qb_t: torch.Tensor, scale_b: torch.Tensor,
    bias: torch.Tensor | None, out_dtype: torch.dtype,
) -> torch.Tensor:
    """(qa @ qb_t) · scale_a · scale_b (+ bias), products summed in float32."""
    out = (qa.float() @ qb_t.float()) * (scale_a * scale_b)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)
