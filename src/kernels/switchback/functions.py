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

from src.config import Linear, LinearBackend
from src.kernels.autocast import autocast_dtype
from src.kernels.switchback import kernels
from src.kernels.switchback import reference as ref


@dataclass(frozen=True)
class Variant:
    name: str
    fp8: bool
    weight_dim_forward: int | None  # None: one scale for W; 1: a scale per output row
    weight_dim_backward: int | None  # None: one scale for W; 0: a scale per input column
    save_int8_input: bool


# Every model.linear but `standard`, by name.
VARIANTS = {
    v.name: v for v in (
        Variant(Linear.switchback_int8.value, False, None, None, False),
        Variant(Linear.switchback_int8_memeff.value, False, None, None, True),
        Variant(Linear.switchback_int8_vectorwise.value, False, 1, 0, False),
        Variant(Linear.switchback_fp8.value, True, None, None, False),
    )
}


def check_backend(variant: Variant, backend: str, device: torch.device) -> None:
    """Fail loudly where a variant cannot run, instead of silently falling back to something slower."""
    if backend not in LinearBackend.values():
        raise ValueError(f"model.linear_backend={backend!r} is not one of {', '.join(LinearBackend.values())}")
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


def quantize_tensor(
    variant: Variant, backend: str, w: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One scale for `w` [R, C]: (q, qᵀ, the scale as a [1, R] and a [1, C] vector, the forward's and the input
    gradient's `scale_b`); the cuda backend writes qᵀ contiguous in the same pass."""
    if backend == "cuda":
        return kernels.quantize_tensor(w, variant.fp8, transpose=True)
    q, scale = (ref.quantize_fp8 if variant.fp8 else ref.quantize_int8)(w, None)
    return q, q.t(), scale.reshape(1, 1).expand(1, w.shape[0]), scale.reshape(1, 1).expand(1, w.shape[1])


def low_precision_matmul(
    variant: Variant, backend: str, qa: torch.Tensor, scale_a: torch.Tensor, qb: torch.Tensor,
    scale_b: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype, fast_accum: bool,
) -> torch.Tensor:
    """(qa @ qb) dequantized by scale_a ([M, 1]) · scale_b ([1, N]), plus bias. qb [K, N] is
    column-major (contiguous along K) where the callers can make it so for free: the 8-bit tensor cores read
    both operands along K. `fast_accum`: the fp8 tensor cores keep their partial sums at their own precision
    instead of promoting them to float32 periodically, cuBLAS's default (the reference sums exactly either way)."""
    if backend == "reference":
        matmul = ref.fp8_matmul_dequant if variant.fp8 else ref.int8_matmul_dequant
        return matmul(qa, scale_a, qb, scale_b, bias, out_dtype)
    if variant.fp8:  # row-wise scaling: scale_a [M, 1], scale_b [1, N]
        bias = None if bias is None else bias.to(out_dtype)
        return torch._scaled_mm(qa, qb, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype,
                                use_fast_accum=fast_accum)
    return kernels.int8_matmul(qa, scale_a, qb, scale_b, bias, out_dtype)


def weight_gradient(g: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The switch back: Gᵀ X in the operands' 16 bits (or float32), returned in the weight's `dtype`. Under
    autocast the weights are float32: then cuBLAS writes its float32 sums as they are, instead of rounding them
    to bf16 for a cast back: faster on an H200, and no bf16 rounding (docs/BENCHMARKS.md). The reference sums the
    same products in float32 (16-bit values are exact in float32), in its own order."""
    if dtype == torch.float32 and g.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(g.t(), x, out_dtype=dtype) if g.is_cuda else g.t().float() @ x.float()
    return (g.t() @ x).to(dtype)


# The layer is a pair of torch.library custom ops, so torch.compile keeps a block with SwitchBack layers in one
# graph (an opaque call, as for any matmul) instead of breaking it at every layer, which cost the LayerNorm,
# GELU and residual fusions around them. Ops may not return their inputs or None, so the tensors a variant
# does not keep travel as empty placeholders.
_FORWARD_SCHEMA = (
    "(Tensor x, Tensor weight, Tensor? bias, str variant, str backend, bool fast_accum) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)
_BACKWARD_SCHEMA = (
    "(Tensor grad, Tensor x, Tensor qx, Tensor sx, Tensor weight, Tensor qwt, Tensor sw, str variant, str backend, "
    "bool fast_accum, ScalarType x_dtype, ScalarType weight_dtype, bool need_x, bool need_weight, bool need_bias) "
    "-> (Tensor, Tensor, Tensor)"
)


def _placeholders(like: torch.Tensor, count: int) -> tuple[torch.Tensor, ...]:
    """Distinct empty tensors: a custom op's outputs may not alias one another."""
    return tuple(like.new_empty(0) for _ in range(count))


@torch.library.custom_op("stableclip::switchback_forward", mutates_args=(), schema=_FORWARD_SCHEMA)
def _forward(x, weight, bias, variant, backend, fast_accum):
    """x [M, K] -> (out [M, N], then what backward needs besides x and W: int8 X and its row scales (memeff),
    the quantized Wᵀ [K, N] and its scale (tensor-wise W); empty where the variant keeps nothing)."""
    v = VARIANTS[variant]
    qx, sx, _ = quantize_rows(v, backend, x)
    if v.weight_dim_forward is None:
        # Backward scales W the same way, so its quantized copy (1 byte per weight) is kept for it, laid out
        # as the input-gradient matmul reads it.
        qw, qwt, sw, sw_columns = quantize_tensor(v, backend, weight)
        saved_w = (qwt.contiguous(), sw_columns.contiguous())
    else:
        qw, sw, _ = quantize_rows(v, backend, weight)
        sw, saved_w = sw.reshape(1, -1), _placeholders(x, 2)
    out = low_precision_matmul(v, backend, qx, sx, qw.t(), sw, bias, x.dtype, fast_accum)
    saved_x = (qx, sx) if v.save_int8_input else _placeholders(x, 2)
    return out, *saved_x, *saved_w


@_forward.register_fake
def _(x, weight, bias, variant, backend, fast_accum):
    v = VARIANTS[variant]
    q_dtype = torch.float8_e4m3fn if v.fp8 else torch.int8
    (rows, inner), outputs = x.shape, weight.shape[0]
    saved_x = (x.new_empty(rows, inner, dtype=q_dtype), x.new_empty(rows, 1, dtype=torch.float32))
    saved_w = (x.new_empty(inner, outputs, dtype=q_dtype), x.new_empty(1, inner, dtype=torch.float32))
    return (x.new_empty(rows, outputs), *(saved_x if v.save_int8_input else _placeholders(x, 2)),
            *(saved_w if v.weight_dim_forward is None else _placeholders(x, 2)))


@torch.library.custom_op("stableclip::switchback_backward", mutates_args=(), schema=_BACKWARD_SCHEMA)
def _backward(grad, x, qx, sx, weight, qwt, sw, variant, backend, fast_accum, x_dtype, weight_dtype, need_x,
              need_weight, need_bias):
    """(grad_x, grad_w, grad_b), each empty where not needed."""
    v = VARIANTS[variant]
    if v.save_int8_input:
        x = ref.dequantize_int8(qx, sx).to(x_dtype)
    g = grad.to(x_dtype)
    grad_x = grad_w = grad_b = column_sums = None
    if need_x:
        # G's column sums are the bias gradient: the quantizer reads G once for both.
        qg, sg, column_sums = quantize_rows(v, backend, g, column_sums=need_bias)
        if v.weight_dim_backward is not None:  # a scale per input column of W: rows of Wᵀ
            qwt, sw, _ = quantize_rows(v, backend, weight.t())
            sw = sw.reshape(1, -1)
        grad_x = low_precision_matmul(v, backend, qg, sg, qwt.t(), sw, None, x_dtype, fast_accum)
    if need_weight:
        grad_w = weight_gradient(g, x, weight_dtype)
    if need_bias:
        grad_b = (g.float().sum(0) if column_sums is None else column_sums).to(weight_dtype)
    return tuple(grad.new_empty(0) if t is None else t for t in (grad_x, grad_w, grad_b))


@_backward.register_fake
def _(grad, x, qx, sx, weight, qwt, sw, variant, backend, fast_accum, x_dtype, weight_dtype, need_x, need_weight,
      need_bias):
    rows, outputs = grad.shape
    inner = qwt.shape[0] if qwt.numel() else (weight.shape[1] if weight.numel() else x.shape[1])
    return (grad.new_empty(rows, inner, dtype=x_dtype) if need_x else grad.new_empty(0),
            grad.new_empty(outputs, inner, dtype=weight_dtype) if need_weight else grad.new_empty(0),
            grad.new_empty(outputs, dtype=weight_dtype) if need_bias else grad.new_empty(0))


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, variant, backend, fast_accum = inputs
    v = VARIANTS[variant]
    _, qx, sx, qwt, sw = output
    ctx.variant, ctx.backend, ctx.fast_accum, ctx.has_bias = variant, backend, fast_accum, bias is not None
    ctx.x_dtype, ctx.weight_dtype = x.dtype, weight.dtype
    ctx.save_for_backward(None if v.save_int8_input else x, qx, sx,
                          weight if v.weight_dim_forward is not None else None, qwt, sw)


def _grads(ctx, grad, *_unused):
    x, qx, sx, weight, qwt, sw = ctx.saved_tensors
    empty = grad.new_empty(0)
    need_bias = ctx.has_bias and ctx.needs_input_grad[2]
    grad_x, grad_w, grad_b = torch.ops.stableclip.switchback_backward(
        grad.contiguous(), empty if x is None else x, qx, sx, empty if weight is None else weight, qwt, sw,
        ctx.variant, ctx.backend, ctx.fast_accum, ctx.x_dtype, ctx.weight_dtype, ctx.needs_input_grad[0],
        ctx.needs_input_grad[1], need_bias)
    return (grad_x if ctx.needs_input_grad[0] else None, grad_w if ctx.needs_input_grad[1] else None,
            grad_b if need_bias else None, None, None, None)


_forward.register_autograd(_grads, setup_context=_setup_context)


def switchback_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, variant: str, backend: str = "cuda",
    fp8_fast_accum: bool = True,
) -> torch.Tensor:
    """`F.linear` with SwitchBack arithmetic. Under autocast the output has the autocast dtype, like F.linear.
    `fp8_fast_accum` (fp8 on the cuda backend): the tensor cores keep partial sums at their own precision, which
    adds a relative error of about 0.1–0.2% to the 3.5% of e4m3 rounding (`docs/switchback.md`)."""
    if variant not in VARIANTS:
        raise ValueError(f"model.linear={variant!r} is not one of {', '.join(VARIANTS)}")
    dtype = autocast_dtype(x.device)
    if dtype is not None:
        x = x.to(dtype)
    with torch.autocast(x.device.type, enabled=False):
        out = torch.ops.stableclip.switchback_forward(
            x.reshape(-1, x.shape[-1]), weight, bias, variant, backend, fp8_fast_accum)[0]
    return out.reshape(*x.shape[:-1], weight.shape[0])
