"""The LV-XAttn benchmark's CPU smoke run: two gloo processes under torchrun, tiny sizes."""

import json
import os
import subprocess
import sys

from tests.conftest import ROOT


def test_quick_run_writes_every_impl_and_config(tmp_path):
    out = tmp_path / "lv_xattn.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               os.path.join(ROOT, "bench", "lv_xattn.py"), "--quick", "--out", str(out),
               "--lengths", "given", "exchanged"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "| S_Q | S_KV |" in result.stdout
    report = json.loads(out.read_text())
    assert report["mode"].startswith("gloo") and report["bandwidth_GBps"] > 0
    within = report["within_10pct_S_KV_per_rank"]
    assert set(within) == {"16"} and within["16"] >= 1
    impls = ("local", "lv_xattn", "lv_gather", "lv_allred", "ring")
    assert [(r["S_KV"], r["lengths"], r["impl"]) for r in report["rows"]] == [
        (s, c, i) for s in (64, 256) for c in ("given", "exchanged") for i in impls]
    assert all(r["ms"] > 0 and r["predicted_ms"] > 0 for r in report["rows"])
    lv = [r for r in report["rows"] if r["impl"] in ("lv_xattn", "lv_gather")]
    assert all(r["bytes_forward"] > 0 for r in lv)  # the counters reached the report
    assert all(m["saved_MiB_recompute_on"] < m["saved_MiB_recompute_off"] for m in report["memory"])
