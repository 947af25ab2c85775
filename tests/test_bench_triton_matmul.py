"""bench/triton_matmul.py's kernels on the CPU through Triton's interpreter, so that the benchmark cannot rot:
every kind of launch (one tile per program, persistent, persistent with a flattened loop) computes x Wᵀ, and
with the GELU epilogue writes h = x Wᵀ + b and exact GELU(h)."""

import os
import sys

import pytest
import torch
from interpreter_harness import INTERPRETED, ROOT, interpreted, run_under_interpreter

pytest.importorskip("triton")
sys.path.insert(0, os.path.join(ROOT, "bench"))
import triton_matmul  # noqa: E402


@pytest.mark.skipif(INTERPRETED, reason="this is the subprocess")
def test_kernels_under_the_interpreter():
    run_under_interpreter(__file__)


@interpreted
@pytest.mark.parametrize("kind", triton_matmul.KINDS)
@pytest.mark.parametrize("gelu", [False, True])
def test_matmul_kernel_computes_x_wt_and_the_gelu_epilogue(kind, gelu):
    torch.manual_seed(0)
    x, weight = torch.randn(100, 48).bfloat16(), torch.randn(80, 48).bfloat16()  # 4 x 3 tiles of 32 x 32
    bias = torch.randn(80).bfloat16()
    h, out = torch.zeros(100, 80).bfloat16(), torch.zeros(100, 80).bfloat16()
    triton_matmul.launcher(kind, x, weight, bias, h, out, gelu, "32,32,16,4,2")()
    product = x.float() @ weight.float().t()
    if gelu:
        want_h = (product + bias.float()).bfloat16()
        torch.testing.assert_close(h, want_h, rtol=2 ** -7, atol=0)
        torch.testing.assert_close(out.float(), torch.nn.functional.gelu(h.float()), rtol=2 ** -7, atol=1e-6)
    else:
        torch.testing.assert_close(out.float(), product, rtol=2 ** -7, atol=1e-2)
