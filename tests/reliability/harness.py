"""The fault-injection suite's tools: one run configuration shared by every test, a training process that a
test can signal at chosen moments, metric comparison, and the ledger behind docs/reliability.md's counts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import torch

from src.trainer.checkpoint import newest_intact, read_manifest, step_of
from tests.conftest import ROOT, data_overrides, proc_stat

STEPS, CKPT_EVERY, EVAL_EVERY, BATCH = 16, 4, 8, 16
# (guarantee, faults injected, runs that went on to finish, samples lost): printed at the end of the session.
LEDGER: list[tuple[str, int, int, int]] = []


def run_args(shapes: dict[str, str], run_dir, *extra: str) -> list[str]:
    """A deterministic fp32 CPU run with patch dropout and random crops, so that the RNG and data order both
    matter; `trainer.resume=latest` always, so every invocation of a chain is the same command."""
    return [
        "experiment=quickstart", *data_overrides(shapes), f"trainer.run_dir={run_dir}", "trainer.progress=false",
        f"data.batch_size={BATCH}", "data.num_workers=1", "data.shuffle_buffer=50", "data.crop_scale_min=0.5",
        "model.vision.patch_dropout=0.25", "optim.warmup_steps=5", f"trainer.max_steps={STEPS}",
        f"trainer.ckpt_every={CKPT_EVERY}", f"eval.every={EVAL_EVERY}", "trainer.keep_last_k=1",
        "trainer.log_every=1", "trainer.resume=latest", *extra,
    ]


LAUNCH = os.path.join(ROOT, "tests", "reliability", "launch.py")  # train.py, with the faults `env` asks for


class Training:
    """train.py (or torchrun) in its own session, so that a signal can reach the whole process tree as a
    scheduler's would; output goes to `log_path`. It runs through tests/reliability/launch.py, which injects the
    faults that `env`'s STABLECLIP_FAULT_* variables name (none: train.py as it is)."""

    def __init__(self, args: list[str], log_path, *, torchrun: int = 0, max_restarts: int = 0, env: dict | None = None,
                 wrapper: list[str] = ()):
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}",
                    f"--max-restarts={max_restarts}"]
        self.command = [*wrapper, *(launcher if torchrun else [sys.executable]), LAUNCH, *args]
        self.log_path = log_path
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(self.command, cwd=ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def output(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def wait_until(self, condition: Callable[[], bool], timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if self.proc.poll() is not None:
                raise AssertionError(f"exited ({self.proc.returncode}) too early:\n{self.output()[-4000:]}")
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"fault point not reached in {timeout}s:\n{self.output()[-4000:]}")
            time.sleep(0.02)

    def wait_for_pause(self, point: str) -> None:
        self.wait_until(lambda: f"fault hook: paused at {point}" in self.output())

    def kill(self, sig: int = signal.SIGKILL, whole_tree: bool = True) -> bool:
        """Whole tree: a node dies or a scheduler signals the job; otherwise only the main process. Returns
        whether the process was still running."""
        if self.proc.poll() is not None:
            return False
        if whole_tree:
            os.killpg(self.proc.pid, sig)
        else:
            self.proc.send_signal(sig)
        return True

    def wait(self, timeout: float = 300) -> int:
        """The exit code; whatever is left of the tree is killed (torchrun's workers have sessions of their own)."""
        try:
            return self.proc.wait(timeout)
        finally:
            for group in [*children(self.proc.pid), self.proc.pid]:
                try:
                    os.killpg(group, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def finish(self, timeout: float = 300) -> None:
        code = self.wait(timeout)
        assert code == 0, f"{' '.join(self.command)} exited {code}:\n{self.output()[-5000:]}"


def train(args: list[str], log_path, **kwargs) -> Training:
    """Run to the end; it must succeed."""
    training = Training(args, log_path, **kwargs)
    training.finish()
    return training


def read_metrics(run_dir) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def train_steps_logged(run_dir) -> int:
    return sum("train/loss" in m for m in read_metrics(run_dir))


def assert_same_metrics(want_dir, got_dir) -> None:
    """Every line, training steps and evaluations, equal to the last bit (throughput aside), and in order."""
    want, got = read_metrics(want_dir), read_metrics(got_dir)
    assert [m["step"] for m in got] == [m["step"] for m in want]
    for a, b in zip(want, got):
        a, b = ({k: v for k, v in m.items() if k != "train/samples_per_s"} for m in (a, b))
        assert a == b, (a["step"], {k: (a[k], b.get(k)) for k in a if a[k] != b.get(k)})


def latest_step(run_dir) -> int | None:
    """The step of the checkpoint `trainer.resume=latest` would pick (the newest intact one), after checking that
    every file its manifest lists loads with weights_only=True."""
    newest, _ = newest_intact(os.path.join(run_dir, "checkpoints"), checksums=True)
    if newest is None:
        return None
    for name in read_manifest(newest)["files"]:
        torch.load(os.path.join(newest, name), map_location="cpu", weights_only=True)
    return step_of(newest)


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`, from /proc."""
    found = []
    for child in filter(str.isdigit, os.listdir("/proc")):
        stat = proc_stat(int(child))
        if stat is not None and int(stat[1][1]) == pid:  # None: gone meanwhile
            found.append(int(child))
    return found


def torchrun_worker(agent_pid: int, rank: int, attempt: int) -> int | None:
    """The pid of torchrun's worker process for `rank` in restart `attempt`: a child of the agent whose
    environment has that RANK and TORCHELASTIC_RESTART_COUNT."""
    want = {b"RANK": str(rank).encode(), b"TORCHELASTIC_RESTART_COUNT": str(attempt).encode()}
    for pid in children(agent_pid):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        except OSError:
            continue
        if all(env.get(key) == value for key, value in want.items()):
            return pid
    return None
