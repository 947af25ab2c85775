import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

from src.kernels.dispatch import build_model_with_kernels
from src.kernels.switchback import VARIANTS, SwitchBackLinear, convert_to_switchback, functions, switchback_linear
from src.models import build_model
from src.models.transformer import Attention
from src.parallel.parallelize import apply_compile
from tests.test_model import tiny_config

INT8 = ["switchback_int8", "switchback_int8_memeff", "switchback_int8_vectorwise"]


def q8(x: torch.Tensor, dim) -> tuple[torch.Tensor, torch.Tensor]:
    """The paper's int8 quantizer, round(127 · x / absmax), evaluated in float32 as the kernels do (so ties
    round the same way), returned as float64."""
    x = x.float()
    a = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    return torch.round(x * 127 / a).double(), a.double()


def qfp8(x: torch.Tensor, dim) -> torch.Tensor:
    """e4m3 values (x · 448) / absmax, dequantized back to float64 with absmax / 448."""
    a = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    return (x * 448 / a).to(torch.float8_e4m3fn).double() * (a.double() / 448)


def expected(variant: str, x, w, b, g):
    """Forward, input gradient and weight gradient of each variant, in float64."""
    x, w, b, g = x.double(), w.double(), b.double(), g.double()
    if variant == "switchback_fp8":
        y = qfp8(x, 1) @ qfp8(w, None).T + b
        dx = qfp8(g, 1) @ qfp8(w, None)
        return y, dx, g.T @ x
    # Algorithm 4 scales W per output row forward and per input column backward; the others per tensor.
    vectorwise = variant == "switchback_int8_vectorwise"
    (qx, sx), (qw, sw) = q8(x, 1), q8(w, 1 if vectorwise else None)
    y = (qx @ qw.T) * sx * sw.reshape(1, -1) / 127**2 + b
    (qg, sg), (qwb, swb) = q8(g, 1), q8(w, 0 if vectorwise else None)
    dx = (qg @ qwb) * sg * swb.reshape(1, -1) / 127**2
    x_for_dw = qx * sx / 127 if variant == "switchback_int8_memeff" else x
    return y, dx, g.T @ x_for_dw


def run(variant: str, x, w, b, g):
    x, w, b = (t.clone().requires_grad_() for t in (x, w, b))
    y = switchback_linear(x, w, b, variant, backend="reference")
    y.backward(g)
    return y, x.grad, w.grad, b.grad


@pytest.fixture
def operands():
    torch.manual_seed(0)
    x = torch.randn(37, 64) * torch.rand(37, 1) * 4  # rows of very different magnitude
    w, b, g = torch.randn(48, 64) / 8, torch.randn(48), torch.randn(37, 48)
    return x, w, b, g


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_float64_quantized_arithmetic(variant, operands):
    x, w, b, g = operands
    y, dx, dw, db = run(variant, x, w, b, g)
    want_y, want_dx, want_dw = expected(variant, x, w, b, g)
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y.double(), want_y, **tol)
    torch.testing.assert_close(dx.double(), want_dx, **tol)
    torch.testing.assert_close(dw.double(), want_dw, **tol)
    torch.testing.assert_close(db, g.sum(0))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_close_to_full_precision_linear(variant, operands):
    x, w, b, g = operands
    y, dx, _, _ = run(variant, x, w, b, g)
    x_ref, w_ref = x.clone().requires_grad_(), w.clone().requires_grad_()
    y_ref = F.linear(x_ref, w_ref, b)
    y_ref.backward(g)
    tolerance = 0.08 if VARIANTS[variant].fp8 else 0.02  # relative error of 3- and 7-bit mantissas
    assert (y - y_ref).norm() / y_ref.norm() < tolerance
    assert (dx - x_ref.grad).norm() / x_ref.grad.norm() < tolerance


@pytest.mark.parametrize("variant", ["switchback_int8", "switchback_int8_vectorwise", "switchback_fp8"])
def test_weight_gradient_is_exactly_high_precision(variant, operands):
    x, w, b, g = operands
    _, _, dw, _ = run(variant, x, w, b, g)
    assert torch.equal(dw, g.T @ x)


def test_autocast_output_dtype_and_float32_weight_gradient(operands):
    """Under autocast the weight gradient sums bf16 products in float32 and is not rounded to bf16."""
    x, w, b, g = operands
    w = w.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = switchback_linear(x, w, b, "switchback_int8", backend="reference")
    assert y.dtype == torch.bfloat16
    y.backward(g.bfloat16())
    assert w.grad.dtype == torch.float32
    assert torch.equal(w.grad, g.bfloat16().T.float() @ x.bfloat16().float())
    assert not torch.equal(w.grad, (g.bfloat16().T @ x.bfloat16()).float())


def test_zero_rows_quantize_to_zero_without_nan():
    x = torch.zeros(4, 8)
    y = switchback_linear(x, torch.randn(3, 8), None, "switchback_int8", backend="reference")
    assert torch.equal(y, torch.zeros(4, 3))


def switchback_model(variant="switchback_int8", fp8_fast_accum=True):
    config = tiny_config(ls_init_value=0.1)
    config.linear, config.linear_backend, config.fp8_fast_accum = variant, "reference", fp8_fast_accum
    return build_model_with_kernels(config)


def test_swap_covers_exactly_the_block_linears():
    model = switchback_model()
    swapped = [n for n, m in model.named_modules() if isinstance(m, SwitchBackLinear)]
    blocks = [f"{tower}transformer.resblocks.{i}" for tower in ("visual.", "") for i in range(2)]
    layers = ("attn.out_proj", "mlp.c_fc", "mlp.c_proj")
    assert sorted(swapped) == sorted(f"{b}.{layer}" for b in blocks for layer in layers)
    attentions = [m for m in model.modules() if isinstance(m, Attention)]
    assert len(attentions) == 4 and all(a.linear is not F.linear for a in attentions)
    assert type(model.visual.conv1) is nn.Conv2d  # the patch embedding stays in high precision
    assert not any(type(m) is nn.Linear for m in model.modules())


def test_checkpoints_round_trip_between_standard_and_switchback():
    torch.manual_seed(0)
    standard = build_model(tiny_config(ls_init_value=0.1)).eval()
    switchback = switchback_model().eval()
    assert standard.state_dict().keys() == switchback.state_dict().keys()
    switchback.load_state_dict(standard.state_dict())
    images = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        a, b = standard.encode_image(images), switchback.encode_image(images)
        assert (a - b).norm() / a.norm() < 0.05
    back = build_model(tiny_config(ls_init_value=0.1))
    back.load_state_dict(switchback.state_dict())
    assert all(torch.equal(p, q) for p, q in zip(back.parameters(), standard.parameters()))


def test_unknown_variant_and_unavailable_backend_fail_clearly():
    with pytest.raises(ValueError, match="model.linear='int4' is not one of standard, switchback_int8"):
        convert_to_switchback(nn.Sequential(nn.Linear(2, 2)), "int4")
    with pytest.raises(ValueError, match="needs a CUDA GPU.*model.linear_backend=reference"):
        convert_to_switchback(nn.Sequential(nn.Linear(2, 2)), "switchback_fp8", backend="cuda")
    with pytest.raises(ValueError, match="model.linear_backend='gpu' is not one of cuda, reference"):
        convert_to_switchback(nn.Sequential(nn.Linear(2, 2)), "switchback_int8", backend="gpu")


def test_convert_works_on_any_model():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    weight = model[0].weight
    convert_to_switchback(model, "switchback_int8_vectorwise", backend="reference")
    assert isinstance(model[0], SwitchBackLinear) and model[0].weight is weight
    assert model(torch.randn(5, 8)).shape == (5, 4)


def test_int8_sums_stay_exact_for_wide_layers():
    """Beyond 1040 inputs float32 could round the int32-equivalent sum; the reference switches to float64."""
    torch.manual_seed(1)
    x, w = torch.randn(8, 4096), torch.randn(16, 4096)
    (qx, sx), (qw, sw) = q8(x.double(), 1), q8(w.double(), None)
    want = (qx @ qw.T) * sx * sw / 127**2
    got = switchback_linear(x, w, None, "switchback_int8", backend="reference")
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.slow  # TorchInductor compiles C++ kernels on the CPU: about 40 s
def test_compiled_blocks_run_switchback_as_in_eager():
    """Regional compilation keeps SwitchBack layers inside the blocks' graphs (custom ops, no graph break) and
    computes what eager does."""
    counters.clear()
    torch.manual_seed(0)
    eager = switchback_model("switchback_fp8")
    compiled = switchback_model("switchback_fp8")
    compiled.load_state_dict(eager.state_dict())
    apply_compile(compiled)
    images, tokens = torch.randn(2, 3, 32, 32), torch.randint(1, 1000, (2, 16))
    losses = []
    for model in (eager, compiled):
        image, text, _ = model(images, tokens)
        loss = (image @ text.T).sum()
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0])
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_custom_ops_pass_torch_library_checks(variant):
    """Schema, fake (meta) implementation and autograd registration of the ops torch.compile sees."""
    x, w, b = torch.randn(6, 8), torch.randn(5, 8, requires_grad=True), torch.randn(5, requires_grad=True)
    x.requires_grad_(True)
    checks = ("test_autograd_registration", "test_faketensor")
    if not VARIANTS[variant].fp8:  # the schema checker multiplies outputs, which CPU fp8 tensors cannot do
        checks += ("test_schema",)
    torch.library.opcheck(torch.ops.stableclip.switchback_forward.default, (x, w, b, variant, "reference", True),
                          test_utils=checks)


def test_fp8_fast_accum_reaches_both_fp8_matmuls(monkeypatch):
    """model.fp8_fast_accum travels from the config through the swapped layers and both custom ops to the
    forward and input-gradient matmuls (on a GPU, `torch._scaled_mm(use_fast_accum=...)`)."""
    seen = []
    real = functions.low_precision_matmul

    def recording(*args):
        seen.append(args[-1])
        return real(*args)
    monkeypatch.setattr(functions, "low_precision_matmul", recording)
    for fast_accum in (True, False):
        model = switchback_model("switchback_fp8", fp8_fast_accum=fast_accum)
        swapped = [m for m in model.modules() if isinstance(m, SwitchBackLinear)]
        assert swapped and all(m.fp8_fast_accum is fast_accum for m in swapped)
        seen.clear()
        image, text, _ = model(torch.randn(2, 3, 32, 32), torch.randint(1, 1000, (2, 16)))
        (image @ text.T).sum().backward()
        assert len(seen) >= 2 * len(swapped) and set(seen) == {fast_accum}


def test_fast_accum_is_the_scaled_mm_flag(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "_scaled_mm", lambda *args, **kwargs: calls.append(kwargs["use_fast_accum"]))
    q, scale = torch.zeros(4, 16, dtype=torch.float8_e4m3fn), torch.ones(4, 1)
    for fast_accum in (True, False):
        functions.low_precision_matmul(VARIANTS["switchback_fp8"], "cuda", q, scale, q.t(), torch.ones(1, 1), None,
                                       torch.bfloat16, fast_accum)
    assert calls == [True, False]
