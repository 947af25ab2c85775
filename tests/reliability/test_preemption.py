"""Guarantees 3 and 4: SIGTERM / SIGUSR1 stop a run cleanly (the step finishes, a checkpoint is written, exit 0)
within trainer.preempt_deadline_s, and the next start continues exactly; under torchrun, a rank killed outright
makes torchrun restart the group, which resumes, and a signal to one rank stops every rank at the same step."""

import os
import re
import signal
import time

import pytest
import torch

from tests.reliability.harness import (
    LEDGER,
    Training,
    assert_same_metrics,
    latest_step,
    read_metrics,
    run_args,
    torchrun_worker,
    train,
    train_steps_logged,
)

DEADLINE_S = 20


def stop(training: Training, sig: int, *, whole_tree: bool) -> int:
    """Signal, and check the clean stop: exit 0 in time, a checkpoint of the stop step, every step logged."""
    sent = time.monotonic()
    training.kill(sig, whole_tree=whole_tree)
    training.finish()
    assert time.monotonic() - sent < DEADLINE_S
    return int(re.search(rf"stopped at step (\d+) on {signal.Signals(sig).name}", training.output()).group(1))


@pytest.mark.slow
def test_sigterm_and_sigusr1_stop_cleanly_and_the_run_resumes_exactly(shapes, baseline, tmp_path):
    run_dir = tmp_path / "run"
    args = run_args(shapes, run_dir, f"trainer.preempt_deadline_s={DEADLINE_S}")

    # SIGTERM to the training process alone (`kill PID`), mid-run.
    training = Training(args, tmp_path / "1.log")
    training.wait_until(lambda: train_steps_logged(run_dir) >= 5)
    step = stop(training, signal.SIGTERM, whole_tree=False)
    assert latest_step(run_dir) == step == train_steps_logged(run_dir)

    # SIGUSR1 to every process of the run, DataLoader workers included, as SLURM sends it; it arrives during
    # step 8, whose evaluation is deferred to the resumed run.
    training = Training(args, tmp_path / "2.log",
                        env={"STABLECLIP_FAULT_PAUSE": "step@8", "STABLECLIP_FAULT_PAUSE_S": "2"})
    training.wait_for_pause("step@8")
    assert stop(training, signal.SIGUSR1, whole_tree=True) == 8 == latest_step(run_dir)
    assert not [m for m in read_metrics(run_dir) if "eval/i2t_r1" in m]

    # A stop that cannot finish in time (the checkpoint write hangs): the watchdog ends the process at the
    # deadline with 128 + SIGTERM, and the newest complete checkpoint is untouched.
    training = Training(run_args(shapes, run_dir, "trainer.preempt_deadline_s=2"), tmp_path / "3.log",
                        env={"STABLECLIP_FAULT_PAUSE": "save:model@12"})
    training.wait_for_pause("save:model@12")
    sent = time.monotonic()
    training.kill(signal.SIGTERM, whole_tree=False)
    assert training.wait() == 128 + signal.SIGTERM
    assert 2 <= time.monotonic() - sent < 10
    assert "did not stop within trainer.preempt_deadline_s=2" in training.output()
    assert latest_step(run_dir) == 8

    train(args, tmp_path / "4.log")
    assert_same_metrics(baseline, run_dir)
    LEDGER.append(("3 preemption (SIGTERM, SIGUSR1, deadline)", 3, 1, 0))


@pytest.mark.slow
def test_torchrun_restarts_the_group_after_a_rank_dies(shapes, tmp_path):
    run_dir = tmp_path / "run"
    args = run_args(shapes, run_dir, f"trainer.preempt_deadline_s={DEADLINE_S}")
    training = Training(args, tmp_path / "1.log", torchrun=2, max_restarts=1)
    agent = training.proc.pid

    # Rank 1 dies outright after step 5; torchrun restarts both ranks, which resume from step 4.
    training.wait_until(lambda: train_steps_logged(run_dir) >= 6)
    os.kill(torchrun_worker(agent, rank=1, attempt=0), signal.SIGKILL)
    training.wait_until(lambda: torchrun_worker(agent, rank=1, attempt=1) is not None)
    training.wait_until(lambda: "resumed from" in training.output() and train_steps_logged(run_dir) >= 10)

    # SIGTERM to rank 1 of the new group only: both ranks stop after the same step and checkpoint it.
    os.kill(torchrun_worker(agent, rank=1, attempt=1), signal.SIGTERM)
    training.finish()
    step = int(re.search(r"stopped at step (\d+) on a signal to another rank", training.output()).group(1))
    assert latest_step(run_dir) == step
    assert sorted(os.listdir(run_dir / f"checkpoints/step_{step:08d}")) == [
        "manifest.json", "model.pt", "rank_0.pt", "rank_1.pt", "train_state.pt"]

    train(args, tmp_path / "2.log", torchrun=2)
    steps = [m["step"] for m in read_metrics(run_dir) if "train/loss" in m]
    assert steps == list(range(16))  # each step once: none lost, none repeated
    state = torch.load(run_dir / "checkpoints/step_00000016/train_state.pt", weights_only=True)
    assert state["step"] == 16
    LEDGER.append(("4 elastic restart (torchrun)", 2, 1, 0))
