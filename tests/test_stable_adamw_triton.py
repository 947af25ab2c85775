"""The fused Triton step of StableAdamW against its foreach path, on the CPU through Triton's interpreter
(tests/interpreter_harness.py says how). Tests on CUDA are in tests/gpu/."""

import subprocess
import sys

import pytest
import torch
from interpreter_harness import INTERPRETED, ROOT, interpreted, run_under_interpreter
from test_stable_adamw import make_params, random_grads, set_grads, snapshot

from src.optim import rms, stable_adamw, stable_adamw_triton
from src.optim.stable_adamw import StableAdamW

pytest.importorskip("triton")

SHAPES = [(7,), (3, 50), (4, 3, 2, 2), (1,), (), (129,)]


@pytest.mark.skipif(INTERPRETED, reason="this is the subprocess")
def test_kernels_under_the_interpreter():
    run_under_interpreter(__file__)


@pytest.fixture
def fused_on_cpu(monkeypatch):
    """Route the default optimizer (foreach and fused both None) to the fused kernels, CPU tensors included,
    with tiles of 16 and chunks of 48 elements: the small tensors then span several programs, and programs
    see full tiles, tails and both."""
    monkeypatch.setattr(stable_adamw, "_use_fused", lambda group, p: group["foreach"] is None)
    monkeypatch.setattr(stable_adamw_triton, "_BLOCK", 16)
    monkeypatch.setattr(stable_adamw_triton, "_CHUNK", 48)


def rel_diff(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual − expected| over the largest |expected|."""
    scale = expected.double().abs().max().item() if expected.numel() else 0.0
    return (actual.double() - expected.double()).abs().max().item() / max(scale, 1e-30) if expected.numel() else 0.0


def fp16_step_kwargs(step: int, grads: list[torch.Tensor]) -> dict:
    """The fixed fp16 scaler's arguments, with a non-finite gradient in tensor 1 on steps 4 and 5 (Inf)
    and in tensor 5 on step 11 (NaN), and a found_inf step at step 8."""
    if step in (4, 5):
        grads[1][1, 7] = float("inf")
    if step == 11:
        grads[5][3] = float("nan")
    return dict(grad_scale=torch.tensor(4.0), skip_nonfinite=True, found_inf=torch.tensor(float(step == 8)))


@interpreted
@pytest.mark.parametrize("variant", ["plain", "fp16 skips", "float grad_scale", "weight_decay 0"])
def test_fused_matches_foreach_over_12_steps(fused_on_cpu, variant):
    hp = dict(lr=2e-3, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.0 if variant == "weight_decay 0" else 0.2)
    fused_params, foreach_params = make_params(SHAPES), make_params(SHAPES)
    fused, foreach = StableAdamW(fused_params, **hp), StableAdamW(foreach_params, **hp, foreach=True)
    skipped = clipped = 0
    for step in range(12):  # every event of random_grads and fp16_step_kwargs happens by step 11
        grads = random_grads(fused_params, step)  # a zero gradient every 7th step, tiny ones in tensor 3
        kwargs = {}
        if variant == "fp16 skips":
            kwargs = fp16_step_kwargs(step, grads)
        elif variant == "float grad_scale":
            grads = [1024.0 * g for g in grads]
            kwargs = dict(grad_scale=1024.0)
        set_grads(fused_params, grads)
        set_grads(foreach_params, grads)
        fused.step(**kwargs)
        foreach.step(**kwargs)

        torch.testing.assert_close(fused.last_rms, foreach.last_rms, rtol=1e-6, atol=0)
        assert fused.last_clipped.item() == foreach.last_clipped.item()
        assert fused.last_skipped.item() == foreach.last_skipped.item()
        skipped += fused.last_skipped.item()
        clipped += fused.last_clipped.item()
        for a, b in zip(snapshot(fused, fused_params), snapshot(foreach, foreach_params), strict=True):
            # Both round to float32 in slightly different places (FMAs); a moment that passes near zero
            # turns that into up to ~1e-6 of its own size.
            assert rel_diff(a, b) <= 1e-5, (step, a, b)
    assert skipped == (2 + len(SHAPES) + 1 if variant == "fp16 skips" else 0)
    assert clipped > 0  # the clipping branch ran too
    assert [fused.state[p]["step"].item() for p in fused_params] == [
        foreach.state[p]["step"].item() for p in foreach_params
    ]


@interpreted
def test_skipped_tensors_are_left_bit_for_bit(fused_on_cpu):
    params = make_params(SHAPES)
    opt = StableAdamW(params)
    set_grads(params, random_grads(params, 1))
    opt.step()
    grads = random_grads(params, 2)
    grads[2][0, 1, 1, 0] = float("-inf")
    set_grads(params, grads)
    before = snapshot(opt, params)
    opt.step(skip_nonfinite=True)
    after = snapshot(opt, params)
    per_param = len(before) // len(params)  # param, step, exp_avg, exp_avg_sq
    for i in range(len(params)):
        same = [torch.equal(a, b) for a, b in zip(*(s[i * per_param : (i + 1) * per_param] for s in (before, after)))]
        assert all(same) if i == 2 else not any(same), (i, same)
    assert opt.last_rms[2].item() == 0.0 and opt.last_skipped.item() == 1

    opt.step(found_inf=torch.tensor(1.0))
    assert all(torch.equal(a, b) for a, b in zip(after, snapshot(opt, params), strict=True))
    assert opt.last_skipped.item() == len(params) and opt.last_rms.abs().sum().item() == 0


@interpreted
def test_rms_is_exactly_one_on_the_first_step(fused_on_cpu):
    params = make_params([(5000,), (3, 7), (1,)])  # 5000 elements: 105 programs, one partial sum each
    opt = StableAdamW(params)
    set_grads(params, [torch.empty(p.shape).uniform_(0.5, 2.0) for p in params])  # |g| > ε: else g²/ε² < 1
    opt.step()
    assert opt.last_rms.tolist() == [1.0, 1.0, 1.0]
    assert opt.last_clipped.item() == 0


@interpreted
def test_dense_non_contiguous_layouts_work_and_mismatched_ones_are_refused(fused_on_cpu):
    shapes = [(2, 3, 4, 5), (6, 4)]
    fused_params, foreach_params = make_params(shapes), make_params(shapes)
    for params in (fused_params, foreach_params):
        params[0].data = params[0].data.to(memory_format=torch.channels_last)
        params[1].data = params[1].data.t()  # dense, transposed
    fused, foreach = StableAdamW(fused_params), StableAdamW(foreach_params, foreach=True)
    for _ in range(3):
        grads = [torch.randn_like(p) for p in fused_params]  # randn_like keeps the layout, as autograd does
        for p, q, g in zip(fused_params, foreach_params, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        fused.step()
        foreach.step()
    for a, b in zip(snapshot(fused, fused_params), snapshot(foreach, foreach_params), strict=True):
        assert rel_diff(a, b) <= 1e-6

    fused_params[1].grad = fused_params[1].grad.contiguous()  # not the layout of its parameter
    with pytest.raises(ValueError, match="laid out alike"):
        fused.step()


def test_fused_true_needs_cuda_and_is_exclusive_with_foreach():
    with pytest.raises(ValueError, match="fused=None"):
        StableAdamW(make_params(), fused=True)
    with pytest.raises(ValueError, match="exclusive"):
        StableAdamW(make_params(), fused=True, foreach=True)


def test_default_and_explicit_paths_on_cpu(monkeypatch):
    """On the CPU the default is foreach; an explicit foreach=True keeps foreach on the GPU too."""
    calls = []
    monkeypatch.setattr(stable_adamw, "_fused_update", lambda *a, **k: calls.append(1))
    params = make_params()
    opt = StableAdamW(params)
    set_grads(params, random_grads(params, 1))
    opt.step()
    assert calls == []
    fake_cuda = torch.empty(0, device="meta")
    assert stable_adamw._use_fused({"fused": None, "foreach": True}, fake_cuda) is False
    assert stable_adamw._use_fused({"fused": False, "foreach": None}, fake_cuda) is False


def test_a_group_without_gradients_is_left_alone():
    a, b = make_params([(3,), (2,)])
    opt = StableAdamW([{"params": [a]}, {"params": [b]}])
    a.grad = torch.ones(3)
    opt.step()
    assert opt.last_rms.shape == (1,) and b not in opt.state


def test_state_dict_from_before_the_fused_option_loads():
    params = make_params()
    opt = StableAdamW(params, foreach=True)
    set_grads(params, random_grads(params, 1))
    opt.step()
    state = opt.state_dict()
    for group in state["param_groups"]:
        del group["fused"]
    restored = StableAdamW(make_params())
    restored.load_state_dict(state)
    assert restored.param_groups[0]["fused"] is None and restored.param_groups[0]["foreach"] is True


def test_imports_and_steps_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"  # makes `import triton` raise ImportError
        "import pytest, torch\n"
        "from src.optim.stable_adamw import StableAdamW\n"
        "from src.optim.stable_adamw_triton import fused_stable_adamw_step\n"
        "p = torch.nn.Parameter(torch.ones(3)); p.grad = torch.ones(3)\n"
        "StableAdamW([p]).step()\n"
        "with pytest.raises(RuntimeError, match='pip install triton'):\n"
        "    fused_stable_adamw_step([p], [p.grad], [p], [p], [p], lr=1, beta1=0.9, beta2=0.99, eps=1e-6,\n"
        "                            weight_decay=0, clip_threshold=1)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


@interpreted
@pytest.mark.parametrize("fused_adamw", [True, False])
def test_fused_rms_of_torch_adamw_matches_the_multi_tensor_path(fused_on_cpu, fused_adamw):
    """update_rms on torch's AdamW takes one Triton pass (here on the CPU, through the interpreter) and gives the
    multi-tensor path's values: two groups with their own β2 and ε, a tensor one step behind the others, tiny
    gradients near ε, and tensors that span several programs, with full tiles and tails."""
    params = make_params(SHAPES)
    groups = [{"params": params[:3], "betas": (0.9, 0.95), "eps": 1e-6},
              {"params": params[3:], "betas": (0.9, 0.99), "eps": 1e-3}]
    optimizer = torch.optim.AdamW(groups, lr=1e-2, fused=fused_adamw, foreach=False if not fused_adamw else None)
    for step in range(5):
        set_grads(params, random_grads(params, step + 1))
        if step == 0:
            params[4].grad = None  # one step fewer for this tensor
        optimizer.step()
    got_params, got = rms.update_rms(optimizer)
    assert [id(p) for p in got_params] == [id(p) for p in params]
    want = torch.cat([rms._multi_tensor_rms(optimizer, group, group["params"]) for group in optimizer.param_groups])
    assert rel_diff(got, want) < 1e-6, (got, want)
    fused = [rms._fused_rms(optimizer, group, group["params"]) for group in optimizer.param_groups]
    assert all(values is not None for values in fused)  # the values above came from the kernels


@interpreted
def test_fused_rms_leaves_tensors_it_cannot_take_to_the_multi_tensor_path(fused_on_cpu):
    params = make_params(SHAPES)
    optimizer = torch.optim.AdamW(params, lr=1e-2, fused=True)
    set_grads(params, random_grads(params, 1))
    optimizer.step()
    params[1].grad = params[1].grad.t().contiguous().t()  # other strides than its parameter
    group = optimizer.param_groups[0]
    assert rms._fused_rms(optimizer, group, params) is None
    _, values = rms.update_rms(optimizer)
    assert rel_diff(values, rms._multi_tensor_rms(optimizer, group, params)) < 1e-6
