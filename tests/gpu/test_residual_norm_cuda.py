"""The fused residual + LayerNorm on CUDA against float64 PyTorch, at the image towers' widths, and
deterministic (run on the device: `python -m pytest -q --noconftest tests/gpu`)."""

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("triton")


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


@pytest.mark.parametrize("width", [768, 1024, 1280])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_float64_and_is_deterministic(width, dtype):
    from src.models.residual_norm import residual_norm

    torch.manual_seed(width)
    rows = 4111  # not a multiple of the rows per program
    x = torch.randn(rows, width, device="cuda") * 3 + 1
    a = torch.randn(rows, width, device="cuda").to(dtype)
    params = [torch.rand(width, device="cuda") + 0.1, *(torch.randn(width, device="cuda") for _ in range(2))]
    grad_x1, grad_y = torch.randn(rows, width, device="cuda"), torch.randn(rows, width, device="cuda").to(dtype)

    def run():
        leaves = [t.clone().requires_grad_() for t in (x, a, *params)]
        x1, y = residual_norm(*leaves)
        torch.autograd.backward([x1, y], [grad_x1, grad_y])
        return [x1, y] + [leaf.grad for leaf in leaves]

    got, again = run(), run()
    assert all(torch.equal(g, h) for g, h in zip(got, again))
    exact = [t.double().requires_grad_() for t in (x, a, *params)]
    x1 = exact[0] + exact[1] * exact[2]
    y = F.layer_norm(x1, (width,), exact[3], exact[4], 1e-5)
    torch.autograd.backward([x1, y], [grad_x1.double(), grad_y.double()])
    for value, want in zip(got, [x1, y] + [leaf.grad for leaf in exact]):
        assert torch.isfinite(value).all()
        tolerance = 5e-5 if value.dtype == torch.float32 else 2 ** -7  # float32 sums over 4111 rows
        assert rel_error(value, want) < tolerance


@pytest.mark.parametrize(("width", "fused"), [(768, False), (1024, True), (1280, True)])
def test_auto_takes_the_kernels_from_1024_features(monkeypatch, width, fused):
    from src.models import residual_norm as rn
    from src.models.transformer import Transformer

    calls, original = [], rn.residual_norm
    monkeypatch.setattr(rn, "residual_norm", lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs))
    tower = Transformer(width=width, layers=1, heads=width // 64, mlp_ratio=1.0, ls_init_value=0.1).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        tower(torch.randn(2, 7, width, device="cuda"))
    assert bool(calls) == fused
