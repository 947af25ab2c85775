import math

import open_clip
import pytest
import torch
from open_clip.model import CLIP as OpenCLIP
from open_clip.model import CLIPTextCfg, CLIPVisionCfg

from src.config import ModelConfig
from src.kernels.dispatch import build_model_with_kernels
from src.models import build_model, count_parameters, load_openclip_checkpoint, load_openclip_state_dict
from src.models.clip import TEXT_STREAM_RMS
from src.models.transformer import Attention, Block, LayerScale
from src.optim.param_groups import param_groups
from tests.conftest import compose_config


def tiny_config(ls_init_value=0.0) -> ModelConfig:
    sizes = "name=tiny embed_dim=32 vision.width=48 vision.layers=2 vision.heads=3 text.width=32 text.layers=2"
    cfg = compose_config(["model=vit_tiny", *(f"model.{size}" for size in sizes.split()), "model.text.heads=2"]).model
    cfg.ls_init_value = ls_init_value
    return cfg


def tiny_openclip(ls_init_value=None) -> OpenCLIP:
    return OpenCLIP(
        32,
        CLIPVisionCfg(image_size=32, patch_size=8, width=48, layers=2, head_width=16, ls_init_value=ls_init_value),
        CLIPTextCfg(context_length=16, width=32, heads=2, layers=2, ls_init_value=ls_init_value),
    ).eval()


def test_layer_scale_starts_at_zero_and_blocks_are_identity():
    torch.manual_seed(0)
    model = build_model(tiny_config())
    gammas = [m.gamma for m in model.modules() if isinstance(m, LayerScale)]
    assert len(gammas) == 2 * (2 + 2) and all(torch.equal(g, torch.zeros_like(g)) for g in gammas)
    x = torch.randn(3, 17, 48)
    for block in model.visual.transformer.resblocks:
        assert torch.equal(block(x), x)
    x = torch.randn(3, 16, 32)
    for block in model.transformer.resblocks:
        assert torch.equal(block(x, causal=True), x)


def test_layer_scale_init_value_is_configurable_and_can_be_off():
    model = build_model(tiny_config(ls_init_value=0.1))
    assert all(torch.allclose(m.gamma, torch.full_like(m.gamma, 0.1))
               for m in model.modules() if isinstance(m, LayerScale))
    model = build_model(tiny_config(ls_init_value=None))
    assert not any(isinstance(m, LayerScale) for m in model.modules())


def stream_rms_entering_the_blocks(model, images: torch.Tensor, tokens: torch.Tensor) -> tuple[float, float]:
    """The RMS of the residual stream that each tower's first block adds its γ-scaled branches to."""
    seen = {}
    hooks = [tower.register_forward_pre_hook(lambda module, args, name=name: seen.setdefault(name, args[0]))
             for name, tower in (("image", model.visual.transformer), ("text", model.transformer))]
    with torch.no_grad():
        model.encode_image(images), model.encode_text(tokens)
    for hook in hooks:
        hook.remove()
    return tuple(seen[name].pow(2).mean().sqrt().item() for name in ("image", "text"))


def test_with_layer_scale_the_image_stream_starts_at_the_text_streams_scale():
    # A block adds γ · branch to its tower's stream, so a γ weighs as much in each tower as the stream is small.
    # ln_pre makes the image stream RMS 1 at gain 1, against ~0.022 for the text stream's embeddings: at gain 1
    # the image blocks are ~45x weaker for the same γ, and the quickstart's image tower learned late.
    torch.manual_seed(0)
    images, tokens = torch.randn(4, 3, 32, 32), torch.randint(1, 400, (4, 16))
    image_rms, text_rms = stream_rms_entering_the_blocks(build_model(tiny_config(1e-4)), images, tokens)
    assert image_rms == pytest.approx(text_rms, rel=0.15) and image_rms == pytest.approx(TEXT_STREAM_RMS, rel=0.01)
    plain = tiny_config(None)  # no layer-scale: OpenCLIP's ln_pre at gain 1, the stream at RMS 1
    image_rms, text_rms = stream_rms_entering_the_blocks(build_model(plain), images, tokens)
    assert image_rms == pytest.approx(1.0, rel=0.01) and image_rms > 30 * text_rms
    plain.vision.ln_pre_gain = 0.5  # a set gain wins, with or without layer-scale
    assert build_model(plain).visual.ln_pre.weight.unique().tolist() == [0.5]


def test_gamma_and_embeddings_get_no_weight_decay():
    model = build_model(tiny_config())
    decayed, plain = param_groups(model, 0.2, lr=1e-3)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed_names = {names[id(p)] for p in decayed["params"]}
    plain_names = {names[id(p)] for p in plain["params"]}
    assert plain["weight_decay"] == 0.0 and decayed["weight_decay"] == 0.2
    assert {"logit_scale", "token_embedding.weight", "positional_embedding", "visual.class_embedding",
            "visual.positional_embedding", "transformer.resblocks.0.ls_1.gamma"} <= plain_names
    assert all(not n.endswith(".bias") and "ln_" not in n for n in decayed_names)
    assert "visual.transformer.resblocks.0.attn.in_proj_weight" in decayed_names
    assert "visual.proj" in decayed_names and "text_projection" in decayed_names


@pytest.mark.parametrize("ls_init_value", [None, 0.5])
def test_openclip_state_dict_loads_strictly_and_gives_same_embeddings(ls_init_value):
    torch.manual_seed(0)
    theirs = tiny_openclip(ls_init_value)
    ours = build_model(tiny_config(ls_init_value=0.0)).eval()
    load_openclip_state_dict(ours, theirs.state_dict())
    images = torch.randn(4, 3, 32, 32)
    tokens = open_clip.tokenize(["a red cat", "hello", "x y z", "a dog on a mat"], context_length=16)
    with torch.no_grad():
        torch.testing.assert_close(ours.encode_image(images), theirs.encode_image(images, normalize=True))
        torch.testing.assert_close(ours.encode_text(tokens), theirs.encode_text(tokens, normalize=True))
        assert ours(images, tokens)[2] == theirs(images, tokens)[2]


def test_openclip_checkpoint_file_loads(tmp_path):
    theirs = tiny_openclip(None)
    path = tmp_path / "openclip.pt"
    torch.save({"epoch": 3, "state_dict": {f"module.{k}": v for k, v in theirs.state_dict().items()}}, path)
    ours = build_model(tiny_config())
    load_openclip_checkpoint(ours, path)
    assert torch.equal(ours.visual.proj, theirs.visual.proj)


def test_openclip_checkpoint_of_other_architecture_fails_clearly():
    theirs = tiny_openclip(None)
    other = tiny_config()
    other.embed_dim = 16
    with pytest.raises(ValueError, match="text_projection"):
        load_openclip_state_dict(build_model(other), theirs.state_dict())


@pytest.mark.parametrize("preset,openclip_name", [("vit_b32", "ViT-B-32"), ("vit_l14", "ViT-L-14"),
                                                  ("vit_huge", "ViT-H-14")])
def test_presets_have_openclip_parameter_names_and_shapes(preset, openclip_name):
    ours = build_model(compose_config([f"model={preset}", "data=synthetic_shapes"]).model, "meta")
    with torch.device("meta"):
        theirs = OpenCLIP(**open_clip.get_model_config(openclip_name))
    expected = {k: v.shape for k, v in theirs.state_dict().items()}
    got = {k: v.shape for k, v in ours.state_dict().items() if not k.endswith(".gamma")}
    assert got == expected
    assert count_parameters(ours)["total"] >= sum(v.numel() for v in theirs.parameters())


def test_logit_scale_clamped_at_ln_100():
    model = build_model(tiny_config())
    with torch.no_grad():
        model.logit_scale.fill_(10.0)
    model.clamp_logit_scale()
    assert math.isclose(model.logit_scale.item(), math.log(100), rel_tol=1e-6)


def test_patch_dropout_keeps_class_token_and_only_in_training():
    config = tiny_config()
    config.vision.patch_dropout = 0.5
    model = build_model(config)
    x = torch.randn(2, 17, 48)
    dropped = model.visual.patch_dropout(x)
    assert dropped.shape == (2, 9, 48) and torch.equal(dropped[:, 0], x[:, 0])
    model.eval()
    assert torch.equal(model.visual.patch_dropout(x), x)


def test_grad_checkpointing_gives_same_gradients():
    torch.manual_seed(0)
    plain = build_model(tiny_config(ls_init_value=0.3))
    checkpointed = build_model(tiny_config(ls_init_value=0.3))
    checkpointed.load_state_dict(plain.state_dict())
    checkpointed.set_grad_checkpointing(True)
    images, tokens = torch.randn(2, 3, 32, 32), torch.randint(1, 400, (2, 16))
    for model in (plain, checkpointed):
        image_features, text_features, _ = model(images, tokens)
        (image_features @ text_features.T).sum().backward()
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


def test_width_not_divisible_by_heads_fails_clearly():
    config = tiny_config()
    config.vision.heads = 5
    with pytest.raises(ValueError, match="width 48 is not divisible by heads 5"):
        build_model(config)


def test_block_has_openclip_names():
    names = {n for n, _ in Block(8, 2, 4.0, 0.0, False).named_parameters()}
    assert {"attn.in_proj_weight", "attn.out_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.bias",
            "ls_1.gamma", "ls_2.gamma", "ln_1.weight", "ln_2.bias"} <= names


def test_patch_embedding_as_a_matmul_equals_the_convolution():
    from src.models.vision import VisionTransformer

    torch.manual_seed(0)
    tower = VisionTransformer(64, 16, 48, 1, 4, 4.0, 32, 0.1, 0.0, False)
    tower.init_weights()
    images = torch.randn(2, 3, 64, 64)
    expected = tower.conv1(images).flatten(2).transpose(1, 2)
    torch.testing.assert_close(tower.embed_patches(images), expected, rtol=1e-5, atol=1e-5)


def test_attention_backend_restricts_the_kernel_and_keeps_the_result():
    torch.manual_seed(0)
    auto = build_model(tiny_config(ls_init_value=0.1))
    config = tiny_config(ls_init_value=0.1)
    config.attention_backend = "math"
    restricted = build_model_with_kernels(config)
    restricted.load_state_dict(auto.state_dict())
    assert all(a.backend == "math" for a in restricted.modules() if isinstance(a, Attention))
    images, tokens = torch.randn(2, 3, 32, 32), torch.randint(1, 1000, (2, 16))
    torch.testing.assert_close(restricted(images, tokens)[:2], auto(images, tokens)[:2])
    config.attention_backend = "fastest"
    with pytest.raises(ValueError,
                       match="model.attention_backend='fastest' is not one of auto, triton_short, triton_tiled, flash"):
        build_model_with_kernels(config)


def _captions(count: int, length: int) -> torch.Tensor:
    """Token ids with the end-of-text token (the largest id) at a different position in each caption, zeros
    after it, as the tokenizer pads."""
    tokens = torch.randint(1, 400, (count, length))
    for row, end in enumerate(torch.linspace(1, length - 1, count).long()):
        tokens[row, end], tokens[row, end + 1:] = 49407, 0
    return tokens


@pytest.mark.parametrize("policy", ["none", "full", "selective"])
@pytest.mark.parametrize("layers", [1, 2])
def test_pruned_last_block_gives_the_same_embeddings_and_gradients(policy, layers):
    torch.manual_seed(0)
    config = tiny_config(ls_init_value=0.3)  # not 0: at 0 every block starts as the identity
    config.vision.layers = config.text.layers = layers
    config.checkpoint_policy = policy
    pruned = build_model(config).double()
    config.prune_last_block = False
    whole = build_model(config).double()
    whole.load_state_dict(pruned.state_dict())
    assert not whole.visual.transformer.prune_last_block and not whole.transformer.prune_last_block
    images, tokens = torch.randn(4, 3, 32, 32, dtype=torch.float64), _captions(4, 16)
    outputs = []
    for model in (pruned, whole):
        image_features, text_features, _ = model(images, tokens)
        (image_features @ text_features.T).square().sum().backward()
        outputs.append((image_features, text_features))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-12, atol=1e-12)
    for (name, a), b in zip(pruned.named_parameters(), whole.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12, msg=name)
    # The last block's query projection still learns: its slice of the fused weight gets a gradient.
    last = pruned.visual.transformer.resblocks[-1].attn
    assert last.in_proj_weight.grad[: last.in_proj_weight.shape[1]].abs().sum() > 0


def test_pruned_last_block_saves_most_of_a_block():
    from torch.utils.flop_counter import FlopCounterMode

    config = tiny_config()
    config.vision.layers = config.text.layers = 4
    images, tokens = torch.randn(4, 3, 32, 32), _captions(4, 16)
    flops = {}
    for prune in (True, False):
        config.prune_last_block = prune
        model = build_model(config)
        with FlopCounterMode(display=False) as counter:
            model(images, tokens)
        flops[prune] = counter.get_total_flops()
    # Each tower's last block keeps its key and value projections (2 of a block's 12 width² matmuls per
    # token) and drops the rest for all but one token per sample: about 0.8 of a block of four.
    saved = 1 - flops[True] / flops[False]
    assert 0.15 < saved < 0.8 / 4 + 0.01, saved


def test_class_token_alone_equals_the_class_token_of_all_tokens():
    torch.manual_seed(0)
    model = build_model(tiny_config(ls_init_value=0.3)).double().eval()
    images = torch.randn(3, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(model.visual.tokens(images, class_only=True), model.visual.tokens(images)[:, 0])


def test_compiled_clip_runs_every_kind_of_block_call_compiled(monkeypatch):
    """Regional compilation (trainer.compile=true) of a whole CLIP: first and pooled last blocks of both towers, in
    training and evaluation, all stay within Dynamo's recompile limit (past it they would quietly run eager), with
    eager's results. Dynamo's graphs and guards are what count here, so its eager backend stands in for Inductor
    (other tests compare Inductor's code with eager)."""
    from src.parallel.parallelize import apply_compile

    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self: compile_module(self, backend="eager"))
    torch.manual_seed(0)
    eager = build_model_with_kernels(tiny_config(ls_init_value=0.3))
    compiled = build_model_with_kernels(tiny_config(ls_init_value=0.3))
    compiled.load_state_dict(eager.state_dict())
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    apply_compile(compiled)
    images, tokens = torch.randn(4, 3, 32, 32), _captions(4, 16)
    # Under autocast, as the trainer runs: the first block's input then has another dtype than the others'.
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True), torch.autocast("cpu", torch.bfloat16):
        for model in (eager, compiled):
            image_features, text_features, _ = model(images, tokens)
            (image_features @ text_features.T).float().sum().backward()
        with torch.no_grad():
            for model in (eager, compiled):
                model.eval()(images[:3], tokens[:3])  # an evaluation batch of another size recompiles
            evaluated = [model(images, tokens)[:2] for model in (eager, compiled)]
    # Per tower, the first and the pooled last block, each in training and in evaluation (the second evaluation
    # batch size reuses the evaluation graphs, which are compiled with a dynamic batch): 8 graphs of Block.forward,
    # Dynamo's whole default allowance; apply_compile leaves room above it (parallelize.RECOMPILE_LIMIT).
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 8
    torch.testing.assert_close(evaluated[1], evaluated[0])
    for (name, a), b in zip(compiled.named_parameters(), eager.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


def test_compile_cache_key_carries_the_model_code_and_keeps_the_users_tag():
    """Inductor's caches do not see our custom ops' fake implementations: a digest of the model code joins their
    key, so a cache written before an edit is not replayed after it."""
    from src.parallel.parallelize import tag_compile_caches

    # Not monkeypatch: its undo deletes the attribute, which hides the config key from later tests.
    with torch.compiler.config.patch(cache_key_tag="mine"):
        tag_compile_caches()
        first = torch.compiler.config.cache_key_tag
        tag_compile_caches()
        assert first == torch.compiler.config.cache_key_tag
    mine, ours = first.split(",")
    assert mine == "mine" and ours.startswith("stableclip-models-") and len(ours) == len("stableclip-models-") + 16


def test_model_files_import_no_kernel():
    """src/models/ is the architecture in plain PyTorch: src/kernels/dispatch.py puts the kernels in."""
    import ast
    from pathlib import Path

    offending = []
    for path in sorted((Path(__file__).parents[1] / "src" / "models").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or "", *(f"{node.module}.{alias.name}" for alias in node.names)]
            if any(name == "src.kernels" or name.startswith("src.kernels.") for name in names):
                offending.append(f"{path.name}:{node.lineno}")
    assert not offending, f"src/models imports src.kernels at {', '.join(offending)}"


def test_apply_kernels_keeps_parameters_state_dict_and_results():
    from src.kernels.blocks import KernelAttention, KernelBlock, KernelTransformer
    from src.kernels.dispatch import apply_kernels

    torch.manual_seed(0)
    config = tiny_config(ls_init_value=0.3)
    model = build_model(config).eval()
    images, tokens = torch.randn(2, 3, 32, 32), _captions(2, 16)
    keys, parameters = model.state_dict().keys(), list(model.parameters())
    with torch.no_grad():
        want = model(images, tokens)
        assert apply_kernels(model, config) is model
        got = model(images, tokens)
    assert model.state_dict().keys() == keys and all(p is q for p, q in zip(model.parameters(), parameters))
    kinds = {type(m) for m in model.modules()}
    assert {KernelAttention, KernelBlock, KernelTransformer} <= kinds and not kinds & {Attention, Block}
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_public_names_import_from_their_packages_without_triton():
    """The names a user imports come from the package; importing them loads no Triton (a GPU extra) until a
    kernel is used."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from src.models import (CLIP, VideoCLIP, build_model, build_video_model, count_parameters,\n"
            "    load_openclip_checkpoint, load_openclip_state_dict)\n"
            "import src.kernels\n"
            "assert 'triton' not in sys.modules, 'importing src.models or src.kernels loaded triton'\n"
            "from src.kernels import SwitchBackLinear, apply_kernels, convert_to_switchback, switchback_linear\n"
            "from src.kernels.dispatch import apply_kernels as dispatched\n"
            "assert apply_kernels is dispatched\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
