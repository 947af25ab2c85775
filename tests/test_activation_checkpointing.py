"""Activation checkpointing policies (`model.checkpoint_policy`, `model.checkpoint_every`) of the transformer
towers: the same loss and gradients as keeping everything, and the memory each policy promises."""

import collections

import pytest
import torch
from hydra.errors import ConfigCompositionException
from torch.utils._python_dispatch import TorchDispatchMode

from src.kernels.dispatch import build_model_with_kernels
from src.models import build_model
from src.models.clip import CLIP
from src.models.cross_attention import saved_activation_bytes
from src.models.transformer import Block
from src.parallel.parallelize import apply_compile
from src.trainer.loss import clip_loss
from tests.conftest import compose_config

_generator = torch.Generator().manual_seed(0)
IMAGES = torch.randn(4, 3, 32, 32, generator=_generator)
TOKENS = torch.randint(1, 400, (4, 16), generator=_generator)


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return tiny_clip().state_dict()


def tiny_clip(policy: str = "none", every: int = 1, kernels: bool = True) -> CLIP:
    """The model as the trainer runs it (apply_kernels), or the plain architecture."""
    # Non-zero layer-scale: at 0 every block is the identity and half its parameters get no gradient.
    cfg = compose_config(["model=vit_tiny", "data=synthetic_shapes", "model.ls_init_value=0.5"]).model
    model = build_model_with_kernels(cfg) if kernels else build_model(cfg)
    for tower in (model.visual.transformer, model.transformer):
        tower.set_checkpointing(policy, every)
    return model


def loss_and_saved_bytes(model: CLIP) -> tuple[torch.Tensor, int]:
    """One training loss, backpropagated; the bytes of activations autograd kept between forward and backward."""
    loss, saved = saved_activation_bytes(lambda: clip_loss(*model(IMAGES, TOKENS)), exclude=model.parameters())
    loss.backward()
    return loss.detach(), saved


def run(weights: dict[str, torch.Tensor], policy: str, every: int = 1, backend: str | None = None,
        kernels: bool = True):
    model = tiny_clip(policy, every, kernels)
    model.load_state_dict(weights)
    if backend:
        for block in model.modules():
            if isinstance(block, Block):
                block.compile(backend=backend)
    loss, saved = loss_and_saved_bytes(model)
    return loss, {name: p.grad for name, p in model.named_parameters()}, saved


def assert_same(got, want, **tolerance) -> None:
    torch.testing.assert_close(got[0], want[0], **tolerance)
    assert got[1].keys() == want[1].keys()
    for name, grad in want[1].items():
        assert grad is not None and grad.abs().sum() > 0, name
        torch.testing.assert_close(got[1][name], grad, msg=name, **tolerance)


@pytest.mark.parametrize("kernels", [True, False])
@pytest.mark.parametrize("policy,every", [("full", 1), ("selective", 1), ("full", 2), ("selective", 2)])
def test_policy_gives_the_loss_and_gradients_of_none(weights, policy, every, kernels):
    assert_same(run(weights, policy, every, kernels=kernels), run(weights, "none", kernels=kernels),
                rtol=1e-6, atol=1e-7)


def test_selective_keeps_less_than_none_and_more_than_full(weights):
    saved = {(policy, every): run(weights, policy, every)[2]
             for policy, every in [("none", 1), ("selective", 1), ("full", 1), ("full", 2)]}
    assert saved["full", 1] < saved["selective", 1] < saved["none", 1]
    assert saved["full", 1] < saved["full", 2] < saved["none", 1]


def test_compiled_block_applies_the_selective_policy_and_gives_the_same_gradients(weights):
    """aot_eager runs what matters here, TorchDynamo tracing the checkpoint and AOTAutograd partitioning the
    graph by the policy, without TorchInductor's C++ compilation (see the slow test below)."""
    torch._dynamo.reset()
    eager = run(weights, "selective")
    compiled = run(weights, "selective", backend="aot_eager")
    assert_same(compiled, run(weights, "none"), rtol=1e-6, atol=1e-7)
    assert compiled[2] == eager[2]


@pytest.mark.slow  # TorchInductor compiles C++ kernels on the CPU: about 20 s with a cold cache
def test_regionally_compiled_selective_blocks_match_eager():
    """train.py's compilation (parallelize.apply_compile), of the image tower only: one graph to compile."""
    torch.manual_seed(0)
    eager, compiled = tiny_clip("none"), tiny_clip("selective")
    compiled.load_state_dict(eager.state_dict())
    torch._dynamo.reset()
    assert apply_compile(compiled.visual) == 3
    want, got = loss_and_saved_bytes(eager), loss_and_saved_bytes(compiled)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name, rtol=1e-4, atol=1e-4)
    assert got[1] < want[1]


def test_grad_checkpointing_switch_is_full_on_every_block():
    model = tiny_clip()
    model.set_grad_checkpointing(True)
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    assert {b.checkpoint_policy for b in blocks} == {"full"} and model.transformer.grad_checkpointing
    model.set_grad_checkpointing(False)
    assert {b.checkpoint_policy for b in blocks} == {"none"} and not model.transformer.grad_checkpointing


def test_every_second_block_is_checkpointed():
    tower = tiny_clip("selective", 2).transformer
    assert [b.checkpoint_policy for b in tower.resblocks] == ["selective", "none", "selective"]


@pytest.mark.parametrize("policy,every,message", [
    ("every_2", 1, "model.checkpoint_policy='every_2' is not one of none, full, selective"),
    ("full", 0, "model.checkpoint_every=0 must be an integer >= 1"),
    ("full", "2", "model.checkpoint_every='2' must be an integer >= 1"),
])
def test_bad_values_name_the_value_and_the_choices(policy, every, message):
    with pytest.raises(ValueError, match=message):
        tiny_clip().transformer.set_checkpointing(policy, every)


@pytest.mark.parametrize("overrides,policies", [
    ([], ["none"] * 3),
    (["model.grad_checkpointing=true"], ["full"] * 3),
    (["model.checkpoint_policy=selective", "model.checkpoint_every=2"], ["selective", "none", "selective"]),
    (["model.grad_checkpointing=true", "model.checkpoint_policy=selective"], ["selective"] * 3),
])
def test_config_keys_reach_every_block(overrides, policies):
    model = build_model(compose_config(["model=vit_tiny", "data=synthetic_shapes", *overrides]).model, "meta")
    for tower in (model.visual.transformer, model.transformer):
        assert [b.checkpoint_policy for b in tower.resblocks] == policies


def test_bad_config_value_fails_at_composition_naming_the_choices():
    with pytest.raises(ConfigCompositionException) as err:
        compose_config(["model=vit_tiny", "data=synthetic_shapes", "model.checkpoint_policy=every_2"])
    message = str(err.value.__cause__)
    assert "'every_2'" in message and "expected one of [none, full, selective]" in message


class OpCalls(TorchDispatchMode):
    """Counts the ops run while it is active."""

    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[func] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("policy", "reruns"), [("selective", False), ("full", True)])
def test_selective_keeps_switchback_layers_instead_of_rerunning_them(policy, reruns):
    """A SwitchBack layer is a matmul (a custom op): `selective` keeps its output, as it keeps F.linear's."""
    cfg = compose_config(["model=vit_tiny", "data=synthetic_shapes", "model.ls_init_value=0.5",
                          "model.linear=switchback_int8", "model.linear_backend=reference"]).model
    model = build_model_with_kernels(cfg)
    for tower in (model.visual.transformer, model.transformer):
        tower.set_checkpointing(policy)
    loss = clip_loss(*model(IMAGES, TOKENS))
    with OpCalls() as counter:
        loss.backward()
    assert (counter.calls[torch.ops.stableclip.switchback_forward.default] > 0) == reruns
