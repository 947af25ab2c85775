"""model.gelu=rational on CUDA, compiled by TorchInductor as the blocks run it, against F.gelu in float64 (run on
the device: `python -m pytest -q -n 0 --noconftest tests/gpu`)."""

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])  # float32: F.gelu itself
def test_compiled_matches_float64(dtype):
    from src.kernels.gelu import rational_gelu

    torch.manual_seed(0)
    h = (torch.randn(4111, 3072, device="cuda") * 3).to(dtype).requires_grad_()
    grad = torch.randn_like(h)
    out = torch.compile(rational_gelu, dynamic=False)(h)
    (dh,) = torch.autograd.grad(out, h, grad)
    exact = h.detach().double().requires_grad_()
    want = F.gelu(exact)
    (want_dh,) = torch.autograd.grad(want, exact, grad.double())
    assert out.dtype == dtype and dh.dtype == dtype
    assert torch.isfinite(out).all() and torch.isfinite(dh).all()
    # Within one rounding of the result's dtype (plus the fit's 1.5e-7 on erf) everywhere.
    ulp = {torch.bfloat16: 2**-8, torch.float16: 2**-11, torch.float32: 2**-23}[dtype]
    torch.testing.assert_close(out.double(), want, rtol=ulp, atol=2e-6)
    torch.testing.assert_close(dh.double(), want_dh, rtol=ulp, atol=2e-6 * grad.abs().max().item())
