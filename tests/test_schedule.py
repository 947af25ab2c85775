"""optim.schedule: the learning rate of each schedule at chosen steps, and a run extended on resume."""

import json
import logging
import math
from types import SimpleNamespace

import pytest
import torch

from src.optim.schedule import build_scheduler
from src.trainer.optim_resume import ResumedSchedule, resume_summary
from src.trainer.preflight import range_problems
from tests.conftest import compose_config, small_trainer

LR = 1e-3


def lrs(overrides: list[str], steps: int) -> list[float]:
    """The learning rate of each of `steps` steps, as the Trainer reads it before the step."""
    cfg = compose_config(["optim.lr=1e-3", *overrides])
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.optim.lr)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.trainer.max_steps)
    found = []
    for _ in range(steps):
        found.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return found


def test_each_schedule_gives_its_learning_rate_at_chosen_steps():
    common = ["optim.warmup_steps=4", "trainer.max_steps=20", "optim.min_lr_ratio=0.1"]
    cosine = lrs(common, 20)
    assert cosine[:4] == pytest.approx([LR / 4, LR / 2, 3 * LR / 4, LR], rel=1e-12)  # the warmup: (step + 1) / 4
    assert cosine[12] == pytest.approx(LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 8 / 16))), rel=1e-12)
    assert cosine[12] == pytest.approx(0.55 * LR, rel=1e-12)  # halfway through the decay: halfway to the floor
    constant = lrs([*common, "optim.schedule=constant"], 20)
    assert constant[:4] == cosine[:4] and constant[4:] == [LR] * 16
    for shape, at_half in (("linear", 0.5), ("sqrt", 1 - math.sqrt(0.5)), ("cosine", 0.5)):
        cooled = lrs([*common, "optim.schedule=const_cooldown", "optim.cooldown_steps=8",
                      f"optim.cooldown_shape={shape}"], 20)
        assert cooled[:12] == constant[:12], shape  # warmup, then constant up to max_steps - cooldown_steps
        assert cooled[12] == pytest.approx(LR, rel=1e-12), shape  # the cooldown's first step: progress 0
        assert cooled[16] == pytest.approx(LR * (0.1 + 0.9 * at_half), rel=1e-12), shape  # progress 4/8
        assert all(a > b for a, b in zip(cooled[12:], cooled[13:])), shape
        assert cooled[19] > 0.1 * LR
    # 1 - sqrt drops fastest at the start of the cooldown, linear evenly.
    sqrt = lrs([*common, "optim.schedule=const_cooldown", "optim.cooldown_steps=8", "optim.cooldown_shape=sqrt"], 20)
    assert sqrt[13] == pytest.approx(LR * (0.1 + 0.9 * (1 - math.sqrt(1 / 8))), rel=1e-12)


def test_preflight_names_a_cooldown_that_does_not_fit():
    cfg = compose_config(["optim.schedule=const_cooldown", "trainer.max_steps=100", "optim.warmup_steps=10"])
    problems = range_problems(cfg)
    assert len(problems) == 1 and "optim.schedule=const_cooldown, optim.cooldown_steps=0" in problems[0]
    assert "needs optim.cooldown_steps from 1 to trainer.max_steps - optim.warmup_steps" in problems[0]
    too_long = compose_config(["optim.schedule=const_cooldown", "trainer.max_steps=100", "optim.warmup_steps=10",
                               "optim.cooldown_steps=91"])
    assert len(range_problems(too_long)) == 1
    fits = compose_config(["optim.schedule=const_cooldown", "trainer.max_steps=100", "optim.warmup_steps=10",
                           "optim.cooldown_steps=90"])
    assert range_problems(fits) == []
    assert "optim.cooldown_steps=-1 is out of range" in range_problems(compose_config(["optim.cooldown_steps=-1"]))[0]


def resumed_note(schedule: str, max_steps: int, step: int) -> str:
    """The log line of a checkpoint of `step` (of a 10-step run, cooldown 4) resumed with `max_steps`."""
    saved_cfg = compose_config([f"optim.schedule={schedule}", "trainer.max_steps=10", "optim.cooldown_steps=4",
                                "optim.warmup_steps=2"])
    cfg = compose_config([f"optim.schedule={schedule}", f"trainer.max_steps={max_steps}", "optim.cooldown_steps=4",
                          "optim.warmup_steps=2"])

    def schedule_of(config):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=config.optim.lr)
        return ResumedSchedule(build_scheduler(optimizer, config.optim, config.trainer.max_steps), config)

    saved = schedule_of(saved_cfg)
    for _ in range(step):
        saved.scheduler.optimizer.step()
        saved.scheduler.step()
    resumed = schedule_of(cfg)
    resumed.load_state_dict(saved.state_dict())
    return resume_summary(SimpleNamespace(changes=[]), resumed, step)  # the optimizer unchanged


def test_the_resume_line_says_what_a_longer_run_does_to_each_schedule():
    assert resumed_note("cosine", 20, 5).endswith(
        "trainer.max_steps 10 -> 20: the schedule follows them from step 5 (the cosine is re-stretched over the new "
        "trainer.max_steps: the lr moves to the new curve's)")
    assert resumed_note("constant", 20, 5).endswith("(the constant lr goes on)")
    assert resumed_note("const_cooldown", 20, 5).endswith("(the cooldown moves to the new end)")
    assert resumed_note("const_cooldown", 20, 8).endswith(
        "(the cooldown moves to the new end; the checkpoint was already 2 steps into the old cooldown, so the lr "
        "goes back up to the constant value)")


def test_a_const_cooldown_run_extended_on_resume_moves_its_cooldown_to_the_new_end(shapes, tmp_path, caplog):
    run_dir = tmp_path / "run"
    common = ["optim.schedule=const_cooldown", "optim.cooldown_steps=3", "optim.warmup_steps=2", "optim.lr=1e-3",
              "trainer.ckpt_every=4", "eval.every=0"]
    small_trainer(shapes, run_dir, *common, "trainer.max_steps=8", "trainer.stop_at_step=4").fit()
    with caplog.at_level(logging.WARNING, logger="src.trainer.trainer"):
        small_trainer(shapes, run_dir, *common, "trainer.max_steps=12", "trainer.resume=latest").fit()
    assert "trainer.max_steps 8 -> 12: the schedule follows them from step 4 (the cooldown moves to the new end)" \
        in caplog.text
    with open(run_dir / "metrics.jsonl") as f:
        lr = {m["step"]: m["train/lr"] for m in map(json.loads, f) if "train/lr" in m}
    assert sorted(lr) == list(range(12))
    assert [lr[s] for s in range(4)] == pytest.approx([5e-4, 1e-3, 1e-3, 1e-3], rel=1e-12)
    # Constant up to the new cooldown's start at step 9 (the old run's was at 5), then a third lower each step.
    assert [lr[s] for s in range(4, 12)] == pytest.approx([1e-3] * 5 + [1e-3, 1e-3 * 2 / 3, 1e-3 / 3], rel=1e-12)
