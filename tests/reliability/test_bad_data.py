"""Guarantee 6, on real files under a real training process: a shard of garbage bytes, a shard deleted and a shard
made unreadable mid-run are skipped, counted and named, and the run finishes; a restart without the deleted shard
fails at once naming it; a whole directory made unreadable mid-run stops the run with a message instead of letting
it spin. Root reads files whatever their permissions, so when the tests run as root the training process runs
without the capabilities that allow it (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH; util-linux's `setpriv`)."""

import os
import re
import shutil
import stat

import pytest

from src.tools.synthetic_shapes import make_synthetic_shapes
from tests.reliability.harness import LEDGER, Training, read_metrics, run_args, train_steps_logged

SHARDS, PER_SHARD = 8, 20
AS_ROOT = os.geteuid() == 0
DROP_FILE_CAPABILITIES = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"] if AS_ROOT else []
pytestmark = pytest.mark.skipif(AS_ROOT and not shutil.which("setpriv"),
                                reason="as root, permissions only hold without CAP_DAC_OVERRIDE: needs setpriv")


@pytest.fixture
def own_shapes(tmp_path) -> tuple[dict[str, str], str]:
    """Shards of this test alone, since it damages them."""
    train = str(tmp_path / "train" / f"train-{{000000..{SHARDS - 1:06d}}}.tar")
    held_out = str(tmp_path / "eval" / "eval-{000000..000000}.tar")
    make_synthetic_shapes(train, held_out, train_samples=SHARDS * PER_SHARD, eval_samples=20)
    return {"shards": train, "eval_shards": held_out}, str(tmp_path)


def shard(root: str, i: int) -> str:
    return os.path.join(root, "train", f"train-{i:06d}.tar")


def bad_data_run(shapes: dict[str, str], root: str, log: str, *extra: str) -> Training:
    run_dir = os.path.join(root, "run")
    args = run_args(shapes, run_dir, "data.shard_retries=0", "eval.every=0", *extra)
    return Training(args, os.path.join(root, log), wrapper=DROP_FILE_CAPABILITIES)


@pytest.mark.slow
def test_garbage_deleted_and_unreadable_shards_are_survived_then_a_restart_fails_clearly(own_shapes):
    shapes, root = own_shapes
    run_dir = os.path.join(root, "run")
    with open(shard(root, 0), "wb") as f:
        f.write(os.urandom(os.path.getsize(shard(root, 1))))
    training = bad_data_run(shapes, root, "1.log", "trainer.max_steps=30")
    training.wait_until(lambda: train_steps_logged(run_dir) >= 3)
    os.remove(shard(root, 1))
    os.chmod(shard(root, 2), 0)
    training.finish()

    last = [m for m in read_metrics(run_dir) if "train/loss" in m][-1]
    assert last["step"] == 29 and last["train/epoch"] >= 2
    garbage, unreadable = last["data/bad/truncated_shard"], last["data/bad/unreadable_shard"]
    assert garbage >= 3 and unreadable >= 2  # the garbage shard every epoch; the other two in each later epoch
    output = training.output()
    assert f"shard {shard(root, 0)} ends early" in output
    assert re.search(rf"skipping shard {shard(root, 1)}: cannot open it .*No such file", output)
    assert re.search(rf"skipping shard {shard(root, 2)}: cannot open it .*Permission denied", output)

    # Local shards must all exist when a run starts: the restart names the one that is gone.
    restart = bad_data_run(shapes, root, "2.log", "trainer.max_steps=40")
    assert restart.wait() == 1
    assert f"1 of {SHARDS} shards do not exist ('{shard(root, 1)}'" in restart.output()
    LEDGER.append(("6 bad shards (garbage, deleted, mode 000)", 3, 1, (garbage + unreadable) * PER_SHARD))


@pytest.mark.slow
def test_failing_pipe_commands_are_retried_counted_and_skipped(own_shapes):
    """`pipe:` sources whose command fails at once (its shard is gone) or midway (`head -c ...; exit 1`) no longer
    kill the run: the first is retried data.shard_retries times and skipped as unreadable_shard, the second
    keeps the samples it gave and counts as truncated_shard, each named in the log, every epoch."""
    shapes, root = own_shapes
    run_dir = os.path.join(root, "run")
    os.remove(shard(root, 1))
    midway = f"pipe:head -c {os.path.getsize(shard(root, 6)) // 2} {shard(root, 6)}; exit 1"
    pipes = {**shapes, "shards": f"pipe:cat {root}/train/train-{{000000..000005}}.tar::{midway}::{shard(root, 7)}"}
    args = run_args(pipes, run_dir, "data.allow_pipe=true", "data.shard_retries=1", "eval.every=0",
                    "trainer.max_steps=30")
    training = Training(args, os.path.join(root, "1.log"))
    training.finish()
    last = [m for m in read_metrics(run_dir) if "train/loss" in m][-1]
    assert last["step"] == 29 and last["train/epoch"] >= 2
    unreadable, truncated = last["data/bad/unreadable_shard"], last["data/bad/truncated_shard"]
    assert unreadable >= 3 and truncated >= 3  # each shard once per epoch
    output = training.output()
    assert re.search(rf"skipping shard pipe:cat {shard(root, 1)}: cannot open it after 2 attempts \(pipe command "
                     rf"'cat {shard(root, 1)}' exited with status 1\)", output)
    given = re.search(rf"shard {re.escape(midway)} ends early after (\d+) samples: .*exited with status 1", output)
    assert given and 0 < int(given[1]) < PER_SHARD
    lost = unreadable * PER_SHARD + truncated * (PER_SHARD - int(given[1]))
    LEDGER.append(("6 failing pipe: commands (at once, midway)", 2, 1, lost))


@pytest.mark.slow
def test_a_directory_made_unreadable_mid_run_stops_the_run_clearly(own_shapes):
    shapes, root = own_shapes
    run_dir = os.path.join(root, "run")
    training = bad_data_run(shapes, root, "1.log", "trainer.max_steps=40", "trainer.ckpt_every=2")
    training.wait_until(lambda: train_steps_logged(run_dir) >= 3)
    os.chmod(os.path.dirname(shard(root, 0)), stat.S_IWUSR)  # no read, no search
    try:
        assert training.wait(timeout=120) == 1
    finally:
        os.chmod(os.path.dirname(shard(root, 0)), 0o755)
    assert "100 shards in a row gave no sample" in training.output()
    assert "Permission denied" in training.output()
    LEDGER.append(("6 shard directory made unreadable", 1, 0, 0))
