"""SwitchBack's Triton kernels against the reference path, on the CPU through Triton's interpreter
(tests/interpreter_harness.py says how): the quantized values and scales are bit for bit those of
reference.py, and the int8 matmul's float32 output too. The GPU check is tests/gpu/test_switchback_cuda.py."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from interpreter_harness import INTERPRETED, interpreted, run_under_interpreter

from src.kernels.switchback import reference as ref
from src.kernels.switchback import switchback_linear

pytest.importorskip("triton")
from src.kernels.switchback import kernels  # noqa: E402  (needs triton)

REFERENCE_QUANTIZER = {False: ref.quantize_int8, True: ref.quantize_fp8}


@pytest.mark.skipif(INTERPRETED, reason="this is the subprocess")
def test_kernels_under_the_interpreter():
    run_under_interpreter(__file__)


def as_bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8) if q.dtype == ref.FP8_DTYPE else q


def operand(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of very different magnitudes, one all-zero row, and values on rounding ties (x·127/absmax = k+½)."""
    torch.manual_seed(rows * cols)
    x = torch.randn(rows, cols) * torch.rand(rows, 1) * 10
    x[min(3, rows - 1)] = 0
    x[0, :4] = torch.tensor([127.0, -63.5, 0.5, 2.5])
    return x.to(dtype)


@interpreted
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(37, 300), (16, 64), (1, 5)])
def test_quantize_rows_is_bitwise_the_reference(fp8, dtype, shape):
    x = operand(*shape, dtype)
    q, scale, column_sums = kernels.quantize_rows(x, fp8, column_sums=True)
    want_q, want_scale = REFERENCE_QUANTIZER[fp8](x, 1)
    assert torch.equal(as_bits(q), as_bits(want_q)) and torch.equal(scale, want_scale)
    torch.testing.assert_close(column_sums, x.float().sum(0), rtol=1e-6, atol=1e-5)


@pytest.mark.skipif(INTERPRETED, reason="runs its own subprocess under the interpreter")
def test_bench_candidate_quantizer_in_two_pieces_is_bitwise_the_kernel():
    """bench/quantize_rows.py's candidate (each row loaded as two power-of-two pieces) quantizes as the kernel,
    and sums the columns as it does (the same rows per program): the script's own --check, through the
    interpreter, at several shapes and rows per block, int8 and fp8, with and without column sums."""
    root = Path(__file__).parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, str(root / "bench" / "quantize_rows.py"), "--check"], cwd=root, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "quantize_rows_split matches kernels.quantize_rows" in result.stdout


@interpreted
@pytest.mark.parametrize("fp8", [False, True])
def test_quantize_rows_of_a_transposed_view_is_column_wise(fp8):
    w = operand(50, 70, torch.float32)
    q, scale, column_sums = kernels.quantize_rows(w.t(), fp8)
    want_q, want_scale = REFERENCE_QUANTIZER[fp8](w, 0)
    assert torch.equal(as_bits(q.t().contiguous()), as_bits(want_q))
    assert torch.equal(scale.reshape(1, -1), want_scale) and column_sums is None


@interpreted
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("shape", [(50, 70), (64, 128), (3, 200)])
def test_quantize_tensor_writes_w_and_its_transpose(fp8, shape):
    w = operand(*shape, torch.float32)
    q, qt, row_scale, column_scale = kernels.quantize_tensor(w, fp8, transpose=True)
    want_q, want_scale = REFERENCE_QUANTIZER[fp8](w, None)
    assert torch.equal(as_bits(q), as_bits(want_q)) and torch.equal(as_bits(qt), as_bits(want_q.t().contiguous()))
    assert torch.equal(row_scale, want_scale.reshape(1, 1).expand(1, shape[0]))
    assert torch.equal(column_scale, want_scale.reshape(1, 1).expand(1, shape[1]))


@interpreted
@pytest.mark.parametrize("per_column", [True, False])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("b_layout", ["k_contiguous", "n_contiguous"])
@pytest.mark.parametrize("kernel", ["pointer", "tma"])
def test_int8_matmul_with_dequantize_and_bias_epilogue(per_column, with_bias, b_layout, kernel):
    inner = 208 if kernel == "tma" else 200  # TMA rows must be 16-byte aligned; the pointer kernel takes any K
    qa, sa = ref.quantize_int8(operand(70, inner, torch.float32), 1)
    qw, sw = ref.quantize_int8(operand(90, inner, torch.float32), 1 if per_column else None)
    qb = qw.t() if b_layout == "k_contiguous" else qw.t().contiguous()
    sb = sw.reshape(1, -1)
    bias = torch.randn(90) if with_bias else None
    for out_dtype in (torch.float32, torch.bfloat16):
        got = kernels.int8_matmul(qa, sa, qb, sb, bias, out_dtype, kernel=kernel)
        want = ref.int8_matmul_dequant(qa, sa, qb, sb, bias, out_dtype)
        if out_dtype == torch.float32:
            assert torch.equal(got, want)
        else:  # the interpreter's float32 -> bf16 cast truncates where the GPU's rounds to nearest even
            torch.testing.assert_close(got, want, rtol=2**-7, atol=0)


@interpreted
def test_int8_matmul_rejects_an_unknown_kernel_and_tma_where_it_cannot_run():
    qa, sa = ref.quantize_int8(operand(4, 16, torch.float32), 1)
    with pytest.raises(ValueError, match="kernel='cublas'"):
        kernels.int8_matmul(qa, sa, qa.t(), sa.reshape(1, -1), None, torch.float32, kernel="cublas")
    qa, sa = ref.quantize_int8(operand(4, 24, torch.float32), 1)
    with pytest.raises(ValueError, match=r"K a multiple of 16 \(K=24\)"):
        kernels.int8_matmul(qa, sa, qa.t(), sa.reshape(1, -1), None, torch.float32, kernel="tma")
    got = kernels.int8_matmul(qa, sa, qa.t(), sa.reshape(1, -1), None, torch.float32)  # auto: plain loads
    assert torch.equal(got, ref.int8_matmul_dequant(qa, sa, qa.t(), sa.reshape(1, -1), None, torch.float32))


@interpreted
@pytest.mark.parametrize("variant", ["switchback_int8", "switchback_int8_memeff", "switchback_int8_vectorwise"])
def test_layer_on_the_kernels_equals_the_reference_backend(variant):
    x, w = operand(40, 96, torch.float32), operand(48, 96, torch.float32) / 10
    b, g = torch.randn(48), torch.randn(40, 48)
    results = []
    for backend in ("cuda", "reference"):
        xi, wi, bi = (t.clone().requires_grad_() for t in (x, w, b))
        y = switchback_linear(xi, wi, bi, variant, backend)
        y.backward(g)
        results.append((y, xi.grad, wi.grad, bi.grad))
    (y, dx, dw, db), (want_y, want_dx, want_dw, want_db) = results
    assert torch.equal(y, want_y) and torch.equal(dx, want_dx) and torch.equal(dw, want_dw)
    torch.testing.assert_close(db, want_db, rtol=1e-6, atol=1e-5)  # float32 sums, in another order
