"""GPU check of the short-sequence attention kernel (run on the device: `python -m pytest -q tests/gpu`): at the
shapes of ViT-B/32's image tower and of the text towers it equals float64 attention up to 16-bit rounding,
every output element included, with no NaN; compiled blocks use it without a graph break."""

import pytest
import torch

from src.models import short_attention as short_attention_module
from src.models.short_attention import short_attention
from src.models.transformer import Transformer, sdpa_attention, set_attention_backend

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize(("length", "heads", "head_dim", "causal"), [
    (50, 12, 64, False),  # ViT-B/32 image tower
    (77, 8, 64, True),  # ViT-B/32 text tower
    (77, 16, 64, True),  # ViT-H/14 text tower
    (128, 4, 80, False),
    (1, 2, 32, True),
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_equals_float64_attention(length, heads, head_dim, causal, dtype):
    torch.manual_seed(length)
    batch, width = 64, heads * head_dim
    qkv = (torch.randn(batch, length, 3 * width, device="cuda") * 2).to(dtype).requires_grad_()
    out = short_attention(qkv, heads, causal)
    grad_out = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, qkv, grad_out)
    qkv64 = qkv.detach().double().requires_grad_()
    expected = sdpa_attention(qkv64, heads, causal)
    (expected_grad,) = torch.autograd.grad(expected, qkv64, grad_out.double())
    # What 16-bit SDPA itself gets wrong (cuDNN or flash, PyTorch's choice), the bound for ours.
    sdpa_out = sdpa_attention(qkv.detach().requires_grad_(), heads, causal)
    for ours, theirs, want, name in ((out, sdpa_out, expected, "out"), (grad, None, expected_grad, "grad")):
        assert torch.isfinite(ours).all(), name
        error = ((ours.double() - want).abs().max() / want.abs().max()).item()
        assert error < (1e-2 if dtype == torch.bfloat16 else 2e-3), f"{name}: {error:.2e}"
        if theirs is not None:
            sdpa_error = ((theirs.double() - want).abs().max() / want.abs().max()).item()
            assert error < 2 * sdpa_error + 1e-3, f"{name}: ours {error:.2e}, SDPA {sdpa_error:.2e}"


def test_auto_takes_the_kernel_up_to_128_tokens_in_16_bits(monkeypatch):
    calls = []
    kernel = short_attention_module.short_attention
    monkeypatch.setattr(short_attention_module, "short_attention", lambda *args: calls.append(1) or kernel(*args))
    tower = Transformer(128, 1, 2, 4.0, ls_init_value=0.1).cuda()
    tower.init_weights()
    for tokens, bf16, expected in ((77, True, True), (128, True, True), (129, True, False), (77, False, False)):
        calls.clear()
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            tower(torch.randn(4, tokens, 128, device="cuda"), causal=True)
        assert bool(calls) == expected, (tokens, bf16)


def test_compiled_tower_uses_the_kernel_without_graph_breaks():
    torch.manual_seed(0)
    tower = Transformer(256, 2, 4, 4.0, ls_init_value=0.1).cuda()
    tower.init_weights()
    x = torch.randn(8, 77, 256, device="cuda")
    results = []
    for backend in ("auto", "triton_short"):
        set_attention_backend(tower, backend)
        torch._dynamo.reset()
        compiled = torch.compile(tower, fullgraph=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = compiled(x, causal=True)
        (grad,) = torch.autograd.grad(out.float().square().sum(), tower.resblocks[0].attn.in_proj_weight)
        results.append((out.float(), grad))
    (sdpa_out, sdpa_grad), (ours, our_grad) = results
    assert ((ours - sdpa_out).norm() / sdpa_out.norm()).item() < 1e-2
    assert ((our_grad - sdpa_grad).norm() / sdpa_grad.norm()).item() < 2e-2
