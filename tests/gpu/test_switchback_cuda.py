"""GPU check of SwitchBack (run on the device: `python -m pytest -q tests/gpu`): the cuda backend equals the
reference path on random inputs of ViT-H/14 shapes, with no NaN and every output written."""

import pytest
import torch

from src.models.switchback import VARIANTS, switchback_linear

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SHAPES = [(1280, 3840), (1280, 5120), (5120, 1280)]  # (in, out) of qkv, fc1, fc2 in ViT-H/14
TOKENS = 256 * 257


def runnable(variant: str) -> bool:
    return not VARIANTS[variant].fp8 or torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("features", SHAPES)
def test_cuda_backend_equals_reference(variant, features):
    if not runnable(variant):
        pytest.skip("no fp8 on this GPU")
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
        y = switchback_linear(xi, w, b, variant, backend)
        y.backward(g)
        results.append((y.float(), xi.grad.float(), w.grad.clone(), b.grad.clone()))
    for got, want, name in zip(results[0], results[1], ("y", "dx", "dw", "db")):
        assert torch.isfinite(got).all(), name
        # Same arithmetic; what differs is the accumulators' summation order, bf16 rounding of the outputs and,
        # where the compiled quantizer rounds a tie the other way, a single step of 1/127 (or one fp8 ulp).
        error = ((got - want).norm() / want.norm()).item()
        assert error < 1e-2, f"{variant} {features} {name}: relative error {error:.2e}"
