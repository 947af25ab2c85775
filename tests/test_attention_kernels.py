"""Our attention kernels, the one-tile kernel (model.attention_backend=triton_short, at most 128 tokens) and the
tiled one (triton_tiled, any length), against PyTorch's attention in float64, on the CPU through Triton's
interpreter (tests/interpreter_harness.py says how). The GPU check is tests/gpu/test_attention_kernels_cuda.py."""

import json
import subprocess
import sys

import pytest
import torch
from interpreter_harness import INTERPRETED, ROOT, interpreted, run_under_interpreter

from src.kernels.attention import short as sa
from src.kernels.attention import tiled as ta
from src.kernels.dispatch import set_attention_backend
from src.models.transformer import Attention, Transformer, sdpa_attention

pytest.importorskip("triton")

# Largest error over the largest reference value. FlashAttention's rounding of P to 16 bits before P·V
# (which PyTorch's CPU kernel skips) roughly doubles bf16 SDPA's own error (0.0023 and 0.0041 here).
TOLERANCE = {torch.bfloat16: (1e-2, 1.5e-2), torch.float16: (2e-3, 3e-3)}
KERNELS = {"triton_short": sa.short_attention, "triton_tiled": ta.tiled_attention}
FORWARD_OPS = {"triton_short": "short_attention_forward", "triton_tiled": "tiled_attention_forward"}


@pytest.mark.skipif(INTERPRETED, reason="this is the subprocess")
def test_kernels_under_the_interpreter():
    run_under_interpreter(__file__)


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected).abs().max() / expected.abs().max()).item()


def test_heads_that_are_not_a_power_of_2_split_into_two_column_blocks():
    assert ta._column_blocks(64) == (64, 0)
    assert ta._column_blocks(80) == (64, 16)  # ViT-H/14: 80 columns computed, not 128
    assert ta._column_blocks(96) == (64, 32)
    assert ta._column_blocks(24) == (32, 0)  # 16 + 16 would cost as much
    assert ta._column_blocks(112) == (128, 0)  # 64 + 64 likewise


def test_tiles_cover_the_sequence_with_a_narrow_tail():
    assert ta._tiles(257) == (4, 16)  # ViT-L/14, ViT-H/14: four tiles of 64 and one of 16 for the class token
    assert ta._tiles(197) == (3, 16)  # ViT-B/16
    assert ta._tiles(192) == (3, 0)  # whole tiles only
    assert ta._tiles(100) == (1, 64)
    assert ta._tiles(5) == (0, 16)
    for length in range(1, 300):  # the statistics' rows hold the tail tile's padding
        full, tail = ta._tiles(length)
        assert length <= full * ta.BLOCK + tail <= ta._lse_rows(length)


@interpreted
@pytest.mark.parametrize(("backend", "batch", "length", "heads", "head_dim", "causal", "dtype"), [
    ("triton_short", 3, 50, 3, 64, False, torch.bfloat16),  # ViT-B/32's image tower: 50 tokens in a tile of 64
    ("triton_short", 2, 77, 2, 64, True, torch.bfloat16),  # a text tower: causal, 77 tokens in a tile of 128
    ("triton_short", 1, 128, 2, 32, True, torch.bfloat16),  # a full tile
    ("triton_short", 2, 20, 2, 80, False, torch.float16),  # a head size that is not a power of 2 (ViT-H's 80)
    ("triton_short", 2, 1, 1, 16, False, torch.bfloat16),  # one token
    ("triton_short", 2, 100, 2, 32, False, torch.bfloat16),  # two blocks of 64, not causal: all four pairs
    ("triton_short", 1, 70, 1, 16, False, torch.float16),  # blocks of 64 and 16, not causal
    ("triton_short", 1, 17, 4, 16, True, torch.float16),
    ("triton_tiled", 1, 257, 2, 64, False, torch.bfloat16),  # ViT-L/14's image tower: a tail tile of 16 for one token
    ("triton_tiled", 2, 130, 2, 80, False, torch.float16),  # ViT-H/14's heads: column blocks of 64 and 16
    ("triton_tiled", 1, 150, 1, 96, True, torch.bfloat16),  # column blocks of 64 and 32
    ("triton_tiled", 1, 192, 2, 32, True, torch.bfloat16),  # whole tiles only, causal
    ("triton_tiled", 2, 100, 1, 16, True, torch.float16),  # a tail tile as wide as a full one
    ("triton_tiled", 2, 40, 3, 32, False, torch.bfloat16),  # shorter than one tile: the tail only
    ("triton_tiled", 1, 1, 1, 16, False, torch.bfloat16),
])
def test_forward_and_gradient_match_float64_attention(backend, batch, length, heads, head_dim, causal, dtype):
    torch.manual_seed(length * heads + head_dim)
    width = heads * head_dim
    qkv = (torch.randn(batch, length, 3 * width) * 2).to(dtype).requires_grad_()
    out = KERNELS[backend](qkv, heads, causal)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)

    qkv64 = qkv.detach().double().requires_grad_()
    expected = sdpa_attention(qkv64, heads, causal)
    expected.backward(grad_out.double())

    assert out.dtype == dtype and qkv.grad.dtype == dtype
    assert torch.isfinite(qkv.grad).all()
    out_tolerance, grad_tolerance = TOLERANCE[dtype]
    assert rel_error(out, expected) < out_tolerance
    assert rel_error(qkv.grad, qkv64.grad) < grad_tolerance


def assert_matches_float64(kernel, batch: int, length: int, head_dim: int, causal: bool) -> None:
    """`kernel` over 2 heads in bf16 against float64 SDPA, output and dQKV."""
    torch.manual_seed(length)
    qkv = (torch.randn(batch, length, 3 * 2 * head_dim) * 2).bfloat16().requires_grad_()
    out = kernel(qkv, 2, causal)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    qkv64 = qkv.detach().double().requires_grad_()
    expected = sdpa_attention(qkv64, 2, causal)
    expected.backward(grad_out.double())
    assert rel_error(out, expected) < TOLERANCE[torch.bfloat16][0]
    assert rel_error(qkv.grad, qkv64.grad) < TOLERANCE[torch.bfloat16][1]


@interpreted
@pytest.mark.parametrize(("block", "step"), [(64, 32), (128, 16), (32, 16)])
@pytest.mark.parametrize(("length", "head_dim", "causal"), [(129, 80, False), (100, 32, True), (65, 16, False)])
def test_tiled_launch_settings_keep_the_result(monkeypatch, block, step, length, head_dim, causal):
    """Other tile sizes and loop steps (what bench/short_attention.py --tiled-configs sweeps) compute the same
    attention: the tails of both, and causal tile skipping, line up."""
    monkeypatch.setattr(ta, "BLOCK", block)
    monkeypatch.setattr(ta, "STEP", step)
    assert_matches_float64(ta.tiled_attention, 1, length, head_dim, causal)


@interpreted
@pytest.mark.parametrize("first_rows", [64, 128])
@pytest.mark.parametrize(("length", "causal"), [(77, True), (100, False), (64, True), (65, False)])
def test_one_tile_kernel_blocks_keep_the_result(monkeypatch, first_rows, length, causal):
    """The one-tile kernel's first block of FIRST_ROWS rows and a second for the rest (64 + 16 for a text
    tower's 77 tokens), or one tile of 128 rows: the same attention and gradient."""
    monkeypatch.setattr(sa, "FIRST_ROWS", first_rows)
    assert_matches_float64(sa.short_attention, 2, length, 32, causal)


@pytest.mark.parametrize(("length", "blocks"), [(50, (64, 0)), (77, (64, 16)), (100, (64, 64)), (128, (64, 64)),
                                                (16, (16, 0)), (65, (64, 16))])
def test_one_tile_kernel_splits_past_64_tokens(length, blocks):
    assert sa._launch_config(length, 64)[:2] == blocks


def test_a_first_block_that_overflows_the_statistics_fails_with_the_fix(monkeypatch):
    monkeypatch.setattr(sa, "FIRST_ROWS", 32)
    assert sa._launch_config(77, 64)[:2] == (32, 64)
    with pytest.raises(ValueError, match="FIRST_ROWS=32 leaves 100 tokens blocks of 32 and 128 rows.*use 64 or 128"):
        sa._launch_config(100, 64)


@pytest.mark.parametrize(("head_dim", "stages"), [(64, 3), (80, 3), (96, 3), (128, 2)])
def test_pipelining_stages_follow_the_first_column_block(head_dim, stages):
    """3 stages where the first column block is at most 64 wide (80 = 64 + 16 measured 1.10x faster with 3
    than with 2 on an H200), 2 for blocks of 128, whose 3 stages ran slower."""
    assert ta._launch_config(257, head_dim)["meta"]["num_stages"] == stages


def test_a_step_that_does_not_divide_the_tile_fails_with_the_fix(monkeypatch):
    monkeypatch.setattr(ta, "STEP", 48)
    with pytest.raises(ValueError, match="tiled_attention.STEP=48 must be a power of 2 of at least 16 that divides"):
        ta._launch_config(257, 64)


@interpreted
@pytest.mark.parametrize("backend", KERNELS)
def test_very_negative_scores_leave_no_nan(backend):
    """Every score of a query far below zero: the padded keys of a tile must not turn exp2(0 - lse) into inf
    and inf · 0 into NaN."""
    torch.manual_seed(0)
    heads, head_dim, length = 1, 16, 70
    qkv = torch.randn(1, length, 3 * head_dim)
    qkv[..., :head_dim] = 30.0  # every query
    qkv[..., head_dim:2 * head_dim] = -30.0  # every key: scores of -30² · 16 / 4 = -3600
    qkv = qkv.bfloat16().requires_grad_()
    out = KERNELS[backend](qkv, heads)
    out.backward(torch.randn_like(out))
    assert torch.isfinite(out).all() and torch.isfinite(qkv.grad).all()


@interpreted
@pytest.mark.parametrize(("backend", "length"), [("triton_short", 40), ("triton_tiled", 140)])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_module_with_our_kernel_matches_sdpa(backend, length, causal):
    """The whole `Attention` under bf16 autocast, with the QKV projection's gradients: the kernel reads the
    projection's output and writes its gradient in place of SDPA and the copies around it."""
    torch.manual_seed(0)
    modules = [Attention(64, 4) for _ in range(2)]
    for parameter in modules[0].parameters():
        torch.nn.init.normal_(parameter, std=0.2)
    modules[1].load_state_dict(modules[0].state_dict())
    set_attention_backend(modules[1], backend)
    x = torch.randn(2, length, 64)
    results = []
    for module in modules:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = module(x, causal=causal)
        out.float().square().sum().backward()
        results.append((out.float(), {n: p.grad for n, p in module.named_parameters()}))
    (sdpa_out, sdpa_grads), (ours_out, our_grads) = results
    assert rel_error(ours_out, sdpa_out.double()) < 2e-2
    for name, grad in sdpa_grads.items():
        assert rel_error(our_grads[name], grad.double()) < 3e-2, name


@interpreted
def test_triton_short_keeps_sdpa_past_128_tokens():
    """Past 128 tokens triton_short uses PyTorch's attention (the kernel holds a sequence in one tile)."""
    torch.manual_seed(0)
    tower = Transformer(32, 1, 2, 2.0, ls_init_value=None)
    tower.init_weights()
    set_attention_backend(tower, "triton_short")
    x = torch.randn(1, 130, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = tower(x)
    set_attention_backend(tower, "auto")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(ours, tower(x))
    with pytest.raises(ValueError, match="cannot run here: it takes sequences of at most 128 tokens, got 130"):
        sa.short_attention(torch.zeros(1, 130, 96, dtype=torch.bfloat16), 2)


@interpreted
@pytest.mark.parametrize("backend", KERNELS)
def test_custom_ops_pass_torch_library_checks(backend):
    qkv = torch.randn(2, 70, 3 * 32).bfloat16().requires_grad_()
    torch.library.opcheck(getattr(torch.ops.stableclip, FORWARD_OPS[backend]).default, (qkv, 2, True),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@interpreted
@pytest.mark.parametrize("backend", KERNELS)
def test_compiles_with_dynamic_shapes(backend):
    """Under torch.compile a recompiled block can get a symbolic sequence length; the fake implementations
    must then not do tile arithmetic on it."""
    kernel = KERNELS[backend]
    qkv = torch.randn(2, 100, 3 * 32).bfloat16().requires_grad_()
    compiled = torch.compile(lambda x: kernel(x, 2).float().square().sum(), backend="aot_eager", dynamic=True,
                             fullgraph=True)
    compiled(qkv).backward()
    expected = qkv.detach().clone().requires_grad_()
    kernel(expected, 2).float().square().sum().backward()
    assert torch.equal(qkv.grad, expected.grad)


@pytest.mark.skipif(INTERPRETED, reason="the interpreter runs CPU tensors")
@pytest.mark.parametrize("backend", KERNELS)
def test_cpu_tensors_fail_with_the_fix_and_auto_keeps_sdpa(backend):
    qkv = torch.zeros(1, 100, 96, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=f"model.attention_backend={backend} cannot run here: it needs a CUDA GPU, "
                                         "but the model is on cpu; or use model.attention_backend=auto"):
        KERNELS[backend](qkv, 2)
    assert not sa.applies(qkv, 2) and not ta.applies(qkv, 2)


@interpreted
@pytest.mark.parametrize("backend", KERNELS)
def test_float32_activations_fail_with_the_fix(backend):
    with pytest.raises(ValueError, match="it needs bf16 or fp16 activations, got torch.float32"):
        KERNELS[backend](torch.zeros(1, 100, 96), 2)


@pytest.mark.skipif(INTERPRETED, reason="compiles for the GPU, which the interpreter replaces")
def test_kernel_resources_compile_for_sm90_without_a_gpu():
    """bench/kernel_resources.py compiles the tiled kernels for an H100/H200 on this CPU and reports their
    registers, spills and shared memory."""
    result = subprocess.run([sys.executable, "bench/kernel_resources.py", "--configs", "64,4,0", "--head-dims", "80"],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [row["kernel"] for row in rows] == ["forward", "grad_query", "grad_key"]
    for row in rows:
        assert 0 < row["registers"] <= 255 and row["spill_stack_bytes"] >= 0 and row["shared_bytes"] > 0
