import json
import math
import os
import shutil

import pytest
import torch

from src.trainer.run import last_evaluation
from tests.conftest import data_overrides, run_train


def read_metrics(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def train_lines(run_dir) -> dict[int, dict]:
    return {m["step"]: m for m in read_metrics(run_dir) if "train/loss" in m}


def tiny_run(shapes, run_dir, *extra: str) -> list[str]:
    return [
        "experiment=quickstart", *data_overrides(shapes), f"trainer.run_dir={run_dir}", "trainer.progress=false",
        "data.batch_size=32", "data.num_workers=2", "trainer.log_every=4", "optim.warmup_steps=5", *extra,
    ]


def test_quickstart_pipeline_writes_run_directory(shapes, tmp_path):
    run_dir = tmp_path / "run"
    run_train(tiny_run(shapes, run_dir, "trainer.max_steps=12", "eval.every=6", "trainer.ckpt_every=6",
                       "trainer.keep_last_k=1"))
    assert (run_dir / "config.yaml").is_file() and (run_dir / "train.log").is_file()
    lines = train_lines(run_dir)
    assert sorted(lines) == list(range(12))
    for key in ("train/loss", "train/lr", "train/samples_per_s", "train/grad_norm"):
        assert all(isinstance(m[key], float) for m in lines.values()), key
    evals = [m for m in read_metrics(run_dir) if "eval/zeroshot_top1" in m]
    assert [m["step"] for m in evals] == [6, 12]
    assert all(0 <= m["eval/zeroshot_top1"] <= 1 and "eval/i2t_r5" in m and "eval/t2i_r1" in m for m in evals)
    assert os.listdir(run_dir / "checkpoints") == ["step_00000012"]  # keep_last_k=1 pruned step 6
    state = torch.load(run_dir / "checkpoints/step_00000012/train_state.pt", weights_only=True)
    assert state["step"] == 12


def test_resume_gives_the_same_metrics_as_an_uninterrupted_run(shapes, tmp_path):
    common = ["trainer.max_steps=16", "trainer.ckpt_every=7", "eval.every=8",
              "model.vision.patch_dropout=0.25", "data.crop_scale_min=0.5"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_train(tiny_run(shapes, straight, *common))
    # Stop at step 10 (the last checkpoint is step 7), then continue to 16 from that checkpoint.
    run_train(tiny_run(shapes, resumed, *common, "trainer.stop_at_step=10"))
    # As if it had crashed after step 10 before saving: steps 7..9 are logged twice, kept once.
    shutil.rmtree(resumed / "checkpoints/step_00000010")
    run_train(tiny_run(shapes, resumed, *common, "trainer.resume=latest"))
    want, got = read_metrics(straight), read_metrics(resumed)
    assert [m["step"] for m in got] == [m["step"] for m in want]
    for a, b in zip(want, got):
        assert a.keys() == b.keys()
        for key in a:
            if key != "train/samples_per_s":
                assert a[key] == b[key], (a["step"], key)


def test_resume_from_explicit_path_and_missing_checkpoint(shapes, tmp_path):
    with pytest.raises(AssertionError, match="is not a checkpoint directory"):
        run_train(tiny_run(shapes, tmp_path / "x", "trainer.max_steps=2", f"trainer.resume={tmp_path}"))
    # latest with no checkpoint yet starts from scratch
    run_train(tiny_run(shapes, tmp_path / "fresh", "trainer.max_steps=2", "trainer.resume=latest"))
    assert sorted(train_lines(tmp_path / "fresh")) == [0, 1]


def test_fp16_fixed_scaler_run_logs_stability_metrics_and_plots(shapes, tmp_path):
    import subprocess
    import sys

    from tests.conftest import ROOT

    run_dir = tmp_path / "fp16"
    run_train(tiny_run(shapes, run_dir, "trainer.max_steps=8", "eval.every=0", "optim=stable_adamw",
                       "precision=fp16", "precision.scaler=fixed", "spikes.ignore_first=0", "spikes.window=4"))
    lines = train_lines(run_dir)
    for key in ("optim/rms/patch_embed", "optim/rms_max", "optim/clipped_frac", "scaler/scale",
                "scaler/skipped_tensors", "train/grad_norm", "spike/loss", "spike/loss_spikes"):
        assert all(key in m for m in lines.values()), key
    assert all(m["scaler/scale"] == 65536.0 for m in lines.values())
    assert (run_dir / "spikes.jsonl").is_file()
    out = subprocess.run([sys.executable, "scripts/plot_run.py", str(run_dir)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    png = (run_dir / "plot.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_wandb_offline_and_tensorboard_at_once_and_spike_events(shapes, tmp_path):
    """logger=[wandb,tensorboard] runs both sinks; TensorBoard holds metrics.jsonl's values under its names."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "wb"
    # A negative factor flags every step once the window is full: a deterministic stand-in for a spike.
    run_train(tiny_run(shapes, run_dir, "trainer.max_steps=6", "eval.every=0", "logger=[wandb,tensorboard]",
                       "spikes.ignore_first=0", "spikes.window=2", "spikes.loss_std_factor=-10"))
    assert list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    events = EventAccumulator(str(run_dir / "tensorboard")).Reload()
    assert {"train/loss", "optim/rms/patch_embed", "spike/loss"} <= set(events.Tags()["scalars"])
    losses = {e.step: e.value for e in events.Scalars("train/loss")}
    assert losses == pytest.approx({step: m["train/loss"] for step, m in train_lines(run_dir).items()}, rel=1e-6)
    assert (run_dir / "wandb_run_id").read_text().strip()
    with open(run_dir / "spikes.jsonl") as f:
        events = [json.loads(line) for line in f]
    assert [e["step"] for e in events if e["type"] == "loss"] == [2]  # consecutive spikes merge into one
    lines = train_lines(run_dir)
    assert [s for s, m in lines.items() if m["spike/loss"]] == [2] and lines[5]["spike/loss_spikes"] == 1


def adam_steps(checkpoint_dir) -> set[int]:
    """Adam's step count of every parameter in a checkpoint's optimizer state."""
    state = torch.load(checkpoint_dir / "train_state.pt", weights_only=True)["optimizer"]["state"]
    return {int(s["step"]) for s in state.values()}


def test_resume_applies_a_changed_learning_rate_and_schedule_from_the_resumed_step(shapes, tmp_path):
    from src.optim.schedule import warmup_cosine

    run_dir = tmp_path / "run"
    common = ["trainer.max_steps=12", "eval.every=0", "trainer.ckpt_every=6"]
    run_train(tiny_run(shapes, run_dir, *common, "trainer.stop_at_step=6"))  # quickstart: lr 2e-3, warmup 5
    before = train_lines(run_dir)
    result = run_train(tiny_run(shapes, run_dir, *common, "trainer.resume=latest", "optim.lr=5e-4",
                                "optim.min_lr_ratio=0.1"))
    lines = train_lines(run_dir)
    assert sorted(lines) == list(range(12))
    assert all(lines[s]["train/lr"] == before[s]["train/lr"] for s in range(6))
    for step in range(6, 12):
        assert lines[step]["train/lr"] == pytest.approx(5e-4 * warmup_cosine(step, 5, 12, 0.1), rel=1e-12), step
    assert ("resumed with changed optimizer settings: optim.lr 0.002 -> 0.0005, optim.min_lr_ratio 0.0 -> 0.1: "
            "the schedule follows them from step 6") in result.stdout + result.stderr
    assert "fresh moments" not in result.stdout + result.stderr
    assert adam_steps(run_dir / "checkpoints/step_00000012") == {12}  # the moments went on


def test_resume_with_another_optimizer_loads_the_weights_and_starts_fresh_moments(shapes, tmp_path):
    run_dir = tmp_path / "run"
    # The gammas at lr, as every other weight (the quickstart's are at 10x), so each moves about lr in one step.
    common = ["trainer.max_steps=10", "eval.every=0", "trainer.ckpt_every=6", "optim.layer_scale_lr_scale=1"]
    run_train(tiny_run(shapes, run_dir, *common, "optim=adamw", "optim.weight_decay=0.1", "trainer.stop_at_step=6"))
    weights = torch.load(run_dir / "checkpoints/step_00000006/model.pt", weights_only=True)
    # optim=stable_adamw brings its own lr (2e-3, as the quickstart's) and betas; weight_decay as quickstart's
    result = run_train(tiny_run(shapes, run_dir, *common, "trainer.resume=latest", "optim=stable_adamw",
                                "optim.weight_decay=0.1", "trainer.stop_at_step=7"))
    assert ("optim.name adamw -> stable_adamw, class AdamW -> StableAdamW: weights loaded, the optimizer starts "
            "with fresh moments") in result.stdout + result.stderr
    assert adam_steps(run_dir / "checkpoints/step_00000007") == {1}  # one step since the resume, not seven
    lines = train_lines(run_dir)
    assert sorted(lines) == list(range(7)) and math.isfinite(lines[6]["train/loss"])
    # Step 6 started from the saved weights: the first step of fresh Adam moves each weight by about lr.
    after = torch.load(run_dir / "checkpoints/step_00000007/model.pt", weights_only=True)
    moved = max((after[k] - weights[k]).abs().max().item() for k in weights if weights[k].is_floating_point())
    assert 0 < moved < 3 * 2e-3
    # And a changed beta alone (the same optimizer class) is another optimizer too.
    result = run_train(tiny_run(shapes, run_dir, *common, "trainer.resume=latest", "optim=stable_adamw",
                                "optim.weight_decay=0.1", "optim.betas=[0.9,0.95]"))
    assert "optim.betas [0.9, 0.99] -> [0.9, 0.95]: weights loaded" in result.stdout + result.stderr
    assert adam_steps(run_dir / "checkpoints/step_00000010") == {3}


def same_length_caption_shard(path) -> None:
    """Synthetic shapes captioned "a <colour> <shape>": every caption is 5 tokens long, as on a first custom
    dataset of templated captions."""
    import io
    import random

    import webdataset as wds

    from src.tools.synthetic_shapes import CLASSES, draw_sample

    path.parent.mkdir(parents=True)
    with wds.TarWriter(str(path)) as sink:
        for index in range(64):
            image, label, _ = draw_sample(random.Random(index), 32)
            buffer = io.BytesIO()
            image.save(buffer, format="JPEG")
            sink.write({"__key__": f"{index:09d}", "jpg": buffer.getvalue(), "txt": f"a {CLASSES[label]}"})


def test_a_run_with_exactly_zero_gradients_stops_and_the_fix_it_names_trains(tmp_path):
    """Zero-init layer-scale and captions of one token length: every embedding of a tower is the same, the
    contrastive gradient is exactly 0 (at batch 2 on the CPU, without even rounding noise) and the run stops
    with the explanation; the near-zero layer-scale init the message suggests trains on the same data."""

    shard = tmp_path / "data" / "train-000000.tar"
    same_length_caption_shard(shard)
    run = ["experiment=quickstart", f"data.shards={shard}", "data.eval_shards=null", "data.generate=false",
           "trainer.progress=false", "data.batch_size=2", "data.num_workers=0", "trainer.log_every=4",
           "optim.warmup_steps=2", "trainer.max_steps=8", "eval.every=0", "trainer.ckpt_every=0"]
    with pytest.raises(AssertionError, match="train/grad_norm was exactly 0 at every step from 0 to 3") as error:
        run_train([*run, f"trainer.run_dir={tmp_path / 'zero'}", "model.ls_init_value=0.0"])
    assert "model.ls_init_value" in str(error.value) and "captions of varied length" in str(error.value)
    assert sorted(train_lines(tmp_path / "zero")) == [0, 1, 2, 3]  # logged, then stopped
    assert all(m["train/grad_norm"] == 0.0 for m in train_lines(tmp_path / "zero").values())

    assert "1e-4" in str(error.value)
    run_train([*run, f"trainer.run_dir={tmp_path / 'near_zero'}", "model.ls_init_value=1e-4"])
    lines = train_lines(tmp_path / "near_zero")
    assert sorted(lines) == list(range(8)) and all(m["train/grad_norm"] > 0 for m in lines.values())


def test_an_evaluation_step_is_checkpointed_first_whatever_ckpt_every_says(shapes, tmp_path):
    """A failure (or a stop past trainer.preempt_deadline_s) inside the evaluation of a step that trainer.ckpt_every
    does not checkpoint loses no training: that step's checkpoint is written first and owes the evaluation."""
    from tests.conftest import small_trainer

    run_dir = tmp_path / "run"
    trainer = small_trainer(shapes, run_dir, "trainer.max_steps=4", "trainer.ckpt_every=0", "eval.every=2",
                            evaluate=True)

    def failing(model, autocast, stop):
        raise RuntimeError("the evaluation failed")

    trainer.parts.evaluate = failing
    with pytest.raises(RuntimeError, match="the evaluation failed"):
        trainer.fit()
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["step_00000002"]
    state = torch.load(run_dir / "checkpoints/step_00000002/train_state.pt", weights_only=True)
    assert state["step"] == 2 and state["eval_pending"]


def test_evaluation_runs_compiled_blocks_eagerly_unless_eval_compile(shapes, tmp_path, monkeypatch):
    """Under trainer.compile the first evaluation would compile every block again for inference (minutes on a GPU
    with a cold cache); by default it runs them eagerly, with the same metrics. Dynamo's graph count is what counts,
    so its eager backend stands in for Inductor."""
    from tests.conftest import small_trainer

    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self: compile_module(self, backend="eager"))
    metrics = {}
    for compile_eval in (False, True):
        run_dir = tmp_path / f"compile-{compile_eval}"
        trainer = small_trainer(shapes, run_dir, "trainer.compile=true", f"eval.compile={compile_eval}",
                                evaluate=True)
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        trainer.run_eval()
        trainer.metrics.close()
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        # The first and the pooled last block of each tower, in inference.
        assert graphs >= 4 if compile_eval else graphs == 0, (compile_eval, graphs)
        metrics[compile_eval] = last_evaluation(str(run_dir))
    assert metrics[False] and metrics[False].keys() == metrics[True].keys()
    for key, value in metrics[False].items():
        assert value == pytest.approx(metrics[True][key], abs=1e-5), key


def test_a_stop_signal_during_an_evaluation_ends_it_and_the_resumed_run_evaluates_first(shapes, tmp_path):
    """One process: SIGTERM arriving during the evaluation of step 2 (not a trainer.ckpt_every step) ends it before
    its next forward, and the run stops with that step's checkpoint, written first, which owes the evaluation. The
    resumed run evaluates step 2 first and finishes."""
    import signal

    from tests.conftest import small_trainer

    run_dir = tmp_path / "run"
    extra = ("trainer.max_steps=4", "trainer.ckpt_every=0", "eval.every=2", "eval.batch_size=32")
    trainer = small_trainer(shapes, run_dir, *extra, evaluate=True)
    evaluate, asked, messages = trainer.parts.evaluate, [], []

    def signalled(model, autocast, stop):
        trainer.preemption.received = signal.SIGTERM  # what the handler records

        def counted() -> bool:
            asked.append(stop())
            return asked[-1]

        return evaluate(model, autocast, counted)

    trainer.parts.evaluate = signalled
    trainer.metrics.message = messages.append
    trainer.fit()
    assert asked == [True] and trainer.model.training  # stopped before the first forward, back in training mode
    assert messages[-1] == ("stopped at step 2 on SIGTERM, in its evaluation, which the resumed run does first; "
                            "continue with trainer.resume=latest")
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["step_00000002"]
    assert torch.load(run_dir / "checkpoints/step_00000002/train_state.pt", weights_only=True)["eval_pending"]
    assert not [m for m in read_metrics(run_dir) if "eval/zeroshot_top1" in m]

    small_trainer(shapes, run_dir, *extra, "trainer.resume=latest", evaluate=True).fit()
    assert [m["step"] for m in read_metrics(run_dir) if "eval/zeroshot_top1" in m] == [2, 4]
    assert [m["step"] for m in read_metrics(run_dir) if "train/loss" in m] == [0, 1, 2, 3]
