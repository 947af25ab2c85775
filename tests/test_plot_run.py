import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
from PIL import Image

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "plot_run.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _load_script():
    spec = importlib.util.spec_from_file_location("plot_run", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


plot_run = _load_script()


def write_run(run_dir: Path, optim: str, *, with_scaler: bool = True, n: int = 300) -> Path:
    run_dir.mkdir(parents=True)
    lines = []
    for step in range(0, n, 2):
        if step == 100:
            continue  # a missing line
        row = {
            "step": step,
            "train/loss": 5.0 * math.exp(-step / 150) + (3.0 if step == 200 else 0.0),
            "train/lr": 1e-3 * min(1.0, step / 50),
            "optim/rms/patch_embed": 3.0 if step == 196 else 0.8,
            "optim/rms_max": 1.2,
            "train/grad_norm": 1.0,
        }
        if with_scaler:
            row["scaler/scale"] = 65536.0 / (2 ** (step // 100))
        if step == 150:
            del row["train/lr"]  # any key may be missing
        lines.append(json.dumps(row))
        if step % 100 == 50:
            lines.append(json.dumps({"step": step, "eval/zeroshot_top1": step / n}))
    lines.append(json.dumps({"step": n, "train/loss": math.nan}))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    spikes = [
        {"type": "rms", "step": 196, "rms": 3.0},
        {
            "type": "loss",
            "step": 200,
            "loss": 3.5,
            "mean": 1.3,
            "std": 0.1,
            "nonfinite": False,
            "preceded_by_rms_spike": True,
            "rms_spike_step": 196,
            "lag": 4,
            "largest_rms": {"step": 196, "rms": 3.0, "tensor": "visual.conv1.weight"},
        },
        {
            "type": "loss",
            "step": n,
            "loss": None,
            "mean": 0.7,
            "std": 0.1,
            "nonfinite": True,
            "preceded_by_rms_spike": False,
            "rms_spike_step": None,
            "lag": None,
        },
    ]
    (run_dir / "spikes.jsonl").write_text("".join(json.dumps(e) + "\n" for e in spikes))
    config = f"optim:\n  name: {optim}\n  lr: 0.001\nspikes:\n  rms_threshold: 2.0\n"
    (run_dir / "config.yaml").write_text(config)
    return run_dir


def check_png(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 20_000  # four panels with curves, not a blank canvas
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        return image.size


def test_single_run_writes_png_in_run_dir(tmp_path, capsys):
    run = write_run(tmp_path / "run1", "adamw")
    assert plot_run.main([str(run)]) == 0
    out = run / "plot.png"
    assert capsys.readouterr().out.strip() == str(out)
    width, height = check_png(out)
    assert 800 <= width <= 1500 and 800 <= height <= 1500


def test_two_runs_overlay_with_labels_and_output_override(tmp_path, capsys, monkeypatch):
    a = write_run(tmp_path / "run1", "adamw")
    b = write_run(tmp_path / "run2", "stableadamw", with_scaler=False, n=400)
    out = tmp_path / "plots" / "both.png"
    assert plot_run.main([str(a), str(b), "-o", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    check_png(out)

    monkeypatch.chdir(tmp_path)
    assert plot_run.main([str(a), str(b)]) == 0
    check_png(tmp_path / "runs.png")


def test_run_metadata_from_config(tmp_path):
    run = plot_run.load_run(write_run(tmp_path / "run1", "adamw"))
    assert run.label == "run1 (adamw)"
    assert run.rms_threshold == 2.0
    steps, lrs = run.series("train/lr")
    assert 150 not in steps and 100 not in steps and steps == sorted(steps)
    steps, losses = run.series("train/loss")
    assert steps[-1] == 300 and math.isnan(losses[-1])


def test_later_duplicate_step_wins(tmp_path):
    run_dir = tmp_path / "resumed"
    run_dir.mkdir()
    rows = [{"step": 1, "train/loss": 3.0}, {"step": 2, "train/loss": 9.0}, {"step": 2, "train/loss": 2.0}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = plot_run.load_run(run_dir)
    assert run.label == "resumed"
    assert run.series("train/loss") == ([1, 2], [3.0, 2.0])


def test_absent_metrics_render_no_data(tmp_path):
    run_dir = tmp_path / "evalonly"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 10, "eval/zeroshot_top1": 0.1}) + "\n")
    assert plot_run.main([str(run_dir)]) == 0
    check_png(run_dir / "plot.png")


def test_missing_run_dir_is_a_clear_error(tmp_path, capsys):
    missing = tmp_path / "nope"
    assert plot_run.main([str(missing)]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "does not exist" in err


def test_missing_metrics_file_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert plot_run.main([str(tmp_path / "empty")]) == 2
    assert str(tmp_path / "empty" / "metrics.jsonl") in capsys.readouterr().err


@pytest.mark.parametrize("filename", ["metrics.jsonl", "spikes.jsonl"])
def test_malformed_line_names_file_and_line(tmp_path, capsys, filename):
    run = write_run(tmp_path / "run1", "adamw")
    path = run / filename
    lines = path.read_text().splitlines()
    lines.insert(2, '{"step": 3, "train/loss": ')
    path.write_text("\n".join(lines) + "\n")
    assert plot_run.main([str(run)]) == 2
    assert f"{path}:3:" in capsys.readouterr().err
    assert not (run / "plot.png").exists()


def test_evaluations_get_a_zero_shot_and_a_retrieval_panel(tmp_path):
    """Every evaluation set's top-1 and R@1 (and the EMA's) are found; each panel adds to the figure's height."""
    run_dir = write_run(tmp_path / "run", "adamw")
    with open(run_dir / "metrics.jsonl", "a") as f:
        for step in (100, 200):
            f.write(json.dumps({"step": step, "eval/imagenet/zeroshot_top1": step / 1000, "eval/i2t_r1": 0.3,
                                "eval/t2i_r1": 0.2, "eval_ema/zeroshot_top1": 0.5, "eval/i2t_r5": 0.9}) + "\n")
    runs = [plot_run.load_run(run_dir)]
    assert plot_run.eval_keys(runs) == {
        "zero-shot top-1": ["eval/imagenet/zeroshot_top1", "eval/zeroshot_top1", "eval_ema/zeroshot_top1"],
        "retrieval R@1": ["eval/i2t_r1", "eval/t2i_r1"],
    }
    assert runs[0].series("eval/imagenet/zeroshot_top1") == ([100, 200], [0.1, 0.2])
    plot_run.plot(runs, tmp_path / "with_eval.png")
    no_eval = plot_run.Run("plain", [row for row in runs[0].metrics if not any(k.startswith("eval") for k in row)])
    assert plot_run.eval_keys([no_eval]) == {}
    plot_run.plot([no_eval], tmp_path / "without.png")
    (_, with_height), (_, without_height) = check_png(tmp_path / "with_eval.png"), check_png(tmp_path / "without.png")
    assert with_height - without_height == 500  # two panels of 2.5 inches at 100 dpi


def test_summary_gives_the_runs_figures(tmp_path, capsys):
    run_dir = write_run(tmp_path / "adamw", "adamw")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for row in rows:  # the first half's windows include compilation: slower, left out of the step time
        if "train/loss" in row:
            row["train/samples_per_s"] = 100.0 if row["step"] < 150 else 400.0 + row["step"] % 3
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "config.yaml").write_text((run_dir / "config.yaml").read_text() + "data:\n  batch_size: 2048\n")
    row = plot_run.summary(plot_run.load_run(run_dir))
    losses = [5.0 * math.exp(-s / 150) for s in range(282, 300, 2)]  # the last 10 lines; step 300's NaN left out
    assert row["steps"] == 300 and row["final_loss"] == pytest.approx(sum(losses) / len(losses))
    assert (row["loss_spikes"], row["rms_spikes"], row["preceded"], row["preceded_share"]) == (2, 1, 1, 0.5)
    assert row["zeroshot_top1"] == pytest.approx(250 / 300) and row["zeroshot_step"] == 250
    assert row["samples_per_s"] == 401.0 and row["step_ms"] == pytest.approx(1000 * 2048 / 401.0)
    assert row["largest_rms_tensors"] == "visual.conv1.weight:1"  # the other event names none (an older file)
    assert plot_run.main(["--summary", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "loss_spikes=2" in out and "preceded_share=0.5" in out and not (run_dir / "plot.png").exists()


def test_seeds_group_the_runs_of_one_configuration(tmp_path, capsys):
    """Four runs: two settings of model.linear, two seeds each; the groups' figures are the means over their
    seeds, with their ranges."""
    dirs = []
    for linear, offset in (("standard", 0.0), ("switchback_fp8", 0.5)):
        for seed in (0, 1):
            run_dir = write_run(tmp_path / f"{linear}-{seed}", "stable_adamw")
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            for row in rows:  # losses shifted by the setting and the seed
                if isinstance(row.get("train/loss"), float) and math.isfinite(row["train/loss"]):
                    row["train/loss"] += offset + 0.1 * seed
            (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            config = (run_dir / "config.yaml").read_text()
            (run_dir / "config.yaml").write_text(config + f"model:\n  linear: {linear}\n"
                                                 f"trainer:\n  seed: {seed}\n  run_dir: {run_dir}\n")
            dirs.append(run_dir)
    groups = plot_run.seed_groups([plot_run.load_run(d) for d in dirs])
    assert [(name, len(runs)) for name, runs in groups] == [("model.linear=standard", 2),
                                                            ("model.linear=switchback_fp8", 2)]
    standard = plot_run.seed_summary(*groups[0])
    single = plot_run.summary(plot_run.load_run(dirs[0]))["final_loss"]
    assert standard["runs"] == 2 and standard["seeds"] == "0,1" and standard["zeroshot_steps"] == "250"
    assert standard["final_loss"] == pytest.approx(single + 0.05)
    assert standard["final_loss_range"] == f"{single:.4g}..{single + 0.1:.4g}"
    assert plot_run.seed_summary(*groups[1])["final_loss"] == pytest.approx(single + 0.55)
    assert plot_run.main(["--summary", "--seeds", *map(str, dirs)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 6 and out[4].startswith("group=model.linear=standard  runs=2  seeds=0,1")
    assert plot_run.seed_groups([plot_run.load_run(dirs[0]), plot_run.load_run(dirs[1])])[0][0] == "all"
    with pytest.raises(SystemExit):
        plot_run.main(["--seeds", str(dirs[0])])
