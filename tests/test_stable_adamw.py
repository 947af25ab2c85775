import copy
import io
import math

import pytest
import torch

from src.optim.stable_adamw import StableAdamW

SHAPES = [(7,), (3, 5), (4, 3, 2, 2), (1,), ()]
FOREACH = pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "loop"])


def make_params(shapes=SHAPES, seed: int = 0, device: str = "cpu") -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in shapes]


def random_grads(params, step: int, seed: int = 1) -> list[torch.Tensor]:
    """Gradients whose scale jumps around so that clipping engages on some steps. Tensor 3 gets gradients
    near ε, where the placement of ε in the formula matters, and every 7th step (step 0 included) one
    tensor's gradient is exactly zero."""
    gen = torch.Generator().manual_seed(seed * 100_003 + step)
    grads = []
    for i, p in enumerate(params):
        scale = math.exp(2 * torch.randn((), generator=gen).item()) * (1e-6 if i == 3 else 1.0)
        g = scale * torch.randn(p.shape, generator=gen)
        grads.append(torch.zeros_like(g) if step % 7 == 0 and i == step % len(params) else g)
    return grads


def set_grads(params, grads) -> None:
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone().to(p.device)


def snapshot(opt: StableAdamW, params) -> list[torch.Tensor]:
    out = []
    for p in params:
        out.append(p.detach().clone())
        out += [v.clone() for v in opt.state[p].values()]
    return out


class Reference:
    """The authors' update, written out per tensor in float64, with plain Python scalars for the bias
    correction."""

    def __init__(self, params, lr, betas, eps, weight_decay, clip_threshold):
        self.lr, self.betas, self.eps, self.wd, self.clip = lr, betas, eps, weight_decay, clip_threshold
        self.t = [0] * len(params)
        self.load(params, {})

    def load(self, params, state) -> None:
        """Take over the given parameter values and moments; the step counts stay the reference's own."""
        self.params = [p.detach().double() for p in params]
        self.v = [
            state[p]["exp_avg"].double() if p in state else torch.zeros_like(q)
            for p, q in zip(params, self.params, strict=True)
        ]
        self.u = [
            state[p]["exp_avg_sq"].double() if p in state else torch.zeros_like(q)
            for p, q in zip(params, self.params, strict=True)
        ]

    def step(self, grads) -> list[float]:
        (beta1, beta2), rms_all = self.betas, []
        for i, (p, g) in enumerate(zip(self.params, grads, strict=True)):
            g = g.double()
            self.t[i] += 1
            t = self.t[i]
            b1 = beta1 * (1 - beta1 ** (t - 1)) / (1 - beta1**t)
            b2 = beta2 * (1 - beta2 ** (t - 1)) / (1 - beta2**t)
            self.v[i] = b1 * self.v[i] + (1 - b1) * g
            self.u[i] = b2 * self.u[i] + (1 - b2) * g * g
            rms = math.sqrt((g * g / self.u[i].clamp_min(self.eps**2)).mean().item())
            eta = self.lr / max(1.0, rms / self.clip)
            self.params[i] = p * (1 - eta * self.wd) - eta * self.v[i] / (self.u[i].sqrt() + self.eps)
            rms_all.append(rms)
        return rms_all


def rel_diff(actual: torch.Tensor, expected: torch.Tensor, *inputs: torch.Tensor) -> float:
    """max |actual − expected| relative to the largest magnitude in `expected` and in the `inputs` it was
    computed from: a difference of nearly equal terms is allowed its inputs' rounding, not its own."""
    scale = max(t.double().abs().max().item() for t in (expected, *inputs))
    return (actual.double() - expected.double()).abs().max().item() / max(scale, 1e-30)


@FOREACH
@pytest.mark.parametrize("weight_decay", [0.0, 0.2])
def test_matches_reference_over_100_steps(foreach, weight_decay):
    """Every step, a float64 reference restarted from our state must agree with our float32 step to 1e-6
    (a few float32 ulps): that pins the formula. A second reference runs freely for all 100 steps;
    float32 rounding then accumulates, so the end points get 1e-5."""
    hp = dict(lr=2e-3, betas=(0.9, 0.99), eps=1e-6, weight_decay=weight_decay, clip_threshold=1.0)
    params = make_params()
    opt = StableAdamW(params, foreach=foreach, **hp)
    synced, free = Reference(params, **hp), Reference(params, **hp)
    clipped = 0
    for step in range(100):
        grads = random_grads(params, step)
        synced.load(params, opt.state)
        old_p, old_v = list(synced.params), list(synced.v)
        set_grads(params, grads)
        opt.step()
        rms = torch.tensor(synced.step(grads), dtype=torch.float64)
        free.step(grads)
        assert ((opt.last_rms.double() - rms).abs() / rms.clamp_min(1e-30)).max() <= 1e-6
        for i, p in enumerate(params):
            assert rel_diff(p, synced.params[i], old_p[i]) <= 1e-6, (step, i)
            assert rel_diff(opt.state[p]["exp_avg"], synced.v[i], old_v[i], grads[i]) <= 1e-6, (step, i)
            assert rel_diff(opt.state[p]["exp_avg_sq"], synced.u[i]) <= 1e-6, (step, i)
        clipped += opt.last_clipped.item()
    assert 0 < clipped < 100 * len(params), "the gradients should exercise both clipped and plain steps"
    assert all(opt.state[p]["step"].item() == 100 for p in params)
    for p, expected in zip(params, free.params, strict=True):
        assert rel_diff(p, expected) <= 1e-5


def test_foreach_matches_loop():
    runs = []
    for foreach in (True, False):
        params = make_params()
        opt = StableAdamW(params, weight_decay=0.1, foreach=foreach)
        rms = []
        for step in range(30):
            set_grads(params, random_grads(params, step))
            opt.step()
            rms.append(opt.last_rms.clone())
        runs.append((snapshot(opt, params), torch.stack(rms)))
    (state_a, rms_a), (state_b, rms_b) = runs
    torch.testing.assert_close(rms_a, rms_b, rtol=1e-6, atol=0)
    for a, b in zip(state_a, state_b, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)


@FOREACH
def test_update_clipping_engages_exactly_above_threshold(foreach):
    lr, beta2, eps = 1e-2, 0.99, 1e-6

    def second_step_delta(clip_threshold):
        # Tensor 0 sees a 10x larger gradient on step 2; tensor 1 sees the same gradient twice.
        params = [torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(3))]
        opt = StableAdamW(
            params,
            lr=lr,
            betas=(0.9, beta2),
            eps=eps,
            weight_decay=0.0,
            clip_threshold=clip_threshold,
            foreach=foreach,
        )
        set_grads(params, [torch.ones(4), torch.ones(3)])
        opt.step()
        # On step 1 u = g², so RMS is exactly 1: not above any threshold >= 1.
        assert opt.last_rms.tolist() == [1.0, 1.0]
        assert opt.last_clipped.item() == 0
        before = [p.detach().clone() for p in params]
        set_grads(params, [10 * torch.ones(4), torch.ones(3)])
        opt.step()
        return [p.detach() - b for p, b in zip(params, before, strict=True)], opt

    # β̂2 at t=2 is β2/(1+β2), so u = (β2·1 + 100)/(1+β2) and RMS = sqrt(100/u).
    expected_rms = math.sqrt(100 / ((beta2 + 100) / (1 + beta2)))
    assert expected_rms > 1.4

    unclipped, opt = second_step_delta(clip_threshold=1e9)
    assert opt.last_clipped.item() == 0
    assert opt.last_rms[0].item() == pytest.approx(expected_rms, rel=1e-6)
    assert opt.last_rms[1].item() == pytest.approx(1.0, rel=1e-6)

    clipped, opt = second_step_delta(clip_threshold=1.0)
    assert opt.last_clipped.item() == 1
    torch.testing.assert_close(clipped[0], unclipped[0] / expected_rms, rtol=1e-6, atol=0)
    torch.testing.assert_close(clipped[1], unclipped[1], rtol=0, atol=0)

    partly, opt = second_step_delta(clip_threshold=expected_rms / 1.2)
    assert opt.last_clipped.item() == 1
    torch.testing.assert_close(partly[0], unclipped[0] / 1.2, rtol=1e-6, atol=0)

    not_yet, opt = second_step_delta(clip_threshold=expected_rms * 1.01)
    assert opt.last_clipped.item() == 0
    torch.testing.assert_close(not_yet[0], unclipped[0], rtol=0, atol=0)


@FOREACH
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_skip_nonfinite_skips_only_the_bad_tensor(foreach, bad):
    params = make_params()
    opt = StableAdamW(params, foreach=foreach)
    set_grads(params, random_grads(params, 1))
    opt.step(skip_nonfinite=True)
    assert opt.last_skipped.item() == 0

    grads = random_grads(params, 2)
    grads[1][2, 3] = bad
    set_grads(params, grads)
    before = snapshot(opt, params)
    opt.step(skip_nonfinite=True)
    after = snapshot(opt, params)

    per_param = len(before) // len(params)  # param, step, exp_avg, exp_avg_sq
    for i in range(len(params)):
        same = [
            torch.equal(a, b)
            for a, b in zip(
                before[i * per_param : (i + 1) * per_param],
                after[i * per_param : (i + 1) * per_param],
                strict=True,
            )
        ]
        assert all(same) if i == 1 else not any(same), (i, same)
    assert opt.last_skipped.item() == 1
    assert opt.last_rms[1].item() == 0.0
    assert opt.state[params[1]]["step"].item() == 1
    assert all(opt.state[p]["step"].item() == 2 for i, p in enumerate(params) if i != 1)
    assert all(torch.isfinite(t).all() for t in after)


@FOREACH
def test_skipped_tensor_resumes_as_if_the_bad_step_never_happened(foreach):
    """After a skip, the tensor's next update is its own step 2, exactly as for an optimizer that never
    saw the bad gradient."""
    params = make_params(seed=3)
    twin = make_params(seed=3)
    opt, twin_opt = StableAdamW(params, foreach=foreach), StableAdamW(twin[1:2], foreach=foreach)
    for step in range(3):
        grads = random_grads(params, step, seed=5)
        if step == 1:
            grads[1].view(-1)[0] = float("nan")
        else:
            set_grads(twin[1:2], grads[1:2])
            twin_opt.step()
        set_grads(params, grads)
        opt.step(skip_nonfinite=True)
    torch.testing.assert_close(params[1].detach(), twin[1].detach(), rtol=0, atol=0)


@FOREACH
def test_found_inf_skips_the_whole_step(foreach):
    params = make_params()
    opt = StableAdamW(params, foreach=foreach)
    set_grads(params, random_grads(params, 1))
    opt.step()
    before = snapshot(opt, params)

    grads = random_grads(params, 2)
    grads[0][3] = float("nan")  # a non-finite loss usually leaves non-finite gradients behind
    set_grads(params, grads)
    opt.step(found_inf=torch.tensor(1.0))
    for a, b in zip(before, snapshot(opt, params), strict=True):
        assert torch.equal(a, b)
    assert opt.last_skipped.item() == len(params)
    assert opt.last_clipped.item() == 0

    # found_inf == 0 is an ordinary step.
    plain_params = make_params()
    plain = StableAdamW(plain_params, foreach=foreach)
    plain.load_state_dict(copy.deepcopy(opt.state_dict()))  # in memory, torch would share the tensors
    with torch.no_grad():
        for p, q in zip(plain_params, params, strict=True):
            p.copy_(q)
    grads = random_grads(params, 3)
    set_grads(params, grads)
    set_grads(plain_params, grads)
    opt.step(found_inf=torch.tensor(0.0))
    plain.step()
    assert opt.last_skipped.item() == 0
    for a, b in zip(snapshot(opt, params), snapshot(plain, plain_params), strict=True):
        assert torch.equal(a, b)


@FOREACH
@pytest.mark.parametrize("as_tensor", [False, True], ids=["float", "tensor"])
def test_grad_scale_undoes_a_scaled_loss(foreach, as_tensor):
    scale = 65536.0  # a power of two, so scaling and unscaling are exact
    x = torch.randn(16, 7)
    results = []
    for loss_scale, grad_scale in [(1.0, None), (scale, torch.tensor(scale) if as_tensor else scale)]:
        model = torch.nn.Linear(7, 3)
        with torch.no_grad():
            for p, q in zip(model.parameters(), make_params([(3, 7), (3,)]), strict=True):
                p.copy_(q)
        opt = StableAdamW(model.parameters(), foreach=foreach)
        for _ in range(3):
            model.zero_grad()
            (loss_scale * model(x).square().mean()).backward()
            scaled_grads = [p.grad.clone() for p in model.parameters()]
            opt.step(grad_scale=grad_scale)
            assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), scaled_grads, strict=True))
        results.append(snapshot(opt, list(model.parameters())))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


@FOREACH
def test_state_dict_round_trip(foreach):
    params = make_params()
    opt = StableAdamW(params, lr=1e-3, weight_decay=0.1, foreach=foreach)
    for step in range(5):
        grads = random_grads(params, step)
        if step == 2:
            grads[0][0] = float("inf")  # leaves tensor 0 one step behind the others
        set_grads(params, grads)
        opt.step(skip_nonfinite=True)

    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    restored_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    restored = StableAdamW(restored_params, foreach=not foreach)  # hyperparameters come from the state dict
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    assert restored.param_groups[0]["lr"] == 1e-3 and restored.param_groups[0]["foreach"] == foreach
    assert restored.state[restored_params[0]]["step"].item() == 4

    for step in range(5, 10):
        grads = random_grads(params, step)
        set_grads(params, grads)
        set_grads(restored_params, grads)
        opt.step()
        restored.step()
    for a, b in zip(snapshot(opt, params), snapshot(restored, restored_params), strict=True):
        assert torch.equal(a, b)


def test_rms_by_param_skips_params_without_grad_and_follows_group_order():
    a, b, c, d = make_params([(2,), (3,), (4,), (5,)])
    opt = StableAdamW([{"params": [a, b]}, {"params": [c, d], "clip_threshold": 2.0}])
    for p in (a, c, d):
        p.grad = torch.randn_like(p)
    opt.step()
    pairs = opt.rms_by_param()
    assert [p is q for (p, _), q in zip(pairs, (a, c, d), strict=True)] == [True] * 3
    assert opt.last_rms.shape == (3,)
    assert b not in opt.state


@FOREACH
def test_param_groups_override_hyperparameters(foreach):
    a, b = make_params([(3,), (3,)])
    opt = StableAdamW([{"params": [a]}, {"params": [b], "lr": 0.0}], foreach=foreach)
    b_before = b.detach().clone()
    a.grad, b.grad = torch.randn(3), torch.randn(3)
    opt.step()
    assert torch.equal(b.detach(), b_before)
    assert opt.state[b]["step"].item() == 1


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(lr=-1.0), "lr"),
        (dict(betas=(1.0, 0.99)), "beta1"),
        (dict(betas=(0.9, -0.1)), "beta2"),
        (dict(eps=0.0), "eps"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(clip_threshold=0.0), "clip_threshold"),
    ],
)
def test_invalid_hyperparameters_are_named(kwargs, name):
    with pytest.raises(ValueError, match=name):
        StableAdamW(make_params(), **kwargs)
    with pytest.raises(ValueError, match=name):
        StableAdamW([{"params": make_params(), **kwargs}])


@FOREACH
def test_step_never_reads_tensor_values_on_the_host(foreach):
    """Meta tensors have no data, so any .item(), bool(), .tolist() or data-dependent shape in step()
    raises here: this is the CPU stand-in for "no host sync"."""
    with pytest.raises(RuntimeError):
        bool(torch.zeros((), device="meta"))  # the check has teeth
    params = make_params(device="meta")
    opt = StableAdamW(params, foreach=foreach)
    for _ in range(2):
        for p in params:
            p.grad = torch.empty_like(p)
        opt.step(
            grad_scale=torch.ones((), device="meta"),
            skip_nonfinite=True,
            found_inf=torch.zeros((), device="meta"),
        )
    assert opt.last_rms.shape == (len(params),)
    assert opt.last_skipped.shape == () and opt.last_clipped.shape == ()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@FOREACH
def test_cuda_step_does_not_synchronize(foreach):
    params = make_params(device="cuda")
    opt = StableAdamW(params, foreach=foreach)
    scale, found_inf = torch.tensor(1024.0, device="cuda"), torch.zeros((), device="cuda")
    set_grads(params, random_grads(params, 0))
    opt.step()  # state creation outside the checked region
    set_grads(params, random_grads(params, 1))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step(grad_scale=scale, skip_nonfinite=True, found_inf=found_inf)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert opt.last_skipped.item() == 0
