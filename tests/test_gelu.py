"""model.gelu: the rational-fit GELU against F.gelu, forward and backward, eager and compiled, and the switch."""

import math

import pytest
import torch
import torch.nn.functional as F

from src.kernels.dispatch import build_model_with_kernels, set_gelu
from src.kernels.gelu import GELU, _cdf_and_density, _RationalGELU, rational_gelu
from src.models.clip import build_model
from tests.conftest import compose_config


def test_cdf_within_the_fits_bound_everywhere():
    z = torch.linspace(-12, 12, 240_001, dtype=torch.float64)
    cdf, density = _cdf_and_density(z)
    exact = 0.5 * torch.special.erfc(-z / math.sqrt(2))
    assert (cdf - exact).abs().max().item() < 1.5e-7 / 2  # Φ = (1 + erf)/2 halves erf's error
    torch.testing.assert_close(density, torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi), rtol=1e-12, atol=0)


def test_the_fits_arithmetic_matches_f_gelu_in_float32():
    h = (torch.randn(200_000, generator=torch.Generator().manual_seed(0)) * 4).requires_grad_()
    grad = torch.randn_like(h)
    ours = _RationalGELU.apply(h)
    (ours_grad,) = torch.autograd.grad(ours, h, grad)
    theirs = F.gelu(h)
    (theirs_grad,) = torch.autograd.grad(theirs, h, grad)
    assert ours.dtype == torch.float32
    assert (ours - theirs).abs().max().item() < 2e-6
    assert ((ours_grad - theirs_grad).abs() / grad.abs().clamp_min(1e-3)).max().item() < 2e-6


def test_bfloat16_equals_f_gelu_outside_the_lower_tail():
    # Rounded to bfloat16 the two agree bit for bit except where an exact value lies within 1.5e-6 of a rounding
    # boundary, and in the lower tail where the fit's relative error is larger than a bfloat16 ulp.
    h = (torch.randn(1_000_000, generator=torch.Generator().manual_seed(1)) * 3).bfloat16()
    main = h.float() > -2
    ours, theirs = rational_gelu(h), F.gelu(h)
    assert ours.dtype == torch.bfloat16
    assert (ours[main] != theirs[main]).float().mean().item() < 1e-3
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=2**-7, atol=2e-6)  # at most one ulp apart


def test_wide_floats_go_to_f_gelu():
    for dtype in (torch.float32, torch.float64):
        h = torch.randn(1000, dtype=dtype) * 3
        assert torch.equal(rational_gelu(h), F.gelu(h))


def test_bfloat16_gradient_in_its_input_dtype():
    h = torch.randn(4096, dtype=torch.bfloat16).requires_grad_()
    grad = torch.randn_like(h)
    (ours,) = torch.autograd.grad(rational_gelu(h), h, grad)
    (theirs,) = torch.autograd.grad(F.gelu(h), h, grad)
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours, theirs, rtol=1e-2, atol=1e-2)


def test_compiled_equals_eager():
    h = (torch.randn(64, 256) * 3).bfloat16().requires_grad_()
    grad = torch.randn_like(h)
    eager = rational_gelu(h)
    (eager_grad,) = torch.autograd.grad(eager, h, grad)
    compiled = torch.compile(rational_gelu, dynamic=False)(h)
    (compiled_grad,) = torch.autograd.grad(compiled, h, grad)
    # The same float32 arithmetic; exp's last bit may differ between the two and flip a rounding.
    torch.testing.assert_close(compiled, eager, rtol=2**-7, atol=1e-6)
    torch.testing.assert_close(compiled_grad, eager_grad, rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("form", ["erf", "rational", "auto"])
def test_module_forms(form):
    h = (torch.randn(1000) * 3).bfloat16()
    out = GELU(form)(h)
    if form == "rational":
        torch.testing.assert_close(out, rational_gelu(h), rtol=0, atol=0)
    else:  # auto runs F.gelu itself in eager mode
        torch.testing.assert_close(out, F.gelu(h), rtol=0, atol=0)


def test_auto_takes_the_fit_when_compiled():
    h = (torch.randn(4096, generator=torch.Generator().manual_seed(2)) * 3).bfloat16()
    compiled = torch.compile(GELU("auto"), dynamic=False)(h)
    torch.testing.assert_close(compiled, rational_gelu(h), rtol=2**-7, atol=1e-6)
    assert not torch.equal(compiled, F.gelu(h))  # the fit's last bits in the lower tail, not F.gelu's


def test_model_key_sets_every_block_and_keeps_the_state_dict():
    standard = build_model(compose_config(["model=vit_tiny"]).model)
    rational = build_model_with_kernels(compose_config(["model=vit_tiny", "model.gelu=rational"]).model)
    forms = {m.form for m in rational.modules() if isinstance(m, GELU)}
    assert forms == {"rational"}
    blocks = len(rational.visual.transformer.resblocks) + len(rational.transformer.resblocks)
    assert sum(isinstance(m, GELU) for m in rational.modules()) == blocks
    assert standard.state_dict().keys() == rational.state_dict().keys()


def test_bad_form_names_the_choices():
    with pytest.raises(ValueError, match=r"model.gelu='fast' is not one of auto, erf, rational"):
        set_gelu(torch.nn.Sequential(GELU()), "fast")
