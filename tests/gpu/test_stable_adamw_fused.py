"""StableAdamW's fused Triton step against its foreach path on CUDA, at ViT-H-like shapes.

Run on a GPU machine: python -m pytest tests/gpu/test_stable_adamw_fused.py
"""

import math

import pytest
import torch

from src.optim import stable_adamw
from src.optim.stable_adamw import StableAdamW

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("triton")

# ViT-H/14 blocks: MLP in and out, fused QKV, biases and norms; then odd sizes that leave tails, and a scalar.
SHAPES = [(5120, 1280), (1280, 5120), (3840, 1280), (1280,), (1280,), (5120,), (1000, 1001), (7,), ()]
HP = dict(lr=2e-3, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.2)


def make_params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen, device="cuda")) for s in SHAPES]


def random_grads(step: int) -> list[torch.Tensor]:
    """Per-tensor scales that jump, so that some steps clip; tensor 5 near ε; every 5th step one zero
    gradient."""
    gen = torch.Generator(device="cuda").manual_seed(1000 + step)
    scales = torch.exp(2 * torch.randn(len(SHAPES), generator=torch.Generator().manual_seed(step)))
    grads = [float(scales[i]) * torch.randn(s, generator=gen, device="cuda") for i, s in enumerate(SHAPES)]
    grads[5] *= 1e-6
    if step % 5 == 0:
        grads[step % len(SHAPES)].zero_()
    return grads


def snapshot(opt: StableAdamW, params) -> list[torch.Tensor]:
    return [t.detach().clone() for p in params for t in (p, *opt.state[p].values())]


def rel_diff(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.double().abs().max().item() if expected.numel() else 0.0
    return (actual.double() - expected.double()).abs().max().item() / max(scale, 1e-30) if expected.numel() else 0.0


@pytest.mark.parametrize("variant", ["plain", "fp16 skips", "float grad_scale"])
def test_fused_matches_foreach_over_20_steps(variant):
    fused_params, foreach_params = make_params(), make_params()
    fused, foreach = StableAdamW(fused_params, **HP, fused=True), StableAdamW(foreach_params, **HP, foreach=True)
    skipped = clipped = 0
    for step in range(20):
        grads, kwargs = random_grads(step), {}
        if variant == "fp16 skips":
            if step in (3, 4):
                grads[1][7, 11] = math.inf
            if step == 13:
                grads[6][999, 1000] = math.nan
            found_inf = torch.tensor(float(step == 9), device="cuda")
            kwargs = dict(grad_scale=torch.tensor(4.0, device="cuda"), skip_nonfinite=True, found_inf=found_inf)
        elif variant == "float grad_scale":
            grads = [1024.0 * g for g in grads]
            kwargs = dict(grad_scale=1024.0)
        for params in (fused_params, foreach_params):
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone()
        fused.step(**kwargs)
        foreach.step(**kwargs)

        # Sums over millions of elements in different orders: RMS agrees to a few float32 ulps.
        torch.testing.assert_close(fused.last_rms, foreach.last_rms, rtol=2e-6, atol=0)
        assert fused.last_clipped.item() == foreach.last_clipped.item()
        assert fused.last_skipped.item() == foreach.last_skipped.item()
        skipped += fused.last_skipped.item()
        clipped += fused.last_clipped.item()
        for a, b in zip(snapshot(fused, fused_params), snapshot(foreach, foreach_params), strict=True):
            assert rel_diff(a, b) <= 1e-5, (step, a.shape)
    assert skipped == (2 + len(SHAPES) + 1 if variant == "fp16 skips" else 0)
    assert 0 < clipped < 20 * len(SHAPES), "the gradients should exercise both clipped and plain steps"


def test_rms_is_exactly_one_on_the_first_step():
    params = make_params()
    opt = StableAdamW(params, **HP, fused=True)
    for p in params:
        p.grad = torch.empty_like(p).uniform_(0.5, 2.0)  # |g| > ε everywhere, else g²/max(u, ε²) < 1 there
    opt.step()
    assert opt.last_rms.tolist() == [1.0] * len(SHAPES) and opt.last_clipped.item() == 0


def test_default_picks_the_fused_path(monkeypatch):
    calls = []
    fused_update = stable_adamw._fused_update
    monkeypatch.setattr(stable_adamw, "_fused_update", lambda *a, **k: calls.append(1) or fused_update(*a, **k))
    params = make_params()
    opt = StableAdamW(params)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    assert calls == [1]


def test_step_does_not_synchronize():
    params = make_params()
    opt = StableAdamW(params, **HP, fused=True)
    scale, found_inf = torch.tensor(1024.0, device="cuda"), torch.zeros((), device="cuda")
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # compiles the kernels outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):  # new gradient tensors: the address table is rebuilt inside the checked region
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step(grad_scale=scale, skip_nonfinite=True, found_inf=found_inf)
            opt.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert opt.last_rms.shape == (len(SHAPES),)


def test_fused_rms_of_torch_adamw_matches_the_multi_tensor_path():
    """The spike tracker's RMS after a step of torch's fused AdamW: one Triton pass, the multi-tensor path's values."""
    from src.optim import rms

    params = make_params()
    optimizer = torch.optim.AdamW(params, lr=2e-3, betas=(0.9, 0.99), eps=1e-6, fused=True)
    for step in range(1, 6):
        for p, g in zip(params, random_grads(step)):
            p.grad = g
        optimizer.step()
    group = optimizer.param_groups[0]
    fused = rms._fused_rms(optimizer, group, params)
    assert fused is not None
    want = rms._multi_tensor_rms(optimizer, group, params)
    assert torch.isfinite(fused).all()
    torch.testing.assert_close(fused, want, rtol=1e-6, atol=0)
