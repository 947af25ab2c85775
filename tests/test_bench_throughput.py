"""The throughput benchmark runs on CPU (tiny model, few steps), so it cannot rot; its figures come from the GPU."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import ROOT, run_with_stacks

from src.data.shards import expand_shards


def test_throughput_bench_smoke_run(tmp_path):
    out = tmp_path / "throughput.json"
    command = [sys.executable, "bench/throughput.py", "--device", "cpu", "--model", "vit_tiny", "--batch", "8",
               "--steps", "2", "--warmup", "1", "--end-to-end", "--samples", "64",
               "--e2e-warmup-seconds", "0", "--e2e-seconds", "0",
               "--shards-dir", str(tmp_path / "shards"), "--json", str(out), "--train-py", "4",
               "--e2e-image-px", "40",
               "--set", "trainer.log_every=1 py:src.kernels.residual_norm.ROWS=16"]
    # Not under tmp_path, whose depth grows with pytest's run count: the loader's workers need a short TMPDIR
    # (src/data/processes.py, check_worker_temp_dir).
    scratch = Path(tempfile.mkdtemp(prefix="tp-"))
    try:
        result = run_with_stacks(command, cwd=ROOT, timeout=300,
                                 env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "TMPDIR": str(scratch)})
        assert result.returncode == 0, result.stderr[-3000:]
        left = [p.name for p in scratch.iterdir() if p.name.startswith(("throughput-", "train-py-"))]
        assert not left  # nothing left behind
    finally:
        shutil.rmtree(scratch)
    *rows, train_py = json.loads(out.read_text())["rows"]
    assert [row["end_to_end"] for row in rows] == [False, True] and rows[1]["shard_px"] == 40
    assert all(row["overrides"] == ["trainer.log_every=1", "py:src.kernels.residual_norm.ROWS=16"] for row in rows)
    # End to end, the window (--steps 2, no time) in as many parts as it has steps, up to three
    assert len(rows[1]["window_parts_samples_per_s"]) == 2
    for row in rows:
        assert row["samples_per_s"] > 0 and row["tflops"] > 0 and row["step_ms"] > 0
        assert row["pipelined_samples_per_s"] == pytest.approx(8e3 / row["pipelined_step_ms"])
        # AdamW's two fp32 moments per parameter (the logit scale's and bias's included), and its step counts.
        assert 2 * 4 * row["params"] <= row["optimizer_state_gib"] * 2**30 <= 2 * 4 * row["params"] + 4096
    # The card's command itself, at its log's rate, beside the best end-to-end configuration of the same run.
    assert train_py["impl"] == "train.py"
    assert train_py["command"].startswith("train.py model=vit_tiny optim=stable_adamw data=laion_wds")
    assert "trainer.compile" not in train_py["command"] and "cuda_graph" not in train_py["command"]
    assert train_py["windows"] == 1
    best = max(rows, key=lambda row: row["samples_per_s"])
    assert train_py["best_end_to_end"] == best["end_to_end"]
    assert train_py["vs_best"] == pytest.approx(train_py["samples_per_s"] / best["samples_per_s"])
    assert train_py["vs_best_end_to_end"] == pytest.approx(train_py["samples_per_s"] / rows[1]["samples_per_s"])
    assert f"data.shards={rows[1]['shards']}" in train_py["command"].split()


def test_end_to_end_reads_given_shards(tmp_path, shapes):
    """--e2e-shards: the loader reads the user's shards (photographs at their own sizes, say), which need no
    sizes.json (--samples is then the epoch's length); nothing is written. Decoded by the training process
    (data.decode_on=device, on a CPU the reference path), the row says how long a batch's decode took."""
    given = tmp_path / "given"
    given.mkdir()
    for url in expand_shards(shapes["shards"]):
        shutil.copy(url, given)
    pattern = str(given / os.path.basename(shapes["shards"]))
    out = tmp_path / "throughput.json"
    command = [sys.executable, "bench/throughput.py", "--device", "cpu", "--model", "vit_tiny", "--batch", "8",
               "--steps", "1", "--warmup", "1", "--end-to-end", "--e2e-shards", pattern, "--samples", "64",
               "--e2e-warmup-seconds", "0", "--e2e-seconds", "0", "--shards-dir", str(tmp_path / "unused"),
               "--json", str(out), "--set", "data.decode_on=device"]
    result = run_with_stacks(command, cwd=ROOT, timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-3000:]
    compute, loaded = json.loads(out.read_text())["rows"]
    assert compute["shards"] is None and loaded["shards"] == pattern and loaded["shard_px"] is None
    assert loaded["samples_per_s"] > 0 and not (tmp_path / "unused").exists()
    # the window's single step (--steps 1) is its one part; compute-only rows have no window
    assert len(loaded["window_parts_samples_per_s"]) == 1 and "window_parts_samples_per_s" not in compute
    assert loaded["window_parts_samples_per_s"][0] >= loaded["samples_per_s"] * (1 - 1e-9)
    assert loaded["decode_ms"] > 0 and "decode_ms" not in compute
    # on a CPU the reference path: no nvImageCodec phases; the phases add up to the whole
    phases = loaded["decode_phase_ms"]
    assert set(phases) == {"split", "decode", "crop", "place"}
    assert sum(phases.values()) == pytest.approx(loaded["decode_ms"])


def test_timing_a_recorded_step_needs_warmup_past_the_capture():
    from src.trainer.cuda_graph import WARMUP_STEPS

    def bench(warmup: int) -> subprocess.CompletedProcess:
        command = [sys.executable, "bench/throughput.py", "--device", "cpu", "--model", "vit_tiny", "--batch", "8",
                   "--steps", "1", "--warmup", str(warmup), "--set", "trainer.cuda_graph=true"]
        return run_with_stacks(command, cwd=ROOT, timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})

    result = bench(WARMUP_STEPS)
    assert result.returncode != 0
    assert f"records its graph at step {WARMUP_STEPS + 1}: pass --warmup {WARMUP_STEPS + 1}" in result.stderr
    # Past the capture the warm-up is accepted; on this CPU the recording itself is then refused.
    result = bench(WARMUP_STEPS + 1)
    assert result.returncode != 0
    assert "--warmup" not in result.stderr and "records CUDA kernels, but the trainer runs on cpu" in result.stderr
    # Ordinary steps take any warm-up: test_throughput_bench_smoke_run times them after --warmup 1.


def test_module_settings_hold_for_one_configuration_and_refuse_typos():
    """`--set "py:MODULE.NAME=VALUE"` (bench/throughput.py, through src.compose): the value holds inside the block
    and the old one is back after it, also when the block fails; a name the module lacks, or a value that is not a
    literal, is refused before the block runs, and the settings already made are put back."""
    from src.compose import module_settings
    from src.kernels import residual_norm
    from src.kernels.attention import short as short_attention

    default_warps, default_stages = residual_norm.WARPS, residual_norm.STAGES
    default_length = short_attention.AUTO_MAX_LENGTH
    with module_settings(["src.kernels.residual_norm.WARPS=2", "src.kernels.attention.short.AUTO_MAX_LENGTH=64"]):
        assert (residual_norm.WARPS, short_attention.AUTO_MAX_LENGTH) == (2, 64)
    assert (residual_norm.WARPS, short_attention.AUTO_MAX_LENGTH) == (default_warps, default_length)
    with pytest.raises(RuntimeError, match="inside"), module_settings(["src.kernels.residual_norm.WARPS=2"]):
        raise RuntimeError("inside")
    assert residual_norm.WARPS == default_warps
    with pytest.raises(ValueError, match="src.kernels.residual_norm has no 'WARP'"):
        with module_settings(["src.kernels.residual_norm.STAGES=1", "src.kernels.residual_norm.WARP=2"]):
            pass
    assert residual_norm.STAGES == default_stages  # the first assignment was put back
    with pytest.raises(ValueError, match="'eight' is not a Python literal"):
        with module_settings(["src.kernels.residual_norm.WARPS=eight"]):
            pass
    with pytest.raises(ValueError, match="is not MODULE.NAME=VALUE"):
        with module_settings(["WARPS=2"]):
            pass


def test_kernel_table_sums_gpu_kernels_per_step_and_their_change(tmp_path):
    """bench/kernel_table.py on two traces shaped like the profiler's: CPU events are left out, kernel
    durations (µs) are summed per name over the three profiled steps."""
    for name, attention_us in (("first", 3000), ("second", 1500)):
        events = [{"ph": "X", "cat": "kernel", "name": "attention", "dur": attention_us},
                  {"ph": "X", "cat": "kernel", "name": "gelu", "dur": 150},
                  {"ph": "X", "cat": "kernel", "name": "gelu", "dur": 150},
                  {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 10 ** 9}]
        (tmp_path / f"{name}.json").write_text(json.dumps({"traceEvents": events}))
    result = subprocess.run([sys.executable, "bench/kernel_table.py", str(tmp_path / "first.json"),
                             str(tmp_path / "second.json")], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].endswith("first.json: GPU busy 1.1 ms per step")
    assert lines[1].split() == ["1.00", "attention"] and lines[2].split() == ["0.10", "gelu"]
    assert "aten::mm" not in result.stdout
    differences = lines[lines.index("largest differences, first minus second, ms per step") + 1:]
    assert differences[0].split() == ["+0.50", "attention"]


def test_kernel_table_groups_kernels_by_kind(tmp_path):
    """--groups sums the per-step time of each kind of kernel, by the names CUDA libraries and Inductor use."""
    names_us = {"_tiled_grad_key_kernel": 900, "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT": 1800,
                "triton_red_fused_native_layer_norm_1": 300, "triton_poi_fused_gelu_3": 600,
                "void at::native::multi_tensor_apply_kernel<": 1500, "Memcpy DtoD": 600, "mystery": 300,
                "_quantize_rows_kernel": 600, "_short_attention_backward_kernel": 300,
                "_residual_norm_backward_kernel": 300}
    events = [{"ph": "X", "cat": "kernel", "name": name, "dur": us} for name, us in names_us.items()]
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": events}))
    result = subprocess.run([sys.executable, "bench/kernel_table.py", str(tmp_path / "trace.json"), "--groups"],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    groups = {line.split("%", 1)[1].strip(): float(line.split()[0]) for line in result.stdout.splitlines()
              if "%" in line}
    assert groups == {"matmul": 0.6, "attention": 0.4, "residual + LayerNorm (our kernels)": 0.1,
                      "Inductor element-wise (GELU, residual, casts)": 0.2,
                      "Inductor reductions (LayerNorm, sums)": 0.1, "optimizer and RMS (multi-tensor)": 0.5,
                      "copies and fills": 0.2, "other": 0.1,
                      "SwitchBack quantization": 0.2}


def test_kernel_table_names_the_cpu_ops_that_launched_a_kernel(tmp_path):
    """--callers: a kernel is matched to its launch by correlation id, and the launch to the two innermost CPU
    ops running on its thread at that time (not a sibling op that had already ended)."""
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "stableclip::residual_norm_backward", "pid": 1, "tid": 7, "ts": 100,
         "dur": 50},
        {"ph": "X", "cat": "cpu_op", "name": "aten::empty", "pid": 1, "tid": 7, "ts": 101, "dur": 2},
        {"ph": "X", "cat": "cpu_op", "name": "aten::sum", "pid": 1, "tid": 7, "ts": 110, "dur": 20},
        {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "pid": 1, "tid": 7, "ts": 200, "dur": 20},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 7, "ts": 115, "dur": 3,
         "args": {"correlation": 5}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 7, "ts": 205, "dur": 3,
         "args": {"correlation": 6}},
        {"ph": "X", "cat": "kernel", "name": "reduce_kernel", "pid": 0, "tid": 9, "ts": 300, "dur": 600,
         "args": {"correlation": 5}},
        {"ph": "X", "cat": "kernel", "name": "direct_copy_kernel", "pid": 0, "tid": 9, "ts": 900, "dur": 300,
         "args": {"correlation": 6}},
        {"ph": "X", "cat": "kernel", "name": "gelu", "pid": 0, "tid": 9, "ts": 1200, "dur": 300,
         "args": {"correlation": 8}},
    ]
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": events}))
    result = subprocess.run([sys.executable, "bench/kernel_table.py", str(tmp_path / "trace.json"), "--callers",
                             "reduce|copy"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    callers = result.stdout.split("by the CPU ops that launched them (inner < outer)\n")[1].splitlines()
    assert [line.split(None, 1) for line in callers] == [
        ["0.20", "reduce_kernel  <-  aten::sum < stableclip::residual_norm_backward"],
        ["0.10", "direct_copy_kernel  <-  aten::copy_"]]
    events[2]["args"] = {"Input Dims": [[4, 8], []]}
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": events}))
    result = subprocess.run([sys.executable, "bench/kernel_table.py", str(tmp_path / "trace.json"), "--callers",
                             "reduce", "--shapes"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "reduce_kernel  <-  aten::sum [[4, 8], []] < stableclip::residual_norm_backward\n" in result.stdout


def test_kernel_table_lists_each_threads_cuda_calls(tmp_path):
    """--threads: each host thread's CUDA calls by name, counted and timed per profiled step (three), the busiest
    thread first, with the span from its first call to its last; kernels and CPU ops are not calls."""
    def call(tid, name, ts, dur):
        return {"ph": "X", "cat": "cuda_runtime", "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}

    events = [call(7, "cudaGraphLaunch", 0, 300), call(7, "cudaDeviceSynchronize", 400, 2700),
              {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 9, "ts": 500, "dur": 9000},
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 8, "ts": 0, "dur": 9000}]
    events += [call(8, name, 1000 + 100 * i, dur) for i in range(6)
               for name, dur in (("cudaMemcpyAsync", 20), ("cudaEventSynchronize", 50))]
    events.append({"ph": "X", "cat": "cuda_driver", "name": "cuLaunchKernelEx", "pid": 1, "tid": 8, "ts": 1600,
                   "dur": 60})
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": events}))
    result = subprocess.run([sys.executable, "bench/kernel_table.py", str(tmp_path / "trace.json"), "--threads"],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    first = lines.index("thread 7: CUDA calls over 3.1 ms, per step: 1 calls, 1.0 ms in them")
    assert [line.split() for line in lines[first + 1:first + 3]] == [
        ["0.3", "x", "0.90", "ms", "cudaDeviceSynchronize"], ["0.3", "x", "0.10", "ms", "cudaGraphLaunch"]]
    second = lines.index("thread 8: CUDA calls over 0.7 ms, per step: 4 calls, 0.2 ms in them")
    assert [line.split() for line in lines[second + 1:second + 4]] == [
        ["2.0", "x", "0.10", "ms", "cudaEventSynchronize"], ["2.0", "x", "0.04", "ms", "cudaMemcpyAsync"],
        ["0.3", "x", "0.02", "ms", "cuLaunchKernelEx"]]
    assert first < second and "gemm" not in "".join(lines[first:]) and "aten::mm" not in result.stdout


def test_kernel_resources_counts_gelu_instructions_without_a_gpu():
    """bench/kernel_resources.py --gelu compiles GELU's forms for sm_90 on this CPU and counts their SASS
    instructions: the exact GELU's erf costs far more than the bytes it moves (h·h), the tanh form in between,
    and the rational fit of model.gelu less than CUDA's erf."""
    pytest.importorskip("triton")
    result = subprocess.run([sys.executable, "bench/kernel_resources.py", "--gelu"], cwd=ROOT, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {(row["form"], row["kernel"]): row["sass_per_element"]
            for row in map(json.loads, result.stdout.splitlines())}
    assert set(rows) == {(form, kernel) for form in ("erf", "rational", "rational_expf", "erfc_fit", "tanh", "square")
                         for kernel in ("forward", "backward")}
    for kernel in ("forward", "backward"):
        assert 0 < rows["square", kernel] < rows["tanh", kernel] < rows["erf", kernel]
        assert rows["rational", kernel] < rows["erf", kernel]  # model.gelu=rational's fit: fewer than CUDA's erf
        assert rows["rational", kernel] < rows["rational_expf", kernel]  # libdevice's exp2f is cheaper than expf


def test_kernel_table_finds_where_the_gpu_waited(tmp_path):
    """--gaps: idle time between GPU events (overlapping events count once), the longest stretches first, each
    with the event before it and the CPU op that launched the event after it."""
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 7, "ts": 400, "dur": 50},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 7, "ts": 410, "dur": 3,
         "args": {"correlation": 5}},
        {"ph": "X", "cat": "kernel", "name": "first", "pid": 0, "tid": 9, "ts": 0, "dur": 300},
        {"ph": "X", "cat": "gpu_memset", "name": "Memset", "pid": 0, "tid": 9, "ts": 100, "dur": 250},
        {"ph": "X", "cat": "kernel", "name": "second", "pid": 0, "tid": 9, "ts": 360, "dur": 100},
        {"ph": "X", "cat": "kernel", "name": "third", "pid": 0, "tid": 9, "ts": 3460, "dur": 40,
         "args": {"correlation": 5}},
        {"ph": "X", "cat": "kernel", "name": "beside third", "pid": 0, "tid": 10, "ts": 3460, "dur": 40},
    ]
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": events}))
    result = subprocess.run([sys.executable, "bench/kernel_table.py", str(tmp_path / "trace.json"), "--gaps"],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    # Idle: 350 -> 360 (the memset outlasts "first") and 460 -> 3460; the span is 0 -> 3500 µs, over 3 steps.
    summary = "GPU span 1.2 ms per step, idle 1.0 ms per step: 0.7 gaps, 0.3 of them 20 µs or longer (1.0 ms)"
    assert summary in result.stdout
    assert "3000 µs after second  before third  <-  aten::mm\n" in result.stdout
