"""The fused residual + LayerNorm (src/models/residual_norm.py) against PyTorch's ops in float64, forward and
backward, on the CPU through Triton's interpreter (tests/interpreter_harness.py says how)."""

import pytest
import torch
import torch.nn.functional as F
from interpreter_harness import INTERPRETED, interpreted, run_under_interpreter

from src.models import residual_norm as rn
from src.models.transformer import Transformer, set_residual_norm

pytest.importorskip("triton")


@pytest.mark.skipif(INTERPRETED, reason="this is the subprocess")
def test_kernels_under_the_interpreter():
    run_under_interpreter(__file__)


def inputs(rows: int, width: int, dtype: torch.dtype = torch.bfloat16):
    torch.manual_seed(rows * width)
    x = torch.randn(rows, width) * 3 + 1
    a = torch.randn(rows, width).to(dtype)
    gamma, weight, bias = torch.rand(width) + 0.1, torch.randn(width), torch.randn(width)
    return x, a, gamma, weight, bias


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


@interpreted
@pytest.mark.parametrize(("rows", "width", "rows_per_program"), [(70, 48, 32), (5, 80, 32), (33, 64, 4), (9, 3, 4)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_forward_and_gradients_match_float64(monkeypatch, rows, width, rows_per_program, dtype):
    """Widths that fill the row block and ones that leave it part empty; rows that leave the last program part
    empty; several programs' partial column sums."""
    monkeypatch.setattr(rn, "ROWS", rows_per_program)
    x, a, gamma, weight, bias = inputs(rows, width, dtype)
    leaves = [t.clone().requires_grad_() for t in (x, a, gamma, weight, bias)]
    x1, y = rn.residual_norm(*leaves, eps=1e-5)
    grad_x1, grad_y = torch.randn(rows, width), torch.randn(rows, width).to(dtype)
    torch.autograd.backward([x1, y], [grad_x1, grad_y])

    exact = [t.double().requires_grad_() for t in (x, a, gamma, weight, bias)]
    want_x1 = exact[0] + exact[1] * exact[2]
    want_y = F.layer_norm(want_x1, (width,), exact[3], exact[4], 1e-5)
    torch.autograd.backward([want_x1, want_y], [grad_x1.double(), grad_y.double()])

    assert x1.dtype == torch.float32 and y.dtype == dtype
    assert rel_error(x1, want_x1) < 1e-6
    assert rel_error(y, want_y) < 2 ** -7  # rounded to 16 bits once
    for leaf, want in zip(leaves, exact):
        assert leaf.grad.dtype == leaf.dtype
        tolerance = 2 ** -7 if leaf.dtype != torch.float32 else 1e-5
        assert rel_error(leaf.grad, want.grad) < tolerance, (leaf.shape, rel_error(leaf.grad, want.grad))


@interpreted
def test_ops_pass_opcheck():
    x, a, gamma, weight, bias = inputs(6, 16)
    torch.library.opcheck(torch.ops.stableclip.residual_norm_forward.default, (x, a, gamma, weight, bias, 1e-5),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@interpreted
def test_refuses_a_float64_branch_output():
    x, a, gamma, weight, bias = inputs(4, 8)
    with pytest.raises(ValueError, match="float16 branch output, got torch.float32 and torch.float64"):
        rn.residual_norm(x, a.double(), gamma, weight, bias)


@pytest.mark.skipif(INTERPRETED, reason="the interpreter runs the kernels on the CPU")
def test_refuses_the_cpu_with_the_reason():
    with pytest.raises(ValueError, match="residual_norm=fused cannot run here: it needs a CUDA GPU"):
        rn.residual_norm(*inputs(4, 8))


def test_runs_on_the_meta_device_for_flop_counting():
    """bench/throughput.py counts FLOPs on a meta-device copy of the model: forward and backward must trace."""
    with torch.device("meta"):
        tower = Transformer(width=16, layers=1, heads=2, mlp_ratio=2.0, ls_init_value=0.1)
        x = torch.randn(2, 5, 16, requires_grad=True)
    set_residual_norm(tower, "fused")
    out = tower(x)
    out.sum().backward()
    assert out.shape == (2, 5, 16) and out.device.type == "meta" and x.grad.shape == x.shape


@interpreted
def test_blocks_with_the_fused_kernels_train_like_the_unfused_ones():
    """model.residual_norm=fused: a small transformer under bf16 autocast lands as close to the float64
    computation, output and every gradient, as the unfused blocks do (both round to bf16 in many places, so they
    differ from each other by up to about 2% of the largest value)."""

    def run(fused: bool, dtype: torch.dtype | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        transformer = Transformer(width=32, layers=2, heads=2, mlp_ratio=4.0, ls_init_value=0.5)
        transformer.init_weights()
        set_residual_norm(transformer, "fused" if fused else "unfused")
        x = torch.randn(3, 7, 32)
        if dtype is None:
            transformer, x = transformer.double(), x.double()
        x.requires_grad_()
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            out = transformer(x)
        out.double().square().mean().backward()
        return [out, x.grad] + [p.grad for p in transformer.parameters()]

    exact, unfused, fused = run(False, None), run(False, torch.bfloat16), run(True, torch.bfloat16)
    for want, theirs, ours in zip(exact, unfused, fused):
        assert rel_error(ours, want) <= 2 * rel_error(theirs, want) + 1e-3, (rel_error(ours, want),
                                                                             rel_error(theirs, want))


def test_auto_runs_unfused_on_the_cpu_and_bad_modes_are_named():
    torch.manual_seed(0)
    tower = Transformer(width=16, layers=1, heads=2, mlp_ratio=2.0, ls_init_value=0.1)
    tower.init_weights()  # the constructor leaves parameters uninitialised (built on meta in practice)
    x = torch.randn(2, 5, 16)
    assert not rn.applies(x, x)
    set_residual_norm(tower, "unfused")
    want = tower(x)
    set_residual_norm(tower, "auto")
    assert torch.isfinite(want).all() and torch.equal(tower(x), want)
    with pytest.raises(ValueError, match="model.residual_norm='on' is not one of auto, fused, unfused"):
        set_residual_norm(tower, "on")
