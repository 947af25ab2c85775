"""The GPU presets (experiment=spike_demo_gpu, experiment=switchback_gpu) compose, pass preflight and train a few
steps on a CPU with a tiny model; the comparisons they exist for differ in one key only."""

import json
import math
from dataclasses import asdict

import pytest
import torch

from src.models.clip import build_model
from src.parallel.distributed import DistInfo
from src.trainer.preflight import preflight
from src.trainer.trainer import Trainer
from tests.conftest import SMALL_MODEL, compose_config, data_overrides

CPU = DistInfo(0, 1, 0, torch.device("cpu"))
# Only the sizes change: the presets' optimizer, precision, schedule shape and spike settings stay as they are.
TINY = [*SMALL_MODEL, "model.vision.image_size=32", "model.vision.patch_size=8", "trainer.device=cpu",
        "trainer.compile=false", "data.batch_size=8", "data.num_workers=0", "trainer.max_steps=6",
        "trainer.log_every=1", "optim.warmup_steps=2", "eval.batch_size=50", "logger=none", "trainer.progress=false"]


def without(config: dict, *dotted: str) -> dict:
    for key in dotted:
        *parents, last = key.split(".")
        node = config
        for parent in parents:
            node = node[parent]
        node.pop(last)
    return config


def train_few_steps(overrides: list[str], run_dir) -> list[dict]:
    cfg = compose_config(overrides + [f"trainer.run_dir={run_dir}"])
    run_dir.mkdir(parents=True, exist_ok=True)
    preflight(cfg, CPU, str(run_dir))
    Trainer(cfg, str(run_dir), CPU).fit()
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_spike_demo_gpu_is_the_papers_setting_and_the_same_for_both_optimizers():
    adamw, stable = (compose_config(["experiment=spike_demo_gpu", f"optim={name}"]) for name in
                     ("adamw", "stable_adamw"))
    assert (adamw.model.name, adamw.model.vision.image_size, adamw.precision.dtype) == ("vit_b32", 128, "bf16")
    assert adamw.data.batch_size >= 2048 and adamw.trainer.compile == "auto"
    assert tuple(adamw.optim.betas) == tuple(stable.optim.betas) == (0.9, 0.999)
    # Same lr, schedule, seed and data: the optimizers differ in their name (StableAdamW's update clipping) only.
    # (trainer.run_dir holds the time of composition)
    assert without(asdict(adamw), "optim.name", "trainer.run_dir") == without(asdict(stable), "optim.name",
                                                                              "trainer.run_dir")
    spikes = adamw.spikes
    assert spikes.window <= spikes.ignore_first < adamw.trainer.max_steps / 2


@pytest.mark.parametrize("optim", ["adamw", "stable_adamw"])
def test_spike_demo_gpu_trains_on_a_cpu(shapes, tmp_path, optim):
    overrides = ["experiment=spike_demo_gpu", f"optim={optim}", *data_overrides(shapes), *TINY,
                 "spikes.ignore_first=2", "spikes.window=2", "spikes.loss_std_factor=-1e6"]
    records = train_few_steps(overrides, tmp_path / optim)
    steps = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in steps] == [0, 1, 2, 3, 4, 5]
    assert all(math.isfinite(r["train/loss"]) and r["optim/rms/patch_embed"] > 0 for r in steps)
    # A factor of -1e6 flags every checked step, falling loss or not: the detector runs and writes its events.
    events = [json.loads(line) for line in (tmp_path / optim / "spikes.jsonl").read_text().splitlines()]
    loss_events = [e for e in events if e["type"] == "loss"]
    assert [e["step"] for e in loss_events] == [2]  # steps 2-5: one event, merged
    # The event names the largest update over all tensors in the 1-8 steps before it: steps 0 and 1 here.
    largest = max(steps[:2], key=lambda r: r["optim/rms_max"])
    assert loss_events[0]["largest_rms"]["step"] == largest["step"]
    assert loss_events[0]["largest_rms"]["rms"] == pytest.approx(largest["optim/rms_max"])
    model = build_model(compose_config(overrides + [f"trainer.run_dir={tmp_path / 'names'}"]).model)
    assert loss_events[0]["largest_rms"]["tensor"] in dict(model.named_parameters())
    assert 0 <= records[-1]["eval/zeroshot_top1"] <= 1


def test_switchback_gpu_runs_differ_in_model_linear_only():
    configs = {linear: compose_config(["experiment=switchback_gpu", f"model.linear={linear}"])
               for linear in ("standard", "switchback_int8", "switchback_fp8")}
    standard = configs["standard"]
    assert (standard.model.name, standard.precision.dtype, standard.trainer.compile) == ("vit_b16", "bf16", "auto")
    assert standard.model.vision.image_size < 224 and 256 <= standard.data.batch_size <= 512
    assert standard.data.eval_shards and standard.eval.held_out.zeroshot
    # held-out images enough to know a top-1 near 0.3 within about 0.3 points, under the 0.5-point goal
    assert standard.data.generate_eval_samples >= 20000
    for config in configs.values():
        differing = ("model.linear", "trainer.run_dir")  # the run directory holds the time of composition
        assert without(asdict(config), *differing) == without(asdict(standard), *differing)


def test_switchback_gpu_trains_on_a_cpu(shapes, tmp_path):
    overrides = ["experiment=switchback_gpu", "model.linear=switchback_int8", "model.linear_backend=reference",
                 *data_overrides(shapes), *TINY, "eval.every=3"]
    records = train_few_steps(overrides, tmp_path / "int8")
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    evaluations = [r for r in records if "eval/zeroshot_top1" in r]
    assert [r["step"] for r in evaluations] == [3, 6]
    assert all(0 <= r["eval/zeroshot_top1"] <= 1 for r in evaluations)
