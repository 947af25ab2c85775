"""`model.gelu`: the exact GELU, h·Φ(h), with Φ from a rational fit of erf that TorchInductor compiles to cheaper
arithmetic than F.gelu's.

F.gelu's erf (CUDA's erff) costs about 33 instructions per element, forward, and the gradient another erf and an
exp on top. Abramowitz & Stegun's fit 7.1.26, erf(x) = 1 − t·P(t)·e^{−x²} with t = 1/(1 + p·x) and P of degree 4,
has an absolute error under 1.5·10⁻⁷: GELU(h) within 1.5·10⁻⁶ of F.gelu's for any h. In the lower tail, where
GELU(h) is under 10⁻³ in magnitude (h < −3.3), its relative error grows (0.16% at h = −5), so a bfloat16 result
there may differ from F.gelu's in the last bit; F.gelu's own 1 + erf(h/√2) rounds to 0 below h ≈ −5.5. Its e^{−x²}
at x = h/√2 is also the density's exponential, so the gradient Φ(h) + h·φ(h) reuses it: one exp and one division
per element each way, and written as a power of 2 the exponential is one hardware instruction. Compiled for an
H100/H200 (`bench/kernel_resources.py --gelu`, with the libdevice functions that Inductor emits), that is 32
instead of 42 SASS instructions per element forward and 38 instead of 59 backward. On an H200 the compiled GELU,
forward and backward, ran 1.07–1.41× as fast as F.gelu's at the MLP shapes, and the whole ViT-H/14 step
1.004–1.006× faster than with torch.exp (docs/BENCHMARKS.md, throughput).

Written in torch ops so that TorchInductor fuses it with what surrounds it (bias, casts), as it does F.gelu. In
eager mode it is a dozen kernels where F.gelu is one: `model.gelu=auto` takes it only in compiled blocks.

Forms (`model.gelu`), for 16-bit activations (float32 and float64 always get F.gelu, see `rational_gelu`): `erf`,
F.gelu everywhere; `rational`, this fit everywhere; `auto`, this fit where the block is compiled (torch.compile)
and F.gelu in eager mode.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_P = 0.3275911
_A1, _A2, _A3, _A4, _A5 = 0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429
_SQRT_HALF = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327
_HALF_LOG2_E = 0.7213475204444817  # log2(e) / 2


def _cdf_and_density(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Φ(z) and φ(z) in float32 from one exponential."""
    t = 1.0 / (1.0 + (_P * _SQRT_HALF) * z.abs())
    # e^{-z²/2} as 2^{-z²/(2 ln 2)}: Inductor emits libdevice's expf for torch.exp, which scales to base 2 and
    # handles edge cases first; exp2 is one MUFU.EX2. The GELU kernels ran 1.08-1.25x as fast.
    density_unscaled = torch.exp2(-_HALF_LOG2_E * z * z)
    # ½·erfc(|z|/√2) = Φ(−|z|), computed directly: 1 − Φ(|z|) would round to 0 in the lower tail.
    lower_tail = 0.5 * t * (_A1 + t * (_A2 + t * (_A3 + t * (_A4 + t * _A5)))) * density_unscaled
    return torch.where(z >= 0, 1.0 - lower_tail, lower_tail), density_unscaled * _INV_SQRT_2PI


class _RationalGELU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(h)
        z = h.float()
        return (z * _cdf_and_density(z)[0]).to(h.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (h,) = ctx.saved_tensors
        z = h.float()
        cdf, density = _cdf_and_density(z)
        return (grad.float() * (cdf + z * density)).to(grad.dtype)


def rational_gelu(h: torch.Tensor) -> torch.Tensor:
    """GELU(h) = h·Φ(h) for 16-bit h, as F.gelu(h) to within 1.5·10⁻⁶ before rounding (float32 arithmetic, output
    in h's dtype). 32- and 64-bit h go to F.gelu: there the fit's error would show, and compiled for CUDA by
    older PyTorch its float32 gradient came out as zeros (tests/gpu/test_gelu_cuda.py)."""
    if h.dtype not in (torch.bfloat16, torch.float16):
        return F.gelu(h)
    return _RationalGELU.apply(h)


class GELU(nn.GELU):
    """nn.GELU (the exact form) whose Φ is evaluated as `form` (a GeluForm value) says; no parameters, so state
    dicts do not change."""

    def __init__(self, form: str = "erf"):
        super().__init__()
        self.form = form

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.form == "rational" or (self.form == "auto" and torch.compiler.is_compiling()):
            return rational_gelu(h)
        return F.gelu(h)
