"""OpenCLIP's own training loop on given webdataset shards, and the rate it reaches: the end-to-end peer.

Runs `python -m open_clip_train.main` (OpenCLIP's loader, model, AMP step and logging, as its users run it) for one
epoch of `--samples` samples on `--shards`, read resampled, and reads the rate from its log: OpenCLIP logs, every
`--log-every` steps, the mean `Batch (t)` (a whole step, loading included) and `Data (t)` (the wait for the batch)
over the steps since its last log line. The rate is the batch over the mean of those means, over every window
after the first (which holds the compilation and the loader's start); `data_share` is the mean `Data (t)` over
the mean `Batch (t)` of the same windows, the share of a step spent waiting for data.

OpenCLIP 3.3's loader needs webdataset 0.2.86; with 1.x its workers fail (`KeyError: 'fname'`). Install it apart
from the project's environment and name the directory: `pip install --no-deps --target DIR webdataset==0.2.86`, then
`--pythonpath DIR`, which goes first on the loop's PYTHONPATH. `open_clip_train.data` also imports pandas.

    python bench/peers/openclip_train_loop.py --shards "shards/{00000..00031}.tar" --samples 49152 \
        --pythonpath .wds-0.2.86 --json loop.json

`bench/throughput.py --end-to-end --openclip-loop SAMPLES` runs it on the end-to-end shards after its own rows.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

# "Train Epoch: 0 [  4096/49152 (8%)] Data (t): 0.212 Batch (t): 0.301, 3402.12/s, 3402.12/s/gpu LR: ..."
LOG_LINE = re.compile(r"Train Epoch: \d+ \[\s*(?P<seen>\d+)/\d+ .*?Data \(t\): (?P<data>[0-9.]+) "
                      r"Batch \(t\): (?P<batch>[0-9.]+),")


def command(shards: str, samples: int, batch: int, model: str, workers: int, log_every: int, device: str,
            logs: str) -> list[str]:
    """OpenCLIP's training command: its recommended bf16 AMP and compiled model on a GPU, fp32 on a CPU; no
    checkpoints, evaluation or zero-shot, so the log's steps are training steps only."""
    on_gpu = device.startswith("cuda")
    return [sys.executable, "-m", "open_clip_train.main", "--train-data", shards, "--dataset-type", "webdataset",
            "--dataset-resampled", "--train-num-samples", str(samples), "--batch-size", str(batch),
            "--model", model, "--workers", str(workers), "--device", device,
            "--precision", "amp_bf16" if on_gpu else "fp32", *(["--torchcompile"] if on_gpu else []),
            "--lr", "5e-4", "--warmup", "10", "--epochs", "1", "--log-every-n-steps", str(log_every),
            "--save-frequency", "0", "--zeroshot-frequency", "0", "--val-frequency", "0",
            "--logs", logs, "--name", "peer"]


def rate_from_log(text: str, batch: int) -> dict:
    """The loop's rate from its log (the module docstring's rule). Raises ValueError when the log holds fewer than
    two windows: the first is never counted."""
    windows = [(float(m["data"]), float(m["batch"])) for m in LOG_LINE.finditer(text)]
    if len(windows) < 2:
        raise ValueError(f"OpenCLIP's log holds {len(windows)} 'Batch (t)' window(s), and the first is not counted: "
                         "run it longer (--samples, --timeout) or log more often (--log-every)")
    counted = windows[1:]
    batch_mean = sum(b for _, b in counted) / len(counted)
    data_mean = sum(d for d, _ in counted) / len(counted)
    return {"samples_per_s": batch / batch_mean, "windows": len(counted), "batch_s": batch_mean,
            "data_share": data_mean / batch_mean, "slowest_window_s": max(b for _, b in counted)}


def relay(stream, lines: list[str]) -> None:
    """Each line of `stream` to `lines` and to stderr, until it ends."""
    for line in stream:
        lines.append(line)
        sys.stderr.write(line)


def run(shards: str, samples: int, batch: int, model: str, workers: int, log_every: int, device: str,
        pythonpath: str | None, timeout: float) -> dict:
    """Runs the loop and returns its rate (`rate_from_log`), its command and its wall time. A loop still running
    after `timeout` seconds is stopped with its loader processes, and its rate read from the windows it logged
    (`stopped: true`). Raises RuntimeError with the log's tail when it fails."""
    with tempfile.TemporaryDirectory(prefix="openclip-loop-") as logs:
        argv = command(shards, samples, batch, model, workers, log_every, device, logs)
        env = dict(os.environ)
        if pythonpath:
            env["PYTHONPATH"] = os.pathsep.join([pythonpath, *filter(None, [env.get("PYTHONPATH")])])
        start = time.perf_counter()
        lines: list[str] = []
        # A session of its own: on timeout the loop goes with its loader workers, nothing is left running.
        with subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) as process:
            # Its log goes on to stderr as it comes, so minutes of a run show their progress.
            reader = threading.Thread(target=relay, args=(process.stdout, lines), daemon=True)
            reader.start()
            try:
                process.wait(timeout=timeout)
                stopped = False
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                stopped = True
            reader.join()
        wall = time.perf_counter() - start
        text = "".join(lines)
    if process.returncode != 0 and not stopped:
        raise RuntimeError(f"open_clip_train.main exited with {process.returncode}:\n{text[-4000:]}")
    try:
        rate = rate_from_log(text, batch)
    except ValueError as err:
        raise RuntimeError(f"{err}; the log's tail:\n{text[-4000:]}") from None
    return {"impl": "open_clip_train.main", "model": model, "batch": batch, "workers": workers,
            "command": " ".join(argv[1:]), "wall_s": wall, "stopped": stopped, **rate}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shards", required=True, help="webdataset shards, brace notation")
    parser.add_argument("--samples", type=int, required=True, help="samples in the one epoch (--train-num-samples)")
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--model", default="ViT-B-32", help="an OpenCLIP model name")
    parser.add_argument("--workers", type=int, default=15, help="loader processes (a 16-core host less one)")
    parser.add_argument("--log-every", type=int, default=4, help="steps a log window spans")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--pythonpath", help="a directory holding webdataset 0.2.86, put first on the loop's "
                                             "PYTHONPATH")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before the loop is stopped")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args()
    result = run(args.shards, args.samples, args.batch, args.model, args.workers, args.log_every, args.device,
                 args.pythonpath, args.timeout)
    print(json.dumps(result), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
