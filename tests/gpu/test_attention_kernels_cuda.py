"""GPU check of our attention kernels (run on the device: `python -m pytest -q tests/gpu`): the one-tile kernel
at the shapes of ViT-B/32's image tower and of the text towers, the tiled one at those of ViT-B/16, ViT-L/14 and
ViT-H/14's image towers, each equal to float64 attention up to 16-bit rounding, every output element included,
with no NaN; `auto` takes them where it should; compiled blocks use them without a graph break."""

import pytest
import torch

from src.kernels.attention import short as short_attention_module
from src.kernels.attention import tiled as tiled_attention_module
from src.kernels.attention.short import short_attention
from src.kernels.attention.tiled import tiled_attention
from src.kernels.dispatch import set_attention_backend, with_kernel_modules
from src.models.transformer import Transformer, sdpa_attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize(("kernel", "batch", "length", "heads", "head_dim", "causal"), [
    (short_attention, 64, 50, 12, 64, False),  # ViT-B/32 image tower
    (short_attention, 64, 77, 8, 64, True),  # ViT-B/32 text tower
    (short_attention, 64, 77, 16, 64, True),  # ViT-H/14 text tower
    (short_attention, 64, 128, 4, 80, False),
    (short_attention, 64, 1, 2, 32, True),
    (tiled_attention, 16, 257, 16, 64, False),  # ViT-L/14 image tower
    (tiled_attention, 16, 257, 16, 80, False),  # ViT-H/14 image tower: column blocks of 64 and 16
    (tiled_attention, 16, 257, 8, 96, True),  # column blocks of 64 and 32
    (tiled_attention, 16, 197, 12, 64, False),  # ViT-B/16 image tower
    (tiled_attention, 8, 577, 16, 64, False),  # ViT-L/14 at 336 px
    (tiled_attention, 16, 200, 8, 64, True),
    (tiled_attention, 16, 256, 4, 128, True),  # whole tiles only, the largest head
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_equals_float64_attention(kernel, batch, length, heads, head_dim, causal, dtype):
    torch.manual_seed(length)
    width = heads * head_dim
    qkv = (torch.randn(batch, length, 3 * width, device="cuda") * 2).to(dtype).requires_grad_()
    out = kernel(qkv, heads, causal)
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


def test_auto_takes_our_kernels_where_they_apply_in_16_bits(monkeypatch):
    calls = []
    for module, name in ((short_attention_module, "short_attention"), (tiled_attention_module, "tiled_attention")):
        kernel = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *args, kernel=kernel, name=name: calls.append(name) or kernel(*args))
    tower = with_kernel_modules(Transformer(128, 1, 2, 4.0, ls_init_value=0.1).cuda())  # attention_backend=auto
    tower.init_weights()
    longest = tiled_attention_module.AUTO_MAX_LENGTH
    for tokens, bf16, expected in ((77, True, ["short_attention"]), (128, True, ["short_attention"]),
                                   (129, True, ["tiled_attention"] if longest >= 129 else []),
                                   (257, True, ["tiled_attention"] if longest >= 257 else []),
                                   (longest + 1, True, []), (77, False, []), (257, False, [])):
        calls.clear()
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            tower(torch.randn(4, tokens, 128, device="cuda"), causal=True)
        assert calls == expected, (tokens, bf16)
    # A lower threshold for the one-tile kernel (bench/throughput.py --set "py:...AUTO_MAX_LENGTH=64") hands the
    # text towers' 77 tokens to the tiled kernel.
    monkeypatch.setattr(short_attention_module, "AUTO_MAX_LENGTH", 64)
    for tokens, expected in ((50, ["short_attention"]), (77, ["tiled_attention"])):
        calls.clear()
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            tower(torch.randn(4, tokens, 128, device="cuda"), causal=True)
        assert calls == expected, tokens
    # Heads of 80 features (ViT-H/14's) too, as two column blocks.
    tower = with_kernel_modules(Transformer(160, 1, 2, 4.0, ls_init_value=0.1).cuda())  # attention_backend=auto
    tower.init_weights()
    calls.clear()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        tower(torch.randn(4, 257, 160, device="cuda"))
    assert calls == ["tiled_attention"]


@pytest.mark.parametrize(("backend", "tokens"), [("triton_short", 77), ("triton_tiled", 257)])
def test_compiled_tower_uses_the_kernel_without_graph_breaks(backend, tokens):
    torch.manual_seed(0)
    tower = Transformer(256, 2, 4, 4.0, ls_init_value=0.1).cuda()
    tower.init_weights()
    x = torch.randn(8, tokens, 256, device="cuda")
    results = []
    for name in ("cudnn", backend):
        set_attention_backend(tower, name)
        torch._dynamo.reset()
        compiled = torch.compile(tower, fullgraph=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = compiled(x, causal=True)
        (grad,) = torch.autograd.grad(out.float().square().sum(), tower.resblocks[0].attn.in_proj_weight)
        results.append((out.float(), grad))
    (sdpa_out, sdpa_grad), (ours, our_grad) = results
    assert ((ours - sdpa_out).norm() / sdpa_out.norm()).item() < 1e-2
    assert ((our_grad - sdpa_grad).norm() / sdpa_grad.norm()).item() < 2e-2
