"""SwitchBack linear layers as an autograd function: y = x Wᵀ + b with low-precision matmuls for the
forward pass and the input gradient, and the weight gradient Gᵀ X "switched back" to 16 bits (its inner
dimension, batch × sequence, is where quantization noise would add up).

Variants (Wortsman et al. 2023):
- `switchback_int8` (Algorithm 1): X and G row-wise int8, W tensor-wise int8.
- `switchback_int8_memeff` (Algorithm 3): as above, but only the int8 X is kept for backward, where the weight
  gradient uses its dequantized value.
- `switchback_int8_vectorwise` (Algorithm 4): W row-wise in the forward pass, column-wise for the input gradient.
- `switchback_fp8`: e4m3 operands, X and G row-wise, W tensor-wise (Hopper: compute capability ≥ 8.9).

Backends: `reference` runs the matmuls in plain PyTorch on any device (exact int8 sums in float64);
`cuda` runs them on the GPU's integer / fp8 tensor cores (`torch._int_mm`, `torch._scaled_mm`), with the
quantizers of `reference.py` compiled into fused kernels. Both apply the same arithmetic, so they agree up to
float32 summation order.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from src.models.switchback import reference as ref


@dataclass(frozen=True)
class Variant:
    name: str
    fp8: bool
    weight_dim_forward: int | None  # None: one scale for W; 1: a scale per output row
    weight_dim_backward: int | None  # None: one scale for W; 0: a scale per input column
    save_int8_input: bool


VARIANTS = {
    v.name: v for v in (
        Variant("switchback_int8", False, None, None, False),
        Variant("switchback_int8_memeff", False, None, None, True),
        Variant("switchback_int8_vectorwise", False, 1, 0, False),
        Variant("switchback_fp8", True, None, None, False),
    )
}
BACKENDS = ("cuda", "reference")


def check_backend(variant: Variant, backend: str, device: torch.device) -> None:
    """Fail loudly where a variant cannot run, instead of silently falling back to something slower."""
    if backend not in BACKENDS:
        raise ValueError(f"model.linear_backend={backend!r} is not one of {', '.join(BACKENDS)}")
    if backend == "reference":
        return
    if device.type != "cuda":
        raise ValueError(
            f"model.linear={variant.name} with the cuda backend needs a CUDA GPU, but the model is on {device}: "
            "use model.linear=standard, or model.linear_backend=reference for the slow pure-PyTorch path"
        )
    if variant.fp8 and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(
            f"model.linear=switchback_fp8 needs fp8 tensor cores (compute capability >= 8.9, e.g. H100/H200/L4); "
            f"{torch.cuda.get_device_name(device)} has {torch.cuda.get_device_capability(device)}: "
            "use model.linear=switchback_int8"
        )


@functools.cache
def fused(fn):
    """`fn` compiled by TorchInductor into fused Triton kernels: the absmax reduction, scaling, rounding and
    cast of a quantizer become one pass over the tensor instead of one kernel (and one round trip through
    memory) per op, which is what made unfused quantization slower than the bf16 layer."""
    # One compiled variant per (dim, dtype) pair a layer uses: up to a dozen, beyond Dynamo's default limit of 8.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(fn, dynamic=True, fullgraph=True)


def quantize(variant: Variant, x: torch.Tensor, dim: int | None, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    fn = ref.quantize_fp8 if variant.fp8 else ref.quantize_int8
    return (fused(fn) if backend == "cuda" else fn)(x, dim)


def int8_dequantize(acc: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype):
    out = acc.float() * (scale / (ref.INT8_MAX * ref.INT8_MAX))
    return (out if bias is None else out + bias.float()).to(out_dtype)


def low_precision_matmul(
    variant: Variant, backend: str, qa: torch.Tensor, scale_a: torch.Tensor, qb_t: torch.Tensor,
    scale_b: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
) -> torch.Tensor:
    """(qa @ qb_t) dequantized by scale_a ([M, 1]) · scale_b ([1, N] or scalar), plus bias."""
    if backend == "reference":
        matmul = ref.fp8_matmul_dequant if variant.fp8 else ref.int8_matmul_dequant
        return matmul(qa, scale_a, qb_t, scale_b, bias, out_dtype)
    # cuBLAS wants the second operand column-major (free when it is a transposed row-major weight).
    b = qb_t.t().contiguous().t()
    if variant.fp8:
        # Row-wise fp8 scaling takes scales of shape [M, 1] and [1, N].
        scale_b = scale_b.reshape(1, -1).expand(1, b.shape[1]).contiguous()
        bias = None if bias is None else bias.to(out_dtype)
        return torch._scaled_mm(qa, b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype)
    return fused(int8_dequantize)(torch._int_mm(qa, b), scale_a * scale_b, bias, out_dtype)


class SwitchBackLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, variant: Variant,
                backend: str) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        qx, sx = quantize(variant, x2, 1, backend)
        qw, sw = quantize(variant, weight, variant.weight_dim_forward, backend)
        out = low_precision_matmul(variant, backend, qx, sx, qw.t(), sw.reshape(1, -1), bias, x.dtype)
        ctx.variant, ctx.backend, ctx.has_bias = variant, backend, bias is not None
        ctx.x_dtype, ctx.x_shape, ctx.weight_dtype = x.dtype, x.shape, weight.dtype
        # Where backward scales W the same way, its quantized copy (1 byte per weight) is reused there.
        reuse = variant.weight_dim_backward == variant.weight_dim_forward
        ctx.save_for_backward(*((qx, sx) if variant.save_int8_input else (x2,)), *((qw, sw) if reuse else (weight,)))
        ctx.reuse_weight = reuse
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        variant, backend = ctx.variant, ctx.backend
        saved = list(ctx.saved_tensors)
        if variant.save_int8_input:
            x2 = ref.dequantize_int8(saved.pop(0), saved.pop(0)).to(ctx.x_dtype)
        else:
            x2 = saved.pop(0)
        g2 = grad_out.reshape(-1, grad_out.shape[-1]).to(ctx.x_dtype)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            qg, sg = quantize(variant, g2, 1, backend)
            qw, sw = saved if ctx.reuse_weight else quantize(variant, saved[0], variant.weight_dim_backward, backend)
            grad_x = low_precision_matmul(variant, backend, qg, sg, qw, sw.reshape(1, -1), None, ctx.x_dtype)
            grad_x = grad_x.reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            grad_w = (g2.t() @ x2).to(ctx.weight_dtype)  # the switch back: 16-bit (or fp32) weight gradient
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g2.sum(0).to(ctx.weight_dtype)
        return grad_x, grad_w, grad_b, None, None


def switchback_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, variant: str, backend: str = "cuda"
) -> torch.Tensor:
    """`F.linear` with SwitchBack arithmetic. Under autocast the output has the autocast dtype, like F.linear."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        x = x.to(torch.get_autocast_dtype(device))
    with torch.autocast(device, enabled=False):
        return SwitchBackLinearFunction.apply(x, weight, bias, VARIANTS[variant], backend)
