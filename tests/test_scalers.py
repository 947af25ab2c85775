import math
from dataclasses import replace

import pytest
import torch
from torch import nn

from src.config import OptimConfig
from src.optim import build_optimizer, param_groups
from src.optim.grad_norm import clip_grad_norm
from src.optim.rms import update_rms
from src.optim.scalers import DynamicScaler, FixedScaler, build_scaler
from src.optim.stable_adamw import StableAdamW
from tests.conftest import compose_config

CPU = torch.device("cpu")


def optim_config(name: str, **values) -> OptimConfig:
    """optim=adamw's values, the ones these tests were written against, under another optimizer's name."""
    return replace(compose_config(["optim=adamw"]).optim, name=name, **values)


def two_layer_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))


def backward_with_inf(model: nn.Module, scaler, poisoned: nn.Parameter) -> None:
    loss = model(torch.randn(3, 4)).square().mean()
    scaler.scale(loss).backward()
    poisoned.grad[0, 0] = math.inf


@pytest.mark.parametrize("optim", ["adamw", "stable_adamw"])
def test_fixed_scaler_skips_only_the_tensor_with_an_inf(optim):
    model = two_layer_model()
    scaler = FixedScaler(65536.0, CPU)
    optimizer = build_optimizer(optim_config(optim, lr=1e-2), model, per_tensor_skips=True)
    assert isinstance(optimizer, StableAdamW)
    # One clean step first, so that the skipped tensor has moments that must stay untouched.
    scaler.scale(model(torch.randn(3, 4)).square().mean()).backward()
    scaler.step(optimizer, torch.zeros(()))
    optimizer.zero_grad()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    moments = {n: optimizer.state[p]["exp_avg"].clone() for n, p in model.named_parameters()}
    bad = model[1].weight
    backward_with_inf(model, scaler, bad)
    scaler.step(optimizer, torch.zeros(()))
    for name, p in model.named_parameters():
        unchanged = torch.equal(p, before[name]) and torch.equal(optimizer.state[p]["exp_avg"], moments[name])
        assert unchanged == (p is bad), name
    assert optimizer.last_skipped.item() == 1 and optimizer.state[bad]["step"].item() == 1


def test_fixed_scaler_adamw_mode_equals_torch_adamw():
    ours, theirs = two_layer_model(), two_layer_model()
    a = build_optimizer(optim_config("adamw", lr=1e-2, weight_decay=0.1), ours, per_tensor_skips=True)
    b = torch.optim.AdamW(param_groups(theirs, 0.1, lr=1e-2), lr=1e-2, betas=(0.9, 0.98), eps=1e-6)
    scaler = FixedScaler(1024.0, CPU)
    for _ in range(20):
        x = torch.randn(3, 4)
        scaler.scale(ours(x).square().mean()).backward()
        scaler.step(a, torch.zeros(()))
        a.zero_grad()
        theirs(x).square().mean().backward()
        b.step()
        b.zero_grad()
    for p, q in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_dynamic_scaler_skips_the_whole_step_and_backs_off():
    model = two_layer_model()
    scaler = DynamicScaler(CPU)
    optimizer = build_optimizer(optim_config("adamw", lr=1e-2), model)
    before = [p.detach().clone() for p in model.parameters()]
    backward_with_inf(model, scaler, model[1].weight)
    scale = scaler.current_scale().item()
    scaler.unscale_(optimizer)
    scaler.step(optimizer, torch.ones(()))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert scaler.current_scale().item() == scale / 2


def test_scaler_config_errors():
    with pytest.raises(ValueError, match="precision.dtype=fp16 needs a loss scaler"):
        build_scaler(replace(compose_config(["precision=fp16"]).precision, dtype="fp16", scaler="none"), CPU)
    with pytest.raises(ValueError, match="precision.scaler='static' is not one of"):
        build_scaler(replace(compose_config(["precision=fp16"]).precision, dtype="fp16", scaler="static"), CPU)


def test_unknown_and_cpu_only_optimizers_fail_clearly():
    with pytest.raises(ValueError, match="optim.name='sgd' is not a known optimizer"):
        build_optimizer(optim_config("sgd"), two_layer_model())
    with pytest.raises(ValueError, match="adamw8bit .* runs on CUDA only"):
        build_optimizer(optim_config("adamw8bit"), two_layer_model())


def test_update_rms_of_torch_adamw_matches_the_formula():
    model = two_layer_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-6, fused=True)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(3, 4)).square().mean().backward()
        optimizer.step()
    params, rms = update_rms(optimizer)
    for p, value in zip(params, rms):
        state = optimizer.state[p]
        u_hat = state["exp_avg_sq"] / (1 - 0.95 ** state["step"].item())
        expected = (p.grad.square() / u_hat.clamp_min(1e-12)).mean().sqrt()
        torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-7)


def test_update_rms_per_group_betas_and_steps_and_tensors_without_grad():
    """Groups with their own β2 and ε, a tensor that has stepped fewer times than the others, and one with no
    gradient (left out), on the unfused optimizer whose step counts live on the host."""
    model = two_layer_model()
    first, second = list(model.children())
    frozen = nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([{"params": list(first.parameters()), "betas": (0.9, 0.95), "eps": 1e-6},
                                   {"params": [*second.parameters(), frozen], "betas": (0.9, 0.99), "eps": 1e-3}],
                                  lr=1e-2, foreach=False)
    for step in range(4):
        optimizer.zero_grad()
        model(torch.randn(3, 4)).square().mean().backward()
        if step == 0:  # the second layer's bias sits out the first step: one step fewer
            second.bias.grad = None
        optimizer.step()
    params, rms = update_rms(optimizer)
    assert [id(p) for p in params] == [id(p) for p in model.parameters()]
    for group in optimizer.param_groups:
        beta2, eps = group["betas"][1], group["eps"]
        for p in group["params"]:
            if p is frozen:
                continue
            state = optimizer.state[p]
            u_hat = state["exp_avg_sq"] / (1 - beta2 ** state["step"].item())
            expected = (p.grad.square() / u_hat.sqrt().clamp_min(eps).square()).mean().sqrt()
            value = rms[[id(q) for q in params].index(id(p))]
            torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-7)
    assert optimizer.state[second.bias]["step"].item() == 3


def test_clip_grad_norm_ignores_nonfinite_tensors_when_asked():
    grads = [torch.full((4,), 3.0), torch.full((4,), 4.0), torch.tensor([math.inf])]
    assert math.isinf(clip_grad_norm([g.clone() for g in grads], None).item())
    total = clip_grad_norm(grads, 1.0, divisor=2.0, ignore_nonfinite=True)
    assert math.isclose(total.item(), 5.0, rel_tol=1e-6)  # sqrt(4·9 + 4·16) / 2
    assert math.isclose(torch.cat(grads[:2]).norm().item() / 2, 1.0, rel_tol=1e-4)
