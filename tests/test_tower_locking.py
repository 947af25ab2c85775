"""Locking towers (model.vision.lock, model.text.lock, unlocked_blocks) and layer decay (optim.layer_decay):
frozen weights stay bit-identical, the optimizer holds state for trained parameters only, a locked tower keeps no
autograd graph (also in compiled blocks), every parameter group's learning rate is lr x layer_decay^depth x the
schedule, the memory estimate and preflight know the locks, a resume with other locks says so, and two DDP ranks
train with a locked tower."""

import os
from typing import TYPE_CHECKING

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from src.compose import compose_config
from src.models.clip import build_model, count_parameters
from src.models.locking import layer_depths
from src.optim import build_optimizer, build_scheduler
from src.optim.schedule import warmup_cosine
from src.parallel.distributed import DistInfo
from tests.conftest import fork_ranks, free_port

if TYPE_CHECKING:
    from src.trainer.trainer import Trainer
# The trainer and preflight are imported in the tests that use them: each DDP worker imports this module again,
# and they would double its start-up time.

STEPS = 3
LAYERS = 3  # vit_tiny's towers
CPU = DistInfo(0, 1, 0, torch.device("cpu"))


def overrides(shapes, run_dir, *extra: str) -> list[str]:
    return ["experiment=quickstart", f"data.shards='{shapes['shards']}'", "data.eval_shards=null",
            "data.generate=false", f"trainer.run_dir={run_dir}", "trainer.progress=false", "data.batch_size=8",
            "data.num_workers=0", f"trainer.max_steps={STEPS}", "trainer.ckpt_every=0", "optim.warmup_steps=1",
            "logger=none", *extra]


def build_trainer(shapes, run_dir, *extra: str) -> "Trainer":
    from src.trainer.trainer import Trainer

    run_dir.mkdir(parents=True, exist_ok=True)  # train.py makes it
    return Trainer(compose_config(overrides(shapes, run_dir, *extra)), str(run_dir), CPU)


def train(trainer: "Trainer") -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The weights before and after STEPS steps."""
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    for _ in range(STEPS):
        trainer.train_step(next(trainer.loader))
    return before, dict(trainer.model.named_parameters())


def changed(before: dict, after: dict) -> set[str]:
    return {n for n in before if not torch.equal(before[n], after[n])}


def state_numel(optimizer: torch.optim.Optimizer) -> int:
    return sum(t.numel() for s in optimizer.state.values() for k, t in s.items() if k != "step")


def test_a_locked_image_tower_stays_bit_identical_and_holds_no_optimizer_state(shapes, tmp_path):
    trainer = build_trainer(shapes, tmp_path / "run", "optim=stable_adamw", "model.vision.lock=true")
    before, after = train(trainer)
    visual = {n for n in before if n.startswith("visual.")}
    text = {n for n in before if n.startswith(("token_embedding", "positional_embedding", "transformer.",
                                                "ln_final", "text_projection"))}
    assert changed(before, after) & visual == set()
    assert text - changed(before, after) <= {n for n in text if n.endswith("bias")}, "the text tower trains"
    assert {n for n in text if n.startswith("transformer.resblocks.0.")} & changed(before, after)
    # Optimizer state exactly for the trained parameters: two moments each, nothing for the image tower.
    params = dict(trainer.model.named_parameters())
    stateful = {n for n, p in params.items() if p in trainer.optimizer.state}
    assert stateful == set(params) - visual
    trained = sum(p.numel() for n, p in params.items() if n not in visual)
    assert state_numel(trainer.optimizer) == 2 * trained
    assert all(p.grad is None for n, p in params.items() if n in visual)
    # Spike tracking follows the first trained parameter, the image tower having none.
    assert trainer.parts.patch_embed == "positional_embedding"


def test_unlocked_blocks_train_only_the_last_blocks_and_the_head(shapes, tmp_path):
    trainer = build_trainer(shapes, tmp_path / "run", "model.vision.lock=true", "model.vision.unlocked_blocks=1",
                            "model.text.lock=true", "model.text.unlocked_blocks=2")
    before, after = train(trainer)
    last_image = ("visual.transformer.resblocks.2.", "visual.ln_post.", "visual.proj")
    last_text = ("transformer.resblocks.1.", "transformer.resblocks.2.", "ln_final.", "text_projection")
    trained = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trained == {n for n in before if n.startswith((*last_image, *last_text, "logit_scale"))}
    assert changed(before, after) <= trained
    assert {n for n in changed(before, after) if n.startswith("visual.")}, "the last image block trains"
    assert trainer.parts.patch_embed == "visual.transformer.resblocks.2.ln_1.weight"
    numel = sum(p.numel() for n, p in trainer.model.named_parameters() if n in trained)
    assert state_numel(trainer.optimizer) == 2 * numel


def saved_tensors(function) -> int:
    """How many tensors autograd saves for backward while `function` runs."""
    count = 0

    def pack(tensor):
        nonlocal count
        count += 1
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        function()
    return count


def test_a_locked_tower_records_no_autograd_graph():
    images = torch.randn(2, 3, 32, 32)
    tokens = torch.randint(1, 1000, (2, 16))
    tokens[:, 9] = 49407
    cfg = compose_config(["model=vit_tiny"]).model
    unlocked = build_model(cfg)
    cfg.vision.lock = cfg.text.lock = True
    locked = build_model(cfg)
    assert locked.visual.locked and locked.text_locked
    assert count_parameters(locked)["trainable"] == 1 and count_parameters(unlocked)["trainable"] == sum(
        p.numel() for p in unlocked.parameters())  # the logit scale alone trains
    image_features, text_features, scale = locked(images, tokens)
    assert not image_features.requires_grad and not text_features.requires_grad and scale.requires_grad
    assert saved_tensors(lambda: locked.encode_image(images)) == 0
    assert saved_tensors(lambda: locked.encode_text(tokens)) == 0
    # With one block unlocked, only that block (and the head) keeps activations: fewer than the whole tower's.
    cfg.vision.unlocked_blocks = 1
    partly = build_model(cfg)
    assert not partly.visual.locked
    whole = saved_tensors(lambda: unlocked.encode_image(images))
    last = saved_tensors(lambda: partly.encode_image(images))
    assert 0 < last < whole / 2
    assert partly.encode_image(images).requires_grad


def test_layer_decay_scales_each_group_by_its_depth_and_the_schedule_keeps_the_scale():
    cfg = compose_config(["model=vit_tiny", "optim=stable_adamw", "optim.layer_decay=0.5", "optim.lr=1e-3",
                          "optim.warmup_steps=2", "trainer.max_steps=10"])
    model = build_model(cfg.model)
    optimizer = build_optimizer(cfg.optim, model, depths=layer_depths(model))
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.trainer.max_steps)

    def depth(name: str) -> int:  # BEiT's count: head 0, last block 1, first block LAYERS, embeddings LAYERS + 1
        for prefix in ("visual.transformer.resblocks.", "transformer.resblocks."):
            if name.startswith(prefix):
                return LAYERS - int(name.removeprefix(prefix).split(".")[0])
        embeddings = ("visual.conv1", "visual.class_embedding", "visual.positional_embedding", "visual.ln_pre",
                      "token_embedding", "positional_embedding")
        return LAYERS + 1 if name.startswith(embeddings) else 0

    names = {p: n for n, p in model.named_parameters()}
    assert {depth(n) for n in names.values()} == {0, 1, 2, 3, 4}
    # One group per (depth, weight decay): 5 depths, each with decayed and not decayed parameters.
    assert len(optimizer.param_groups) == 10
    for _ in range(4):
        optimizer.step()
        scheduler.step()
        factor = warmup_cosine(scheduler.last_epoch, 2, 10, 0.0)
        for group in optimizer.param_groups:
            for p in group["params"]:
                assert group["lr"] == pytest.approx(1e-3 * 0.5 ** depth(names[p]) * factor, rel=1e-12), names[p]
    assert optimizer.param_groups[-1]["lr_scale"] == 1.0  # what train/lr logs
    assert {names[p] for g in optimizer.param_groups if g["lr_scale"] == 1.0 for p in g["params"]} == {
        "logit_scale", "visual.ln_post.weight", "visual.ln_post.bias", "visual.proj", "ln_final.weight",
        "ln_final.bias", "text_projection"}


def test_the_memory_estimate_leaves_out_a_locked_towers_gradients_moments_and_activations():
    from src.trainer.memory import estimate_memory

    plain = estimate_memory(compose_config(["model=vit_tiny"]), 1)
    lit = estimate_memory(compose_config(["model=vit_tiny", "model.vision.lock=true"]), 1)
    model = build_model(compose_config(["model=vit_tiny"]).model, "meta")
    visual = sum(p.numel() for p in model.visual.parameters())
    assert plain.optimizer_bytes - lit.optimizer_bytes == 8 * visual  # AdamW's two float32 moments
    assert plain.weights_bytes - lit.weights_bytes == 4 * visual  # no gradients; the weights stay
    assert lit.activation_bytes_per_sample < plain.activation_bytes_per_sample
    both = estimate_memory(compose_config(["model=vit_tiny", "model.vision.lock=true", "model.text.lock=true"]), 1)
    assert both.activation_bytes_per_sample == 3 * 32 * 32 * 4  # the input images alone


def test_preflight_names_the_lock_keys_and_the_towers_depth(tmp_path):
    from src.trainer.preflight import preflight

    cfg = compose_config(["experiment=quickstart", "model.vision.lock=true", "model.vision.unlocked_blocks=4",
                          "model.text.unlocked_blocks=1", "optim.layer_decay=0"])
    with pytest.raises(ValueError) as err:
        preflight(cfg, CPU, str(tmp_path))
    assert "optim.layer_decay=0.0 is out of range: set it to in (0, 1]" in str(err.value)
    cfg.optim.layer_decay = 0.75
    with pytest.raises(ValueError) as err:
        preflight(cfg, CPU, str(tmp_path))
    message = str(err.value)
    assert ("model.vision.unlocked_blocks=4, model.vision.layers=3: model.vision.unlocked_blocks must not exceed "
            "the image tower's depth") in message
    assert "model.text.lock=False, model.text.unlocked_blocks=1" in message and "set model.text.lock=true" in message
    video = compose_config(["experiment=video_finetune", "model.vision.lock=true",
                            "model.video.vision_trainable_blocks=4"])
    with pytest.raises(ValueError) as err:
        preflight(video, CPU, str(tmp_path))
    assert "leave model.vision.lock=false" in str(err.value)
    assert "model.video.vision_trainable_blocks=4, model.vision.layers=3" in str(err.value)


def test_a_resume_with_another_lock_or_layer_decay_names_it_and_starts_fresh_moments(shapes, tmp_path):
    run_dir = tmp_path / "run"
    first = build_trainer(shapes, run_dir, "trainer.max_steps=2")
    first.fit()
    resumed = build_trainer(shapes, run_dir, "trainer.resume=latest", "model.vision.lock=true",
                            "optim.layer_decay=0.8")
    assert {str(c) for c in resumed.resumed_optimizer.changes} == {"model.vision.lock False -> True",
                                                                   "optim.layer_decay 1.0 -> 0.8"}
    # optim.lr is as it was, whatever the groups' scales: only the extended schedule is a change.
    assert [c.key for c in resumed.resumed_schedule.changes] == ["trainer.max_steps"]
    assert not resumed.optimizer.state and resumed.progress.step == 2
    for name, p in resumed.model.named_parameters():  # the weights did load
        assert torch.equal(p, first.model.state_dict()[name]), name
    resumed.fit()
    assert resumed.progress.step == STEPS and resumed.optimizer.state


def ddp_worker(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    cfg = compose_config(["model=vit_tiny", "model.vision.lock=true"]).model
    torch.manual_seed(0)
    model = build_model(cfg)
    ddp = DistributedDataParallel(model)
    torch.manual_seed(1 + rank)  # each rank its own batch
    images, tokens = torch.randn(2, 3, 32, 32), torch.randint(1, 1000, (2, 16))
    tokens[:, 9] = 49407
    image_features, text_features, scale = ddp(images, tokens)
    (scale * image_features @ text_features.T).logsumexp(dim=1).mean().backward()
    assert all(p.grad is None for p in model.visual.parameters())
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])
    gathered = [torch.empty_like(grads) for _ in range(2)]
    dist.all_gather(gathered, grads)
    assert torch.equal(gathered[0], gathered[1]) and grads.abs().sum() > 0, "DDP averaged the text tower's gradients"
    dist.destroy_process_group()


def test_two_ddp_ranks_train_with_a_locked_image_tower():
    fork_ranks(ddp_worker, free_port(), world=2)


def test_locked_towers_run_compiled_blocks_within_the_recompile_limit(monkeypatch):
    """trainer.compile with a locked image tower (its blocks called under no_grad) and a partly locked text tower:
    every block call stays compiled (Dynamo's eager backend: its graphs and guards are what count) and the
    gradients are eager's."""
    from src.kernels.dispatch import apply_kernels
    from src.parallel.parallelize import apply_compile

    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self: compile_module(self, backend="eager"))
    cfg = compose_config(["model=vit_tiny", "model.vision.lock=true", "model.text.lock=true",
                          "model.text.unlocked_blocks=1"]).model
    torch.manual_seed(0)
    eager, compiled = apply_kernels(build_model(cfg), cfg), apply_kernels(build_model(cfg), cfg)
    compiled.load_state_dict(eager.state_dict())
    torch._dynamo.reset()
    apply_compile(compiled)
    images, tokens = torch.randn(4, 3, 32, 32), torch.randint(1, 1000, (4, 16))
    tokens[:, 9] = 49407
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True), torch.autocast("cpu", torch.bfloat16):
        for model in (eager, compiled):
            image_features, text_features, scale = model(images, tokens)
            assert not image_features.requires_grad
            (scale * image_features @ text_features.T).float().sum().backward()
    for (name, a), b in zip(compiled.named_parameters(), eager.parameters()):
        assert (a.grad is None) == (b.grad is None) == (not a.requires_grad), name
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, msg=name)
