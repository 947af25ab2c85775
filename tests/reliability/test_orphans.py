"""Guarantee 10: nothing outlives a killed trainer. A trainer killed by SIGKILL (or the out-of-memory killer, which
sends the same) runs no clean-up; its DataLoader workers and the `pipe:` commands they run must still end by
themselves. Before, orphaned workers (parent 1) kept their memory and a core until someone ran `kill -9`."""

import os
import signal
import time

import pytest

from src.tools.synthetic_shapes import make_synthetic_shapes
from tests.conftest import proc_stat
from tests.reliability.harness import LEDGER, Training, run_args, train_steps_logged

SHARDS, PER_SHARD = 8, 20


def session_processes(session: int) -> dict[int, str]:
    """{pid: command name} of every live process of `session`, from /proc (zombies aside: they hold nothing)."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        stat = proc_stat(int(pid))
        if stat is not None and int(stat[1][3]) == session and stat[1][0] != "Z":  # None: gone meanwhile
            found[int(pid)] = stat[0]
    return found


@pytest.mark.slow
def test_workers_and_pipe_commands_die_with_a_sigkilled_trainer(tmp_path):
    train = str(tmp_path / "train" / f"train-{{000000..{SHARDS - 1:06d}}}.tar")
    held_out = str(tmp_path / "eval" / "eval-{000000..000000}.tar")
    make_synthetic_shapes(train, held_out, train_samples=SHARDS * PER_SHARD, eval_samples=20)
    # Each command sends its shard, then hangs with its output open, as a stalled download does: at the kill, each
    # worker is waiting on a live command that started a child of its own.
    shapes = {"shards": f"pipe:cat {train}; sleep 600", "eval_shards": held_out}
    run_dir = tmp_path / "run"
    args = run_args(shapes, run_dir, "data.allow_pipe=true", "data.num_workers=2", "data.shuffle_buffer=1",
                    "eval.every=0")
    training = Training(args, tmp_path / "log.txt")
    session = training.proc.pid  # the harness starts it in a session of its own
    try:
        training.wait_until(lambda: train_steps_logged(run_dir) >= 1
                            and list(session_processes(session).values()).count("sleep") >= 2)
        before = session_processes(session)
        workers = [pid for pid in before if pid != session and before[pid].startswith(("python", "pt_"))]
        assert len(workers) >= 2 and list(before.values()).count("sleep") >= 2, before

        training.kill(signal.SIGKILL, whole_tree=False)  # the trainer alone, as the OOM killer does
        deadline = time.monotonic() + 10
        while (left := session_processes(session)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, f"left behind by the killed trainer: {left} (of {before})"
    finally:
        for pid in session_processes(session):
            os.kill(pid, signal.SIGKILL)
        training.wait()
    LEDGER.append(("16 trainer SIGKILLed (workers, pipe: commands)", 1, 0, 0))
