"""optim.layer_scale_lr_scale: the layer-scale gammas' learning rate is lr x this (x layer decay), in groups of their
own; at 1.0 the parameter groups are exactly those of before the key (checkpoints still load with their moments);
preflight refuses a factor of 0; a resume with another factor names it and starts fresh moments; the quickstart
preset is the paper's recipe and passes preflight."""

import pytest
import torch

from src.compose import compose_config
from src.models.clip import build_model
from src.models.locking import layer_depths
from src.models.transformer import LayerScale
from src.optim import build_optimizer, build_scheduler
from src.optim.param_groups import decays, param_groups
from src.optim.schedule import warmup_cosine
from src.parallel.distributed import DistInfo

CPU = DistInfo(0, 1, 0, torch.device("cpu"))
LR = 1e-3


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(compose_config(["model=vit_tiny", "model.ls_init_value=1e-4"]).model)


def gamma_names(model: torch.nn.Module) -> set[str]:
    ids = {id(m.gamma) for m in model.modules() if isinstance(m, LayerScale)}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def test_at_1_the_groups_are_the_two_weight_decay_groups_of_before():
    model = tiny_model()
    names = {p: n for n, p in model.named_parameters()}
    groups = param_groups(model, 0.1, LR, layer_scale_lr_scale=1.0)
    # What param_groups built before the key: every decayed parameter, then every other one, both at lr.
    decayed = [p for n, p in model.named_parameters() if decays(n, p)]
    other = [p for n, p in model.named_parameters() if not decays(n, p)]
    assert [[names[p] for p in g["params"]] for g in groups] == [[names[p] for p in decayed],
                                                                 [names[p] for p in other]]
    assert [(g["weight_decay"], g["lr"], g["lr_scale"]) for g in groups] == [(0.1, LR, 1.0), (0.0, LR, 1.0)]
    assert gamma_names(model) <= {names[p] for p in groups[1]["params"]} and len(gamma_names(model)) == 12
    # With layer decay too: the same ten groups as without the key (5 depths x decayed or not).
    depths = layer_depths(model)
    with_key = param_groups(model, 0.1, LR, 0.5, depths, layer_scale_lr_scale=1.0)
    without = param_groups(model, 0.1, LR, 0.5, depths)
    assert len(with_key) == 10
    assert [([id(p) for p in a["params"]], a["lr"], a["weight_decay"]) for a in with_key] == [
        ([id(p) for p in b["params"]], b["lr"], b["weight_decay"]) for b in without]


def test_the_gammas_get_lr_times_the_factor_times_layer_decay_and_the_schedule_keeps_it():
    cfg = compose_config(["model=vit_tiny", "model.ls_init_value=1e-4", "optim=stable_adamw", f"optim.lr={LR}",
                          "optim.layer_decay=0.5", "optim.layer_scale_lr_scale=10", "optim.warmup_steps=2",
                          "trainer.max_steps=10"])
    model = build_model(cfg.model)
    depths = layer_depths(model)
    optimizer = build_optimizer(cfg.optim, model, depths=depths)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.trainer.max_steps)
    names, gammas = {p: n for n, p in model.named_parameters()}, gamma_names(model)
    # 5 depths x decayed or not, and the 3 block depths of each tower also hold gammas: 13 groups.
    assert len(optimizer.param_groups) == 13
    assert all(all(names[p] in gammas for p in g["params"]) or not any(names[p] in gammas for p in g["params"])
               for g in optimizer.param_groups)
    for _ in range(3):
        optimizer.step()
        scheduler.step()
        factor = warmup_cosine(scheduler.last_epoch, 2, 10, 0.0)
        for group in optimizer.param_groups:
            for p in group["params"]:
                name = names[p]
                expected = LR * 0.5 ** depths[name] * (10.0 if name in gammas else 1.0) * factor
                assert group["lr"] == pytest.approx(expected, rel=1e-12), name
    # The last group still holds the logit scale at scale 1 (what train/lr logs).
    assert optimizer.param_groups[-1]["lr_scale"] == 1.0
    assert "logit_scale" in {names[p] for p in optimizer.param_groups[-1]["params"]}


def test_without_layer_scale_the_factor_changes_nothing():
    model = build_model(compose_config(["model=vit_tiny", "model.ls_init_value=null"]).model)
    assert [len(g["params"]) for g in param_groups(model, 0.1, LR, layer_scale_lr_scale=10.0)] == [
        len(g["params"]) for g in param_groups(model, 0.1, LR)]


def test_preflight_refuses_a_factor_of_zero(tmp_path):
    from src.trainer.preflight import preflight

    cfg = compose_config(["experiment=quickstart", "optim.layer_scale_lr_scale=0"])
    with pytest.raises(ValueError) as err:
        preflight(cfg, CPU, str(tmp_path))
    assert "optim.layer_scale_lr_scale=0.0 is out of range: set it to a finite number above 0" in str(err.value)


def test_a_resume_with_another_factor_names_it_and_starts_fresh_moments(shapes, tmp_path):
    from src.trainer.trainer import Trainer

    def trainer(*extra: str) -> Trainer:
        overrides = ["experiment=quickstart", f"data.shards='{shapes['shards']}'", "data.eval_shards=null",
                     "data.generate=false", f"trainer.run_dir={tmp_path}", "trainer.progress=false",
                     "data.batch_size=8", "data.num_workers=0", "trainer.max_steps=3", "trainer.ckpt_every=0",
                     "optim.warmup_steps=1", "logger=none", "model.ls_init_value=1e-4", *extra]
        return Trainer(compose_config(overrides), str(tmp_path), CPU)

    first = trainer("optim.layer_scale_lr_scale=1.0", "trainer.max_steps=2")
    first.fit()
    resumed = trainer("optim.layer_scale_lr_scale=10", "trainer.resume=latest")
    assert [str(c) for c in resumed.resumed_optimizer.changes] == ["optim.layer_scale_lr_scale 1.0 -> 10.0"]
    assert not resumed.optimizer.state and resumed.progress.step == 2
    for name, p in resumed.model.named_parameters():  # the weights did load
        assert torch.equal(p, first.model.state_dict()[name]), name
    resumed.fit()
    assert resumed.progress.step == 3 and resumed.optimizer.state
    gammas = gamma_names(resumed.model)
    names = {p: n for n, p in resumed.model.named_parameters()}
    # The schedule's peak lrs (the last step's cosine lr is 0): the gammas' is 10 x the rest's.
    peaks = {names[p]: g["initial_lr"] for g in resumed.optimizer.param_groups for p in g["params"]}
    assert peaks["logit_scale"] == resumed.cfg.optim.lr
    assert all(peaks[n] == pytest.approx(10 * resumed.cfg.optim.lr, rel=1e-12) for n in gammas), peaks


def test_the_quickstart_is_the_papers_recipe_and_passes_preflight(tmp_path):
    """experiment=quickstart as docs/stability.md describes it: the model's near-zero layer-scale, StableAdamW at
    its own betas and clipping, the spike metrics, the gammas at 10x lr, ln_pre's gain at the text stream's scale."""
    from src.models.clip import TEXT_STREAM_RMS, ln_pre_gain
    from src.trainer.preflight import preflight

    cfg = compose_config(["experiment=quickstart"])
    assert cfg.model.ls_init_value == 1e-4 and cfg.optim.name == "stable_adamw" and cfg.spikes.enabled
    assert cfg.optim.layer_scale_lr_scale == 10.0 and list(cfg.optim.betas) == [0.9, 0.99]
    assert cfg.optim.clip_threshold == 1.0 and ln_pre_gain(cfg.model) == TEXT_STREAM_RMS
    preflight(cfg, CPU, str(tmp_path))
