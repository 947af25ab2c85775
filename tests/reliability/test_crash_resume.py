"""Guarantees 1 and 2: a run killed with SIGKILL (the whole process tree, as when a node dies) anywhere: mid-step,
mid-evaluation, at any point of a checkpoint write or of a prune, resumes with trainer.resume=latest and logs
exactly the metrics of an uninterrupted run. Each test is one run, killed again and again, then finished. A step's
checkpoint is written before its evaluation, so a kill in the evaluation loses no training."""

import os
import random
import time

import pytest
import torch

from tests.reliability.harness import (
    LEDGER,
    Training,
    assert_same_metrics,
    latest_step,
    run_args,
    train,
    train_steps_logged,
)


def kill(training: Training) -> bool:
    """Whether the process was still there to be killed."""
    killed = training.kill()
    training.wait()
    return killed


@pytest.mark.slow
def test_sigkill_mid_step_mid_evaluation_and_at_a_random_moment(shapes, baseline, tmp_path):
    rng = random.Random(10)
    run_dir, args = tmp_path / "run", run_args(shapes, tmp_path / "run")

    # Mid-step, between checkpoints 4 and 8.
    training = Training(args, tmp_path / "1.log")
    target = rng.randint(5, 7)
    training.wait_until(lambda: train_steps_logged(run_dir) >= target)
    kill(training)
    assert latest_step(run_dir) == 4

    # During the evaluation of step 8: its metrics are logged and its checkpoint, written first, owes the evaluation.
    training = Training(args, tmp_path / "2.log", env={"STABLECLIP_FAULT_PAUSE": "eval@8"})
    training.wait_for_pause("eval@8")
    kill(training)
    assert latest_step(run_dir) == 8
    assert torch.load(run_dir / "checkpoints/step_00000008/train_state.pt", weights_only=True)["eval_pending"]

    # At a random moment of the rest: the resumed evaluation of step 8, a step, a checkpoint write, a prune or the
    # final evaluation.
    training = Training(args, tmp_path / "3.log")
    training.wait_until(lambda: train_steps_logged(run_dir) >= 9)
    time.sleep(rng.uniform(0, 1.0))
    killed = kill(training)
    assert latest_step(run_dir) in (8, 12, 16)
    assert "step 8 eval:" in training.output()  # the resumed run evaluated step 8 first

    train(args, tmp_path / "4.log")
    assert_same_metrics(baseline, run_dir)
    LEDGER.append(("1 exact resume after SIGKILL", 2 + killed, 1, 0))


@pytest.mark.slow
def test_sigkill_at_every_point_of_checkpoint_writing(shapes, baseline, tmp_path):
    """keep_last_k=1: one checkpoint at a time, so pruning too early would leave none."""
    run_dir, args = tmp_path / "run", run_args(shapes, tmp_path / "run")
    checkpoints = run_dir / "checkpoints"
    # (pause point, the checkpoint latest must pick afterwards, what else the directory holds)
    stages = [
        ("save:start@4", None, {"step_00000004.tmp"}),  # empty
        ("save:model@8", 4, {"step_00000004", "step_00000008.tmp"}),  # rank file and model.pt
        ("save:train_state@8", 4, {"step_00000004", "step_00000008.tmp"}),  # every file, not renamed
        ("save:renamed@8", 8, {"step_00000004", "step_00000008"}),  # complete, the old one not yet pruned
        ("prune@12", 12, {"step_00000004.deleting", "step_00000008.deleting", "step_00000012"}),  # half-way
    ]
    for i, (point, latest, contents) in enumerate(stages):
        training = Training(args, tmp_path / f"{i}.log", env={"STABLECLIP_FAULT_PAUSE": point})
        training.wait_for_pause(point)
        kill(training)
        assert set(os.listdir(checkpoints)) == contents, point
        assert latest_step(run_dir) == latest, point

    train(args, tmp_path / "last.log")
    assert os.listdir(checkpoints) == ["step_00000016"]  # what the killed saves and prunes left is gone
    assert_same_metrics(baseline, run_dir)
    LEDGER.append(("2 SIGKILL during checkpoint save", len(stages), 1, 0))
