"""The fused residual + LayerNorm on CUDA against float64 PyTorch, at the image towers' widths, and
deterministic (run on the device: `python -m pytest -q -n 0 --noconftest tests/gpu`)."""

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("triton")


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


@pytest.mark.parametrize("width", [768, 1024, 1280])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("save_sum", [False, True])
@pytest.mark.parametrize("with_a_bias", [False, True])
def test_matches_float64_and_is_deterministic(width, dtype, save_sum, with_a_bias):
    from src.kernels.residual_norm import residual_norm

    torch.manual_seed(width)
    rows = 4111  # not a multiple of the rows per program
    x = torch.randn(rows, width, device="cuda") * 3 + 1
    a = torch.randn(rows, width, device="cuda").to(dtype)
    params = [torch.rand(width, device="cuda") + 0.1, *(torch.randn(width, device="cuda") for _ in range(2))]
    a_bias = torch.randn(width, device="cuda") if with_a_bias else torch.zeros(width, device="cuda")
    grad_x1, grad_y = torch.randn(rows, width, device="cuda"), torch.randn(rows, width, device="cuda").to(dtype)

    def run():
        leaves = [t.clone().requires_grad_() for t in (x, a, *params, a_bias)]
        x1, y = residual_norm(*leaves[:5], save_sum=save_sum, a_bias=leaves[5] if with_a_bias else None)
        torch.autograd.backward([x1, y], [grad_x1, grad_y])
        return [x1, y] + [leaf.grad for leaf in leaves[:6 if with_a_bias else 5]]

    got, again = run(), run()
    assert all(torch.equal(g, h) for g, h in zip(got, again))
    exact = [t.double().requires_grad_() for t in (x, a, *params, a_bias)]
    x1 = exact[0] + (exact[1] + exact[5]) * exact[2]
    y = F.layer_norm(x1, (width,), exact[3], exact[4], 1e-5)
    torch.autograd.backward([x1, y], [grad_x1.double(), grad_y.double()])
    for value, want in zip(got, [x1, y] + [leaf.grad for leaf in exact]):
        assert torch.isfinite(value).all()
        tolerance = 5e-5 if value.dtype == torch.float32 else 2 ** -7  # float32 sums over 4111 rows
        assert rel_error(value, want) < tolerance


@pytest.mark.parametrize("width", [512, 768, 1280])
def test_auto_takes_the_kernels_at_every_width(monkeypatch, width):
    from src.kernels import residual_norm as rn
    from src.kernels.dispatch import set_residual_norm
    from src.models.transformer import Transformer

    calls, original = [], rn.residual_norm
    monkeypatch.setattr(rn, "residual_norm", lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs))
    tower = Transformer(width=width, layers=1, heads=width // 64, mlp_ratio=1.0, ls_init_value=0.1).cuda()
    set_residual_norm(tower, "auto")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        tower(torch.randn(2, 7, width, device="cuda"))
    assert calls


def test_chained_blocks_train_like_unfused_ones(monkeypatch):
    """`auto` at width 1024 with a final norm: the blocks chain (each closing residual fused with the next
    norm) and land as close to float64 as the unfused blocks, output and every gradient."""
    from src.kernels import residual_norm as rn
    from src.kernels.dispatch import set_residual_norm
    from src.models.transformer import Transformer

    calls, original = [], rn.residual_norm
    monkeypatch.setattr(rn, "residual_norm", lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs))

    def run(mode: str, dtype: torch.dtype | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        tower = Transformer(width=1024, layers=3, heads=16, mlp_ratio=4.0, ls_init_value=0.5).cuda()
        tower.init_weights()
        final_norm = torch.nn.LayerNorm(1024).cuda()
        set_residual_norm(tower, mode)
        x = torch.randn(4, 257, 1024, device="cuda")
        if dtype is None:
            tower, final_norm, x = tower.double(), final_norm.double(), x.double()
        x.requires_grad_()
        # The chain writes the final norm in 16 bits: a projection after the tower, as in CLIP's towers, takes
        # it in 16 bits under autocast either way.
        projection = torch.randn(1024, 64, device="cuda", dtype=x.dtype) / 32
        with torch.autocast("cuda", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            out = tower(x, final_norm=final_norm) @ projection
        out.double().square().mean().backward()
        return [out, x.grad] + [p.grad for p in (*tower.parameters(), *final_norm.parameters())]

    exact, unfused, chained = run("unfused", None), run("unfused", torch.bfloat16), run("auto", torch.bfloat16)
    assert len(calls) == 6  # per block: the middle residual with ln_2, the closing one with the next norm
    for want, theirs, ours in zip(exact, unfused, chained):
        assert rel_error(ours, want) <= 2 * rel_error(theirs, want) + 1e-3, (rel_error(ours, want),
                                                                             rel_error(theirs, want))
