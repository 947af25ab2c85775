"""bench/peers/openclip_train_loop.py, the end-to-end peer: its rate rule on OpenCLIP's log format, and its runs
(alone and from bench/throughput.py) against a stand-in `open_clip_train.main` put first on the loop's PYTHONPATH,
as a directory with webdataset 0.2.86 would be. OpenCLIP's own loop needs webdataset 0.2.86, which the project's
environment cannot hold beside 1.x."""

import importlib.util
import json
import os
import sys
import time

import pytest
from conftest import ROOT, SMALL_MODEL, run_with_stacks

spec = importlib.util.spec_from_file_location("openclip_train_loop",
                                              os.path.join(ROOT, "bench", "peers", "openclip_train_loop.py"))
loop = importlib.util.module_from_spec(spec)
spec.loader.exec_module(loop)


def log_line(seen: int, data: float, batch: float) -> str:
    # open_clip_train/train.py's format (OpenCLIP 3.3), behind its logging prefix
    return (f"2026-12-07,08:00:00 | INFO | Train Epoch: 0 [{seen:>6}/49152 (8%)] Data (t): {data:.3f} "
            f"Batch (t): {batch:.3f}, {1024 / batch:#g}/s, {1024 / batch:#g}/s/gpu LR: 0.000500 Logit Scale: 14.286 "
            "Contrastive_loss: 6.9314 (6.9314)")


def test_the_rate_leaves_out_the_first_window_and_averages_the_windows_means():
    text = "\n".join([log_line(1024, 9.0, 30.0), "INFO | something else", log_line(4096, 0.2, 0.3),
                      log_line(8192, 0.1, 0.5)])
    rate = loop.rate_from_log(text, batch=1024)
    assert rate["windows"] == 2 and rate["batch_s"] == pytest.approx(0.4)
    assert rate["samples_per_s"] == pytest.approx(1024 / 0.4)
    assert rate["data_share"] == pytest.approx(0.15 / 0.4) and rate["slowest_window_s"] == 0.5
    with pytest.raises(ValueError, match=r"1 'Batch \(t\)' window\(s\), and the first is not counted"):
        loop.rate_from_log(log_line(1024, 9.0, 30.0), batch=1024)


def fake_openclip(directory, *, sleep: float = 0.0) -> str:
    """A stand-in open_clip_train.main that records its arguments and logs three windows, then sleeps."""
    package = directory / "open_clip_train"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "main.py").write_text(
        "import json, logging, os, sys, time\n"
        "logging.basicConfig(level=logging.INFO, format='%(asctime)s | %(levelname)s | %(message)s')\n"
        f"json.dump(sys.argv[1:], open({str(directory / 'argv.json')!r}, 'w'))\n"
        f"for line in {[log_line(1024, 5.0, 20.0), log_line(4096, 0.1, 0.25), log_line(8192, 0.1, 0.25)]!r}:\n"
        "    logging.info(line.split(' | INFO | ')[1])\n"
        "sys.stderr.flush()\n"
        f"time.sleep({sleep})\n")
    return str(directory)


def test_the_loop_runs_with_the_given_pythonpath_and_a_late_loop_is_stopped(tmp_path, capsys):
    path = fake_openclip(tmp_path / "fake", sleep=0)
    result = loop.run("shards/{0..3}.tar", 64, 8, "ViT-B-32", 2, 4, "cpu", path, timeout=120)
    assert capsys.readouterr().err.count("Train Epoch") == 3  # its log shown as it runs
    argv = json.loads((tmp_path / "fake" / "argv.json").read_text())
    assert argv[argv.index("--train-data") + 1] == "shards/{0..3}.tar" and "--dataset-resampled" in argv
    assert argv[argv.index("--precision") + 1] == "fp32" and "--torchcompile" not in argv  # on a CPU
    assert result["samples_per_s"] == pytest.approx(8 / 0.25) and result["windows"] == 2 and not result["stopped"]
    on_gpu = loop.command("s.tar", 64, 1024, "ViT-B-32", 15, 4, "cuda", "logs")
    assert on_gpu[on_gpu.index("--precision") + 1] == "amp_bf16" and "--torchcompile" in on_gpu
    # Still running at its time limit: stopped, and its rate read from the windows it logged.
    late = fake_openclip(tmp_path / "late", sleep=60)
    start = time.perf_counter()
    result = loop.run("shards/{0..3}.tar", 64, 8, "ViT-B-32", 2, 4, "cpu", late, timeout=5)
    assert time.perf_counter() - start < 30 and result["stopped"] and result["windows"] == 2


def test_throughput_gives_end_to_end_rates_over_the_loops(tmp_path, shapes):
    out = tmp_path / "throughput.json"
    path = fake_openclip(tmp_path / "fake")
    tiny = " ".join([*SMALL_MODEL, "model.vision.image_size=32", "model.vision.patch_size=8"])
    command = [sys.executable, "bench/throughput.py", "--device", "cpu", "--model", "vit_b32", "--batch", "8",
               "--steps", "1", "--warmup", "1", "--end-to-end", "--e2e-shards", shapes["shards"], "--samples", "64",
               "--e2e-warmup-seconds", "0", "--e2e-seconds", "0", "--json", str(out), "--set", tiny,
               "--openclip-loop", "64", "--openclip-loop-pythonpath", path]
    result = run_with_stacks(command, cwd=ROOT, timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-3000:]
    saved = json.loads(out.read_text())
    compute, loaded = saved["rows"]
    assert saved["openclip_loop"]["samples_per_s"] == pytest.approx(8 / 0.25)
    assert loaded["vs_openclip_loop"] == pytest.approx(loaded["samples_per_s"] / (8 / 0.25))
    assert "vs_openclip_loop" not in compute
    argv = json.loads((tmp_path / "fake" / "argv.json").read_text())
    assert argv[argv.index("--train-data") + 1] == shapes["shards"] and argv[argv.index("--model") + 1] == "ViT-B-32"


def test_throughput_refuses_a_loop_without_end_to_end_or_openclips_model():
    for args, message in ((["--openclip-loop", "64"], "add --end-to-end"),
                          (["--model", "vit_tiny", "--end-to-end", "--openclip-loop", "64"], "does not name")):
        result = run_with_stacks([sys.executable, "bench/throughput.py", "--device", "cpu", *args], cwd=ROOT,
                                 timeout=120)
        assert result.returncode == 2 and message in result.stderr
