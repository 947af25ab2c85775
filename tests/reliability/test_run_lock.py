"""Guarantee 11: one run per run directory. A second train.py on a directory a run is using stops at once, naming
the directory and the holder's pid, and leaves the first's metrics and checkpoints alone. The lock dies with its
process: after a SIGKILL of the trainer alone (its loader worker left behind, as after an out-of-memory kill) a
new run takes the directory and resumes."""

import multiprocessing
import os
import time

import pytest

from src.trainer.run_lock import RunDirInUse, lock_run_dir
from tests.reliability.harness import LEDGER, Training, read_metrics, run_args, train, train_steps_logged


def test_a_second_run_on_a_busy_run_directory_stops_at_once(shapes, tmp_path):
    run_dir = tmp_path / "run"
    args = run_args(shapes, run_dir, "eval.every=0")
    first = Training(args, tmp_path / "1.log", env={"STABLECLIP_FAULT_PAUSE": "step@6",
                                                    "STABLECLIP_FAULT_PAUSE_S": "300"})
    try:
        first.wait_for_pause("step@6")
        logged = read_metrics(run_dir)
        assert (run_dir / "run.lock").read_text().startswith(f"pid {first.proc.pid} on ")

        started = time.monotonic()
        second = Training(args, tmp_path / "2.log")
        assert second.wait(120) == 1
        out = second.output()
        assert f"{run_dir} is in use by another run (pid {first.proc.pid} on " in out, out[-3000:]
        assert "set trainer.run_dir to another directory" in out
        assert time.monotonic() - started < 60  # at start, before the model, data or checkpoints
        assert read_metrics(run_dir) == logged  # the first run's metrics were not cut back
        assert "checkpoints" in {p.name for p in run_dir.iterdir()} and first.proc.poll() is None

        # The trainer alone dies; its loader worker (which shares the lock's open file) may live on.
        first.kill(whole_tree=False)
        first.proc.wait(30)
        third = train(args, tmp_path / "3.log")
        assert "resumed from" in third.output() and train_steps_logged(run_dir) >= 16
    finally:
        first.wait()  # kills what is left of the first run's process group
    LEDGER.append(("11 second run on one run directory", 2, 1, 0))


def set_then_sleep(event, seconds: float) -> None:
    event.set()
    time.sleep(seconds)


def test_a_forked_child_does_not_keep_the_lock(tmp_path):
    """A loader worker is forked while the trainer holds the lock; it must not hold it once the trainer is gone."""
    lock = lock_run_dir(str(tmp_path), is_main=True)
    context = multiprocessing.get_context("fork")
    running = context.Event()
    child = context.Process(target=set_then_sleep, args=(running, 60))
    child.start()
    # The fork handlers run in the child before its target: once it has set the event, its copy is closed (on a
    # busy machine the parent could otherwise test the lock before the child has run them).
    assert running.wait(30)
    try:
        with pytest.raises(RunDirInUse, match=f"pid {os.getpid()} on "):
            lock_run_dir(str(tmp_path), is_main=True)
        lock.close()  # the trainer's end; the child lives on
        assert child.is_alive()
        lock_run_dir(str(tmp_path), is_main=True).close()
    finally:
        child.kill()
        child.join()
