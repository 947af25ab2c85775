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
`cuda` runs our Triton kernels (`kernels.py`: fused row-wise and tensor-wise quantizers, an int8 matmul with
the dequantize and bias in its epilogue) and, for fp8, cuBLAS through `torch._scaled_mm` with row-wise
scales. Both apply the same arithmetic: the quantized values are bit for bit equal, and the outputs agree up
to the accumulators' summation order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from src.models.switchback import kernels
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
    kernels.require_triton()
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


def quantize_rows(
    variant: Variant, backend: str, x: torch.Tensor, column_sums: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A scale per row of `x` (any strides): (q contiguous, scale [R, 1], float32 column sums or None)."""
    if backend == "cuda":
        return kernels.quantize_rows(x, variant.fp8, column_sums)
    q, scale = (ref.quantize_fp8 if variant.fp8 else ref.quantize_int8)(x, 1)
    return q, scale, x.float().sum(0) if column_sums else None


def quantize_tensor(variant: Variant, backend: str, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One scale for `w`: (q, qᵀ, scale [1, 1]); the cuda backend writes qᵀ contiguous in the same pass."""
    if backend == "cuda":
        return kernels.quantize_tensor(w, variant.fp8, transpose=True)
    q, scale = (ref.quantize_fp8 if variant.fp8 else ref.quantize_int8)(w, None)
    return q, q.t(), scale.reshape(1, 1)


def low_precision_matmul(
    variant: Variant, backend: str, qa: torch.Tensor, scale_a: torch.Tensor, qb: torch.Tensor,
    scale_b: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
) -> torch.Tensor:
    """(qa @ qb) dequantized by scale_a ([M, 1]) · scale_b ([1, N] or [1, 1]), plus bias. qb [K, N] is
    column-major (contiguous along K) where the callers can make it so for free: the 8-bit tensor cores read
    both operands along K."""
    if backend == "reference":
        matmul = ref.fp8_matmul_dequant if variant.fp8 else ref.int8_matmul_dequant
        return matmul(qa, scale_a, qb, scale_b, bias, out_dtype)
    if variant.fp8:
        scale_b = scale_b.expand(1, qb.shape[1]).contiguous()  # row-wise scaling wants [M, 1] and [1, N]
        bias = None if bias is None else bias.to(out_dtype)
        return torch._scaled_mm(qa, qb, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype)
    return kernels.int8_matmul(qa, scale_a, qb, scale_b, bias, out_dtype)


class SwitchBackLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, variant: Variant,
                backend: str) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        qx, sx, _ = quantize_rows(variant, backend, x2)
        if variant.weight_dim_forward is None:
            # Backward scales W the same way, so its quantized copy (1 byte per weight) is kept for it, laid
            # out as the input-gradient matmul reads it.
            qw, qwt, sw = quantize_tensor(variant, backend, weight)
            saved_weight = (qwt, sw)
        else:
            qw, sw, _ = quantize_rows(variant, backend, weight)
            sw, saved_weight = sw.reshape(1, -1), (weight,)
        out = low_precision_matmul(variant, backend, qx, sx, qw.t(), sw, bias, x.dtype)
        ctx.variant, ctx.backend, ctx.has_bias = variant, backend, bias is not None
        ctx.x_dtype, ctx.x_shape, ctx.weight_dtype = x.dtype, x.shape, weight.dtype
        ctx.save_for_backward(*((qx, sx) if variant.save_int8_input else (x2,)), *saved_weight)
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
        grad_x = grad_w = grad_b = column_sums = None
        want_bias = ctx.has_bias and ctx.needs_input_grad[2]
        if ctx.needs_input_grad[0]:
            # G's column sums are the bias gradient: the quantizer reads G once for both.
            qg, sg, column_sums = quantize_rows(variant, backend, g2, column_sums=want_bias)
            if variant.weight_dim_backward is None:
                qwt, sw = saved
            else:  # a scale per input column of W: rows of Wᵀ
                qwt, sw, _ = quantize_rows(variant, backend, saved[0].t())
                sw = sw.reshape(1, -1)
            grad_x = low_precision_matmul(variant, backend, qg, sg, qwt.t(), sw, None, ctx.x_dtype)
            grad_x = grad_x.reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            grad_w = (g2.t() @ x2).to(ctx.weight_dtype)  # the switch back: 16-bit (or fp32) weight gradient
        if want_bias:
            grad_b = (g2.float().sum(0) if column_sums is None else column_sums).to(ctx.weight_dtype)
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
