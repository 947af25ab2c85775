"""The short-sequence attention kernel (model.attention_backend=triton_short) against PyTorch's attention in
float64, on the CPU through Triton's interpreter (tests/interpreter_harness.py says how). The GPU check is
tests/gpu/test_short_attention_cuda.py."""

import pytest
import torch
from interpreter_harness import INTERPRETED, interpreted, run_under_interpreter

from src.models import short_attention as sa
from src.models.transformer import Attention, Transformer, sdpa_attention, set_attention_backend

pytest.importorskip("triton")

# Largest error over the largest reference value. FlashAttention's rounding of P to 16 bits before P·V
# (which PyTorch's CPU kernel skips) roughly doubles bf16 SDPA's own error (0.0023 and 0.0041 here).
TOLERANCE = {torch.bfloat16: (1e-2, 1.5e-2), torch.float16: (2e-3, 3e-3)}


@pytest.mark.skipif(INTERPRETED, reason="this is the subprocess")
def test_kernels_under_the_interpreter():
    run_under_interpreter(__file__)


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected).abs().max() / expected.abs().max()).item()


@interpreted
@pytest.mark.parametrize(("batch", "length", "heads", "head_dim", "causal", "dtype"), [
    (3, 50, 3, 64, False, torch.bfloat16),  # ViT-B/32's image tower: 50 tokens in a tile of 64
    (2, 77, 2, 64, True, torch.bfloat16),  # a text tower: causal, 77 tokens in a tile of 128
    (1, 128, 2, 32, True, torch.bfloat16),  # a full tile
    (2, 20, 2, 80, False, torch.float16),  # a head size that is not a power of 2 (ViT-H's 80)
    (2, 1, 1, 16, False, torch.bfloat16),  # one token
    (1, 17, 4, 16, True, torch.float16),
])
def test_forward_and_gradient_match_float64_attention(batch, length, heads, head_dim, causal, dtype):
    torch.manual_seed(length * heads + head_dim)
    width = heads * head_dim
    qkv = (torch.randn(batch, length, 3 * width) * 2).to(dtype).requires_grad_()
    out = sa.short_attention(qkv, heads, causal)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)

    qkv64 = qkv.detach().double().requires_grad_()
    expected = sdpa_attention(qkv64, heads, causal)
    expected.backward(grad_out.double())

    assert out.dtype == dtype and qkv.grad.dtype == dtype
    out_tolerance, grad_tolerance = TOLERANCE[dtype]
    assert rel_error(out, expected) < out_tolerance
    assert rel_error(qkv.grad, qkv64.grad) < grad_tolerance


@interpreted
@pytest.mark.parametrize("causal", [False, True])
def test_attention_module_with_triton_short_matches_sdpa(causal):
    """The whole `Attention` under bf16 autocast, with the QKV projection's gradients: the kernel reads the
    projection's output and writes its gradient in place of SDPA and the copies around it."""
    torch.manual_seed(0)
    modules = [Attention(64, 4) for _ in range(2)]
    for parameter in modules[0].parameters():
        torch.nn.init.normal_(parameter, std=0.2)
    modules[1].load_state_dict(modules[0].state_dict())
    set_attention_backend(modules[1], "triton_short")
    x = torch.randn(2, 40, 64)
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
def test_longer_sequences_keep_sdpa():
    """Past 128 tokens the module uses PyTorch's attention (the kernel holds a sequence in one tile)."""
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
def test_custom_ops_pass_torch_library_checks():
    qkv = torch.randn(2, 9, 3 * 32).bfloat16().requires_grad_()
    torch.library.opcheck(torch.ops.stableclip.short_attention_forward.default, (qkv, 2, True),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@pytest.mark.skipif(INTERPRETED, reason="the interpreter runs CPU tensors")
def test_cpu_tensors_fail_with_the_fix_and_auto_keeps_sdpa():
    qkv = torch.zeros(1, 4, 96, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="needs a CUDA GPU, but the model is on cpu; or use model.attention_backend="):
        sa.short_attention(qkv, 2)
    assert not sa.applies(qkv, 2)


@interpreted
def test_float32_activations_fail_with_the_fix():
    with pytest.raises(ValueError, match="it needs bf16 or fp16 activations, got torch.float32"):
        sa.short_attention(torch.zeros(1, 4, 96), 2)
