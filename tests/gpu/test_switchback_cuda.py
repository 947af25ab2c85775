"""GPU check of SwitchBack (run on the device: `python -m pytest -q tests/gpu`): the cuda backend equals the
reference path on random inputs of ViT-H/14 shapes, with no NaN and every output written."""

import pytest
import torch

from src.kernels.switchback import VARIANTS, switchback_linear

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SHAPES = [(1280, 3840), (1280, 5120), (5120, 1280)]  # (in, out) of qkv, fc1, fc2 in ViT-H/14
TOKENS = 256 * 257


def runnable(variant: str) -> bool:
    return not VARIANTS[variant].fp8 or torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.parametrize("fast_accum", [True, False])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("features", SHAPES)
def test_cuda_backend_equals_reference(variant, features, fast_accum):
    if not runnable(variant):
        pytest.skip("no fp8 on this GPU")
    if not fast_accum and not VARIANTS[variant].fp8:
        pytest.skip("fp8_fast_accum concerns fp8 only")
    torch.manual_seed(0)
    k, n = features
    x = torch.randn(TOKENS // 16, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") / k**0.5).requires_grad_()
    b = torch.randn(n, device="cuda").requires_grad_()
    g = torch.randn(TOKENS // 16, n, device="cuda", dtype=torch.bfloat16)
    results = []
    for backend in ("cuda", "reference"):
        xi = x.clone().requires_grad_()
        w.grad = b.grad = None
        y = switchback_linear(xi, w, b, variant, backend, fast_accum)
        y.backward(g)
        results.append((y.float(), xi.grad.float(), w.grad.clone(), b.grad.clone()))
    for got, want, name in zip(results[0], results[1], ("y", "dx", "dw", "db")):
        assert torch.isfinite(got).all(), name
        # Same arithmetic; what differs is the accumulators' summation order, bf16 rounding of the outputs and,
        # where the compiled quantizer rounds a tie the other way, a single step of 1/127 (or one fp8 ulp), and
        # with fp8_fast_accum the tensor cores' own accumulator (about 0.2% at these shapes, bench/switchback.py).
        error = ((got - want).norm() / want.norm()).item()
        assert error < 1e-2, f"{variant} {features} {name}: relative error {error:.2e}"


def test_kernels_are_bitwise_the_reference_at_vit_h_shapes():
    """Quantized values and scales bit for bit; the int8 matmul's float32 output too, without bias (with a
    bias the GPU may fuse the epilogue's multiply-add into one rounding)."""
    from src.kernels.switchback import kernels
    from src.kernels.switchback import reference as ref

    torch.manual_seed(0)
    for k, n in SHAPES:
        x = torch.randn(TOKENS, k, device="cuda", dtype=torch.bfloat16) * torch.rand(TOKENS, 1, device="cuda")
        w = torch.randn(n, k, device="cuda") / k**0.5
        for fp8 in (False, True):
            quantizer = ref.quantize_fp8 if fp8 else ref.quantize_int8
            q, scale, sums = kernels.quantize_rows(x, fp8, column_sums=True)
            want_q, want_scale = quantizer(x, 1)
            assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scale, want_scale)
            torch.testing.assert_close(sums, x.float().sum(0), rtol=1e-4, atol=1e-2)
            q, scale, _ = kernels.quantize_rows(x, fp8)  # one tile of rows per program, no column sums
            assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scale, want_scale)
            q, qt, row_scale, column_scale = kernels.quantize_tensor(w, fp8, transpose=True)
            want_q, want_scale = quantizer(w, None)
            assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
            assert torch.equal(qt.view(torch.uint8), want_q.t().contiguous().view(torch.uint8))
            assert torch.equal(row_scale, want_scale.reshape(1, 1).expand(1, n))
            assert torch.equal(column_scale, want_scale.reshape(1, 1).expand(1, k))
        qx, sx = ref.quantize_int8(x, 1)
        qw, sw = ref.quantize_int8(w, None)
        want = ref.int8_matmul_dequant(qx, sx, qw.t(), sw.reshape(1, 1), None, torch.float32)
        for kernel in ("pointer", "tma"):
            got = kernels.int8_matmul(qx, sx, qw.t(), sw.reshape(1, 1), None, torch.float32, kernel=kernel)
            assert torch.isfinite(got).all() and torch.equal(got, want), f"{k}->{n} {kernel}"


# Every int8 matmul of experiment=switchback_gpu (ViT-B/16 at 64 px, batch 256: 4,352 image tokens, 256 pooled rows
# in the pruned last block), as logged on an H200 where that preset's int8 run once died with SIGSEGV in its first
# forward pass (docs/switchback.md). (tokens, in, out).
PRESET_SHAPES = [(4352, 768, 2304), (4352, 768, 768), (4352, 768, 3072), (4352, 3072, 768), (4352, 768, 1536),
                 (256, 768, 768), (256, 768, 3072), (256, 3072, 768)]


@pytest.mark.parametrize("variant", [name for name in VARIANTS if not VARIANTS[name].fp8])
@pytest.mark.parametrize("tokens,k,n", PRESET_SHAPES)
def test_int8_variants_at_the_switchback_gpu_presets_shapes(variant, tokens, k, n):
    torch.manual_seed(0)
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") / k**0.5).requires_grad_()
    b = torch.randn(n, device="cuda").requires_grad_()
    results = []
    for backend in ("cuda", "reference"):
        xi = x.clone().requires_grad_()
        w.grad = b.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = switchback_linear(xi, w, b, variant, backend, True)
        y.float().square().mean().backward()
        torch.cuda.synchronize()
        results.append((y.float(), xi.grad.float(), w.grad.clone(), b.grad.clone()))
    for got, want, name in zip(results[0], results[1], ("y", "dx", "dw", "db")):
        assert torch.isfinite(got).all(), name
        error = ((got - want).norm() / want.norm()).item()
        assert error < 1e-2, f"{variant} {(tokens, k, n)} {name}: relative error {error:.2e}"


# The int8 matmuls of experiment=switchback_gpu's evaluation (forward only): the row counts of a partial last batch,
# of the pooled last block and of zero-shot prompts, which training never runs, at the image tower's (768-wide) and
# the text tower's (512-wide) layer shapes. That preset's int8 runs were still in their first evaluation minutes after
# bf16's and fp8's had finished theirs (docs/switchback.md).
EVAL_ROWS = [1, 16, 20, 32, 272, 640, 4352, 8192]
EVAL_LAYERS = [(768, 2304), (768, 768), (768, 3072), (3072, 768), (512, 1536), (512, 512), (512, 2048), (2048, 512)]
EVAL_SCRIPT = """
import time, torch
from src.kernels.switchback import kernels
from src.kernels.switchback import reference as ref
torch.manual_seed(0)
for rows in ROWS:
    for k, n in LAYERS:
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda") / k**0.5
        bias = torch.randn(n, device="cuda")
        qx, sx = ref.quantize_int8(x, 1)
        qw, sw = ref.quantize_int8(w, None)
        want = ref.int8_matmul_dequant(qx, sx, qw.t(), sw.reshape(1, 1), bias, torch.float32)
        for kernel in ("pointer", "tma"):
            print(f"{rows} x {k} -> {n} {kernel}", end=" ", flush=True)
            start = time.perf_counter()
            got = kernels.int8_matmul(qx, sx, qw.t(), sw.reshape(1, 1), bias, torch.float32, kernel=kernel)
            torch.cuda.synchronize()
            error = ((got - want).norm() / want.norm()).item()
            print(f"{time.perf_counter() - start:.2f} s, relative error {error:.1e}", flush=True)
            assert torch.isfinite(got).all() and error < 1e-5, (rows, k, n, kernel, error)
"""


def test_int8_matmul_at_the_evaluations_row_counts_finishes_and_is_right():
    """Each shape's first call autotunes it; the whole sweep runs in a subprocess, so that a kernel that never
    finishes fails the test with the stacks and the shape it reached, instead of hanging the suite."""
    import os
    import sys

    from tests.conftest import ROOT, run_with_stacks

    script = EVAL_SCRIPT.replace("ROWS", repr(EVAL_ROWS)).replace("LAYERS", repr(EVAL_LAYERS))
    result = run_with_stacks([sys.executable, "-c", script], timeout=600, cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": ROOT})
    print(result.stdout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]


def test_int8_matmul_tunes_once_for_row_counts_in_one_power_of_two():
    """Row counts between two powers of two share one tuned config (the autotuner's key is M's power-of-two
    ceiling), so an evaluation's new batch sizes run at once instead of benchmarking every config again."""
    from src.kernels.switchback import kernels
    from src.kernels.switchback import reference as ref

    torch.manual_seed(0)
    k, n = 384, 640  # a layer shape no other test tunes, so the counts below are this test's own
    qw, sw = ref.quantize_int8(torch.randn(n, k, device="cuda"), None)
    for kernel, tuner in (("pointer", kernels._int8_matmul_kernel), ("tma", kernels._int8_matmul_tma_kernel)):
        tuned = len(tuner.cache)
        for rows in (300, 400, 511, 512):
            qx, sx = ref.quantize_int8(torch.randn(rows, k, device="cuda"), 1)
            got = kernels.int8_matmul(qx, sx, qw.t(), sw.reshape(1, 1), None, torch.float32, kernel=kernel)
            assert torch.equal(got, ref.int8_matmul_dequant(qx, sx, qw.t(), sw.reshape(1, 1), None, torch.float32))
        assert len(tuner.cache) == tuned + 1, f"{kernel}: {len(tuner.cache) - tuned} tunings for one bucket"
        qx, sx = ref.quantize_int8(torch.randn(513, k, device="cuda"), 1)
        kernels.int8_matmul(qx, sx, qw.t(), sw.reshape(1, 1), None, torch.float32, kernel=kernel)
        assert len(tuner.cache) == tuned + 2, f"{kernel}: 513 rows did not start the next bucket"
