"""A residual add and the LayerNorm after it, x1 = x + γ·(a + c) and y = LayerNorm(x1), forward and backward in
one Triton kernel each, for `model.residual_norm` (`auto` takes them on a GPU; `fused` everywhere they run). c is
the bias of the linear layer that wrote a, which then runs without it (optional). They run in the middle of each
transformer block (x + ls_1(attention), then ln_2), and, where blocks.KernelTransformer chains the blocks, at the end
of each (x + ls_2(MLP), then the next block's ln_1).

Why: under torch.compile, Inductor computes this backward in one kernel for the rows (the LayerNorm gradient
and the residual) and re-reads the same tensors in separate column reductions for the gradients of γ and of
the LayerNorm's weight and bias, and the linear layer's bias gradient is one more reduction over da. On ViT-H/14
those column reductions took about 23 ms of a 704 ms step (docs/BENCHMARKS.md). Here each program
walks ROWS rows and keeps its column sums in registers, written once as partial sums per program and added up in
a fixed order (deterministic, no atomics).

Arithmetic as the unfused path: x (float32 residual stream), a (the branch's output, in 16 bits under autocast),
c and γ give x1 in float32 (a + c is not rounded to 16 bits first, as a linear layer's output with its bias would
be); the LayerNorm runs in float32 and y is rounded to a's dtype, as the next linear layer would round it.
Gradients: dx = dx1 (the residual's gradient plus the LayerNorm's), da = dx1·γ in a's dtype, dc = Σ dx1·γ,
dγ = Σ dx1·(a + c), dw = Σ dy·x̂, db = Σ dy.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    from triton.runtime.errors import OutOfResources
except ImportError:
    triton = None

from src.kernels.triton_interpreter import interpreting

ROWS = 32  # rows per program: fewer partial column sums to write and add, against fewer programs in flight
# Warps per program and software-pipelining stages of its loop over rows (1: none), so that the next rows' loads
# are in flight while a row is reduced. On an H200 (bench/residual_norm.py, forward + backward) 8 warps and 3
# stages ran 1.07x as fast as 4 warps without pipelining at ViT-H/14's width and 1.14x at ViT-L/14's.
WARPS = 8
STAGES = 3


def applies(x: torch.Tensor, a: torch.Tensor) -> bool:
    """Whether `model.residual_norm=auto` takes the fused kernels for (x, a): on a GPU (not the interpreter), at
    every width. On an H200, since the kernels also add the biases of the layers before them, a ViT-B/32 step
    (widths 768 and 512) ran 1.05x as fast with them as with Inductor's code (docs/BENCHMARKS.md)."""
    return x.device.type == "cuda" and unsupported_reason(x, a) is None


def unsupported_reason(x: torch.Tensor, a: torch.Tensor) -> str | None:
    """Why the fused kernels cannot run on (x, a) (with the fix), or None where they can."""
    if triton is None:
        return "it needs Triton (installed with PyTorch's CUDA wheels on Linux): install triton"
    # The meta device runs the fake kernels: FLOP counting and meta-device init trace the model there.
    if x.device.type not in ("cuda", "meta") and not interpreting():
        return f"it needs a CUDA GPU, but the model is on {x.device}"
    if x.dtype != torch.float32 or a.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return (f"it needs a float32 residual stream and a float32, bfloat16 or float16 branch output, "
                f"got {x.dtype} and {a.dtype}")
    if x.shape[-1] > 8192:
        return f"it keeps a whole row in registers: width {x.shape[-1]} is over 8192"
    return None


if triton is not None:

    @triton.jit
    def _residual_norm_forward_kernel(x_ptr, a_ptr, a_bias_ptr, gamma_ptr, w_ptr, b_ptr, x1_ptr, y_ptr, mean_ptr,
                                      rstd_ptr, rows, width, eps, BLOCK_W: tl.constexpr, ROWS: tl.constexpr,
                                      STAGES: tl.constexpr, HAS_A_BIAS: tl.constexpr):
        cols = tl.arange(0, BLOCK_W)
        inside = cols < width
        gamma = tl.load(gamma_ptr + cols, mask=inside, other=0.0)
        a_bias = tl.load(a_bias_ptr + cols, mask=inside, other=0.0) if HAS_A_BIAS else 0.0
        w = tl.load(w_ptr + cols, mask=inside, other=0.0)
        b = tl.load(b_ptr + cols, mask=inside, other=0.0)
        for r in tl.range(0, ROWS, num_stages=STAGES):
            row = tl.program_id(0) * ROWS + r
            mask = inside & (row < rows)
            offsets = row.to(tl.int64) * width + cols
            x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
            x1 = x + (tl.load(a_ptr + offsets, mask=mask, other=0.0).to(tl.float32) + a_bias) * gamma
            tl.store(x1_ptr + offsets, x1, mask=mask)
            mean = tl.sum(x1, axis=0) / width
            centered = tl.where(mask, x1 - mean, 0.0)
            rstd = 1.0 / tl.sqrt_rn(tl.sum(centered * centered, axis=0) / width + eps)
            tl.store(y_ptr + offsets, (centered * rstd * w + b).to(y_ptr.dtype.element_ty), mask=mask)
            tl.store(mean_ptr + row, mean, mask=row < rows)
            tl.store(rstd_ptr + row, rstd, mask=row < rows)

    @triton.jit
    def _residual_norm_backward_kernel(grad_x1_ptr, grad_y_ptr, stream_ptr, a_ptr, a_bias_ptr, gamma_ptr, w_ptr,
                                       mean_ptr, rstd_ptr, dx_ptr, da_ptr, partial_ptr, rows, width, programs,
                                       BLOCK_W: tl.constexpr, ROWS: tl.constexpr, STAGES: tl.constexpr,
                                       HAS_GRAD_X1: tl.constexpr, STREAM_IS_SUM: tl.constexpr,
                                       HAS_A_BIAS: tl.constexpr):
        """dx and da per row; per program, its partial column sums of dγ, dw, db and, with a bias on a, of that
        bias ([3 or 4, programs, width]). The saved stream is x1 where STREAM_IS_SUM, else x (and
        x1 = x + γ·(a + bias) is formed again)."""
        cols = tl.arange(0, BLOCK_W)
        inside = cols < width
        gamma = tl.load(gamma_ptr + cols, mask=inside, other=0.0)
        a_bias = tl.load(a_bias_ptr + cols, mask=inside, other=0.0) if HAS_A_BIAS else 0.0
        sum_a_bias = tl.zeros((BLOCK_W,), tl.float32)
        w = tl.load(w_ptr + cols, mask=inside, other=0.0)
        sum_gamma = tl.zeros((BLOCK_W,), tl.float32)
        sum_w = tl.zeros((BLOCK_W,), tl.float32)
        sum_b = tl.zeros((BLOCK_W,), tl.float32)
        for r in tl.range(0, ROWS, num_stages=STAGES):
            row = tl.program_id(0) * ROWS + r
            in_rows = row < rows
            mask = inside & in_rows
            offsets = row.to(tl.int64) * width + cols
            grad_y = tl.load(grad_y_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            mean = tl.load(mean_ptr + row, mask=in_rows, other=0.0)
            rstd = tl.load(rstd_ptr + row, mask=in_rows, other=0.0)
            a = tl.where(mask, tl.load(a_ptr + offsets, mask=mask, other=0.0).to(tl.float32) + a_bias, 0.0)
            x1 = tl.load(stream_ptr + offsets, mask=mask, other=0.0)
            if not STREAM_IS_SUM:
                x1 += a * gamma
            x_hat = tl.where(mask, (x1 - mean) * rstd, 0.0)
            grad_x_hat = grad_y * w
            dx = rstd * (grad_x_hat - x_hat * (tl.sum(grad_x_hat * x_hat, axis=0) / width)
                         - tl.sum(grad_x_hat, axis=0) / width)
            if HAS_GRAD_X1:
                dx += tl.load(grad_x1_ptr + offsets, mask=mask, other=0.0)
            dx = tl.where(mask, dx, 0.0)
            tl.store(dx_ptr + offsets, dx, mask=mask)
            tl.store(da_ptr + offsets, (dx * gamma).to(da_ptr.dtype.element_ty), mask=mask)
            sum_gamma += dx * a
            sum_w += grad_y * x_hat
            sum_b += grad_y
            if HAS_A_BIAS:
                sum_a_bias += dx * gamma
        base = partial_ptr + tl.program_id(0).to(tl.int64) * width + cols
        tl.store(base, sum_gamma, mask=inside)
        tl.store(base + programs * width, sum_w, mask=inside)
        tl.store(base + 2 * programs * width, sum_b, mask=inside)
        if HAS_A_BIAS:
            tl.store(base + 3 * programs * width, sum_a_bias, mask=inside)


def _grid(rows: int) -> int:
    return triton.cdiv(rows, ROWS)


# The pipelining stages that fit in shared memory, per (kernel, STAGES, padded width, device): STAGES, or fewer on GPUs
# with less shared memory per block than a Hopper's. The backward keeps 16 bytes per padded column per 3 stages: 131 KB
# at width 8192, where consumer GPUs have about 99 KB.
_fitting_stages: dict[tuple, int] = {}


def _launch(kernel, programs: int, device: torch.device, *args, BLOCK_W: int, **meta) -> None:
    """kernel[(programs,)](*args) with as many pipelining stages, up to STAGES, as the GPU's shared memory holds.
    Triton refuses a kernel that needs more before it launches, so a refused launch is retried with fewer."""
    key = (id(kernel), STAGES, BLOCK_W, device)
    stages = _fitting_stages.get(key, STAGES)
    while True:
        try:
            kernel[(programs,)](*args, BLOCK_W=BLOCK_W, STAGES=stages, **meta)
            break
        except OutOfResources:
            if stages == 1:
                raise
            stages -= 1
    _fitting_stages[key] = stages


@torch.library.custom_op("stableclip::residual_norm_forward", mutates_args=())
def _forward(x: torch.Tensor, a: torch.Tensor, a_bias: torch.Tensor | None, gamma: torch.Tensor,
             weight: torch.Tensor, bias: torch.Tensor, eps: float, save_sum: bool,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x1, y, mean, rstd) for 2-D x [rows, width] (float32) and a (float32 or 16 bits); `save_sum` says what
    the autograd context keeps, not what is computed."""
    rows, width = x.shape
    x1, y = torch.empty_like(x), torch.empty_like(a)
    mean, rstd = x.new_empty(rows), x.new_empty(rows)
    # Without a_bias, γ stands in for its pointer, which the kernel then never reads.
    _launch(_residual_norm_forward_kernel, _grid(rows), x.device, x, a, gamma if a_bias is None else a_bias, gamma,
            weight, bias, x1, y, mean, rstd, rows, width, eps, BLOCK_W=triton.next_power_of_2(width), ROWS=ROWS,
            HAS_A_BIAS=a_bias is not None, num_warps=WARPS)
    return x1, y, mean, rstd


@_forward.register_fake
def _(x, a, a_bias, gamma, weight, bias, eps, save_sum):
    return torch.empty_like(x), torch.empty_like(a), x.new_empty(x.shape[0]), x.new_empty(x.shape[0])


@torch.library.custom_op("stableclip::residual_norm_backward", mutates_args=())
def _backward(grad_x1: torch.Tensor | None, grad_y: torch.Tensor, stream: torch.Tensor, a: torch.Tensor,
              a_bias: torch.Tensor | None, gamma: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor,
              rstd: torch.Tensor, stream_is_sum: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, da, [dγ; dw; db; d a_bias where given] as one [3 or 4, width] tensor), from the saved residual
    stream: x1 where `stream_is_sum`, else x."""
    rows, width = stream.shape
    programs = _grid(rows)
    dx, da = torch.empty_like(stream), torch.empty_like(a)
    partial = stream.new_empty(3 if a_bias is None else 4, programs, width)
    _launch(_residual_norm_backward_kernel, programs, stream.device, grad_x1 if grad_x1 is not None else dx, grad_y,
            stream, a, gamma if a_bias is None else a_bias, gamma, weight, mean, rstd, dx, da, partial, rows, width,
            programs, BLOCK_W=triton.next_power_of_2(width), ROWS=ROWS, HAS_GRAD_X1=grad_x1 is not None,
            STREAM_IS_SUM=stream_is_sum, HAS_A_BIAS=a_bias is not None, num_warps=WARPS)
    return dx, da, partial.sum(1)  # one launch for all; a fixed order: deterministic


@_backward.register_fake
def _(grad_x1, grad_y, stream, a, a_bias, gamma, weight, mean, rstd, stream_is_sum):
    sums = 3 if a_bias is None else 4
    return torch.empty_like(stream), torch.empty_like(a), stream.new_empty(sums, stream.shape[1])


def _setup_context(ctx, inputs, output) -> None:
    # One float32 stream tensor is kept, whichever is kept anyway (residual_norm's save_sum says which): saving
    # both would cost 4 bytes per activation more (12 GiB on a ViT-H/14 step at batch 256).
    x, a, a_bias, gamma, weight, bias, eps, save_sum = inputs
    x1, _, mean, rstd = output
    ctx.save_sum = save_sum
    ctx.save_for_backward(x1 if save_sum else x, a, a_bias, gamma, weight, mean, rstd)


def _grads(ctx, grad_x1, grad_y, _grad_mean, _grad_rstd):
    stream, a, a_bias, gamma, weight, mean, rstd = ctx.saved_tensors
    dx, da, column_sums = _backward(grad_x1, grad_y.to(a.dtype).contiguous(), stream, a, a_bias, gamma, weight,
                                    mean, rstd, ctx.save_sum)
    dgamma, dweight, dbias = column_sums[:3]
    da_bias = column_sums[3].to(a_bias.dtype) if a_bias is not None else None
    return dx, da, da_bias, dgamma, dweight, dbias, None, None


_forward.register_autograd(_grads, setup_context=_setup_context)


def residual_norm(x: torch.Tensor, a: torch.Tensor, gamma: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor, eps: float = 1e-5, save_sum: bool = False, a_bias: torch.Tensor | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x1, y) = (x + γ·(a + a_bias), LayerNorm(x1) in a's dtype) over the last dimension, for x [..., width]
    float32 and a of x's shape in float32 or 16 bits; γ, weight, bias and a_bias (None: none) [width] float32.
    a_bias is the bias of the linear layer that wrote a, which then runs without it: its gradient is summed here
    with the other column sums, not in a reduction of its own over da. For the backward it keeps x, or x1 where
    `save_sum`: in a block, x is the block's input and x1 the next block's, which are kept anyway."""
    reason = unsupported_reason(x, a)
    if reason is not None:
        raise ValueError(f"model.residual_norm=fused cannot run here: {reason}; or set it to auto or unfused")
    width = x.shape[-1]
    x1, y, _, _ = _forward(x.reshape(-1, width).contiguous(), a.reshape(-1, width).contiguous(), a_bias, gamma,
                           weight, bias, eps, save_sum)
    return x1.view(x.shape), y.view(a.shape)
