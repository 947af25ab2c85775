"""The throughput benchmark runs on CPU (tiny model, few steps), so it cannot rot; its figures come from the GPU."""

import json
import subprocess
import sys

from conftest import ROOT


def test_throughput_bench_smoke_run(tmp_path):
    out = tmp_path / "throughput.json"
    command = [sys.executable, "bench/throughput.py", "--device", "cpu", "--model", "vit_tiny", "--batch", "8",
               "--steps", "2", "--warmup", "1", "--end-to-end", "--samples", "64",
               "--e2e-warmup-seconds", "0", "--e2e-seconds", "0",
               "--shards-dir", str(tmp_path / "shards"), "--json", str(out)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["end_to_end"] for row in rows] == [False, True]
    for row in rows:
        assert row["samples_per_s"] > 0 and row["tflops"] > 0 and row["step_ms"] > 0
