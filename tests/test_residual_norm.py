"""The fused residual + LayerNorm (src/kernels/residual_norm.py) against PyTorch's ops in float64, forward and
backward, on the CPU through Triton's interpreter (tests/interpreter_harness.py says how)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from interpreter_harness import INTERPRETED, interpreted, run_under_interpreter

from src.kernels import residual_norm as rn
from src.kernels.dispatch import set_residual_norm
from src.models.transformer import Transformer

pytest.importorskip("triton")
from triton.runtime.errors import OutOfResources  # noqa: E402


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
@pytest.mark.parametrize(("rows", "width", "rows_per_program", "stages"),
                         [(70, 48, 32, 1), (5, 80, 32, 3), (33, 64, 4, 2), (9, 3, 4, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("save_sum", [False, True])
@pytest.mark.parametrize("with_a_bias", [False, True])
def test_forward_and_gradients_match_float64(monkeypatch, rows, width, rows_per_program, stages, dtype, save_sum,
                                             with_a_bias):
    """Widths that fill the row block and ones that leave it part empty; rows that leave the last program part
    empty; several programs' partial column sums; the backward from x or from x1; with and without pipelining
    the loop over rows; with and without a bias on the branch output (its gradient a fourth column sum)."""
    monkeypatch.setattr(rn, "ROWS", rows_per_program)
    monkeypatch.setattr(rn, "STAGES", stages)
    x, a, gamma, weight, bias = inputs(rows, width, dtype)
    a_bias = torch.randn(width) if with_a_bias else torch.zeros(width)
    leaves = [t.clone().requires_grad_() for t in (x, a, gamma, weight, bias, a_bias)]
    x1, y = rn.residual_norm(*leaves[:5], eps=1e-5, save_sum=save_sum, a_bias=leaves[5] if with_a_bias else None)
    grad_x1, grad_y = torch.randn(rows, width), torch.randn(rows, width).to(dtype)
    torch.autograd.backward([x1, y], [grad_x1, grad_y])
    if not with_a_bias:
        leaves.pop()

    exact = [t.double().requires_grad_() for t in (x, a, gamma, weight, bias, a_bias)]
    want_x1 = exact[0] + (exact[1] + exact[5]) * exact[2]
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
    for a_bias in (None, torch.randn(16)):
        torch.library.opcheck(torch.ops.stableclip.residual_norm_forward.default,
                              (x, a, a_bias, gamma, weight, bias, 1e-5, True),
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


class KernelWithSharedMemoryFor:
    """A stand-in for a Triton kernel on a GPU whose shared memory holds `stages` pipelining stages: more, and the
    launch is refused as Triton refuses it, before anything runs."""

    def __init__(self, stages: int):
        self.stages, self.launched, self.refused = stages, [], 0

    def __getitem__(self, grid):
        def launch(*args, STAGES: int, **meta):
            if STAGES > self.stages:
                self.refused += 1
                raise OutOfResources(16_384 * STAGES, 16_384 * self.stages, "shared memory")
            self.launched.append((grid, STAGES, meta["BLOCK_W"]))
        return launch


@pytest.mark.skipif(INTERPRETED, reason="no kernel runs")
def test_launches_fall_back_to_fewer_stages_where_shared_memory_is_short(monkeypatch):
    """On GPUs with less shared memory per block than a Hopper's, wide rows do not fit STAGES stages: the launch
    takes as many as fit, remembers that for the width, and fails with Triton's error only where even one does not."""
    monkeypatch.setattr(rn, "STAGES", 3)
    monkeypatch.setattr(rn, "_fitting_stages", {})
    kernel = KernelWithSharedMemoryFor(1)
    for _ in range(2):
        rn._launch(kernel, 7, torch.device("cuda", 0), BLOCK_W=8192)
    assert kernel.launched == [((7,), 1, 8192)] * 2 and kernel.refused == 2  # 3 and 2, the first time only
    roomy = KernelWithSharedMemoryFor(3)
    rn._launch(roomy, 7, torch.device("cuda", 0), BLOCK_W=1024)
    assert roomy.launched == [((7,), 3, 1024)] and roomy.refused == 0
    with pytest.raises(OutOfResources):
        rn._launch(KernelWithSharedMemoryFor(0), 7, torch.device("cuda", 0), BLOCK_W=16_384)


def counting_calls(monkeypatch) -> list:
    """Count the fused kernels' calls (each one forward)."""
    calls, original = [], rn.residual_norm
    monkeypatch.setattr(rn, "residual_norm", lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs))
    return calls


@pytest.mark.parametrize("final_norm", [False, True])
def test_runs_on_the_meta_device_for_flop_counting(monkeypatch, final_norm):
    """bench/throughput.py counts FLOPs on a meta-device copy of the model: forward and backward must trace,
    blocks alone and chained."""
    calls = counting_calls(monkeypatch)
    with torch.device("meta"):
        tower = Transformer(width=16, layers=2, heads=2, mlp_ratio=2.0, ls_init_value=0.1)
        norm = torch.nn.LayerNorm(16) if final_norm else None
        x = torch.randn(2, 5, 16, requires_grad=True)
    set_residual_norm(tower, "fused")
    out = tower(x, final_norm=norm)
    out.sum().backward()
    assert out.shape == (2, 5, 16) and out.device.type == "meta" and x.grad.shape == x.shape
    assert len(calls) == (4 if final_norm else 2)


@interpreted
@pytest.mark.parametrize("chained", [False, True])
def test_blocks_with_the_fused_kernels_train_like_the_unfused_ones(monkeypatch, chained):
    """model.residual_norm=fused: a small transformer under bf16 autocast lands as close to the float64
    computation, output and every gradient, as the unfused blocks do (both round to bf16 in many places, so they
    differ from each other by up to about 2% of the largest value). Chained (a final norm given): each closing
    residual is fused with the next block's ln_1, the last with the final norm."""
    calls, normed_dtypes = counting_calls(monkeypatch), []

    def run(fused: bool, dtype: torch.dtype | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        transformer = Transformer(width=32, layers=3, heads=2, mlp_ratio=4.0, ls_init_value=0.5)
        transformer.init_weights()
        final_norm = torch.nn.LayerNorm(32)
        with torch.no_grad():
            final_norm.weight.uniform_(0.5, 1.5)
            final_norm.bias.uniform_(-0.5, 0.5)
            for block in transformer.resblocks:  # the biases the fused kernels add, not left at their init's 0
                block.attn.out_proj.bias.uniform_(-0.5, 0.5)
                block.mlp.c_proj.bias.uniform_(-0.5, 0.5)
        set_residual_norm(transformer, "fused" if fused else "unfused")
        for block in transformer.resblocks:
            block.register_forward_pre_hook(
                lambda _, args, kwargs: normed_dtypes.append(kwargs["normed"].dtype) if "normed" in kwargs else None,
                with_kwargs=True)
        x = torch.randn(3, 7, 32)
        if dtype is None:
            transformer, final_norm, x = transformer.double(), final_norm.double(), x.double()
        x.requires_grad_()
        # A projection after the tower, as in CLIP's towers: under autocast it takes the output in 16 bits,
        # which the chain's final norm writes and the unfused path's norm leaves to the matmul's cast.
        projection = torch.randn(32, 8, dtype=x.dtype) / 32**0.5
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            out = transformer(x, final_norm=final_norm if chained else None)
            assert out.dtype == x.dtype  # as LayerNorm's output under autocast, chained or not
            out = out @ projection
        out.double().square().mean().backward()
        return [out, x.grad] + [p.grad for p in (*transformer.parameters(), *final_norm.parameters())
                                if p.grad is not None]

    exact, unfused = run(False, None), run(False, torch.bfloat16)
    assert not calls
    normed_dtypes.clear()
    fused = run(True, torch.bfloat16)
    assert len(calls) == (6 if chained else 3)
    # One dtype for every block's normed input, the first block's included: one compiled graph for all.
    assert normed_dtypes == ([torch.bfloat16] * 3 if chained else [])
    assert len(fused) == len(exact) == len(unfused)
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


@pytest.mark.parametrize(("policy", "chain_blocks", "chained"), [
    ("none", True, True), ("full", True, False), ("none", False, False)])
def test_checkpointing_and_fsdp_keep_blocks_apart(monkeypatch, policy, chain_blocks, chained):
    """A checkpointed block would keep its ln_1 input as well as x, and under FSDP2 the next block's norm is
    still sharded while a block runs: both leave each closing residual to its own block."""
    calls = counting_calls(monkeypatch)
    with torch.device("meta"):
        tower = Transformer(width=16, layers=2, heads=2, mlp_ratio=2.0, ls_init_value=0.1)
        norm = torch.nn.LayerNorm(16)
        x = torch.randn(2, 5, 16, requires_grad=True)
    set_residual_norm(tower, "fused")
    tower.set_checkpointing(policy)
    tower.chain_blocks = chain_blocks
    tower(x, final_norm=norm)
    assert len(calls) == (4 if chained else 2)


@interpreted
def test_compiled_chained_blocks_share_one_graph_and_match_eager():
    """train.py's regional compilation of a chained tower: every block takes its neighbour's norm parameters as
    inputs and still runs the one compiled graph (a recompile per block would exhaust Dynamo's cache and fall
    back to eager), with the eager chain's output and gradients."""
    from src.parallel.parallelize import apply_compile

    def run(tower: Transformer, final_norm: torch.nn.LayerNorm) -> list[torch.Tensor]:
        x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
        out = tower(x, final_norm=final_norm)
        out.square().mean().backward()
        return [out, x.grad] + [p.grad for p in (*tower.parameters(), *final_norm.parameters())]

    torch.manual_seed(0)
    eager, compiled = (Transformer(width=32, layers=3, heads=2, mlp_ratio=2.0, ls_init_value=0.5) for _ in "ab")
    eager.init_weights()
    compiled.load_state_dict(eager.state_dict())
    norms = torch.nn.LayerNorm(32), torch.nn.LayerNorm(32)
    for tower in (eager, compiled):
        set_residual_norm(tower, "fused")
    want = run(eager, norms[0])
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    assert apply_compile(compiled) == 3
    got = run(compiled, norms[1])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(INTERPRETED, reason="compiles for the GPU, which the interpreter replaces")
def test_kernel_resources_compile_for_sm90_without_a_gpu():
    """bench/kernel_resources.py --residual-norm compiles both kernels for an H100/H200 on this CPU and reports
    their registers and spills: how a launch setting is checked before it is timed."""
    result = subprocess.run([sys.executable, "bench/kernel_resources.py", "--residual-norm", "--configs", "32,8,2",
                             "--widths", "1280"], cwd=Path(__file__).parent.parent, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [row["kernel"] for row in rows] == ["forward", "backward"]
    for row in rows:
        assert 0 < row["registers"] <= 255 and row["spill_stack_bytes"] >= 0
