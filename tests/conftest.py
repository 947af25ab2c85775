import os
import signal
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp

from src.compose import CONFIGS, compose_config, compose_unresolved
from src.parallel.distributed import free_port
from src.tools.synthetic_shapes import make_synthetic_shapes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# tests import them from here, beside the fixtures
__all__ = ["CONFIGS", "compose_config", "compose_unresolved", "free_port"]


def _start_autograd_before_any_compile() -> None:
    # Autograd's engine decides at a process's first backward whether to start threads for other devices; a child
    # forked after that cannot run backward ("Unable to handle autograd's threading in combination with fork-based
    # multiprocessing"). Once torch.compile has run, even with backend="eager", that first backward starts them on
    # a machine without a GPU too. One backward here, before any test compiles, keeps fork_ranks' ranks usable
    # whichever tests a worker ran before.
    x = torch.ones(1, requires_grad=True)
    x.sum().backward()


_start_autograd_before_any_compile()


@pytest.fixture(scope="session")
def shapes(tmp_path_factory) -> dict[str, str]:
    """Small synthetic-shapes shards, shared by the whole session: 8 train shards, 2 eval shards."""
    root = tmp_path_factory.mktemp("shapes")
    train = str(root / "train" / "train-{000000..000007}.tar")
    held_out = str(root / "eval" / "eval-{000000..000001}.tar")
    make_synthetic_shapes(train, held_out, train_samples=800, eval_samples=100)
    return {"shards": train, "eval_shards": held_out}


def data_overrides(shapes: dict[str, str]) -> list[str]:
    # Quoted: braces are Hydra override syntax.
    return [f"data.shards='{shapes['shards']}'", f"data.eval_shards='{shapes['eval_shards']}'", "data.generate=false"]


def fork_ranks(worker, *args, world: int) -> None:
    """worker(rank, *args) in `world` processes forked from this one, joined; a rank's exception fails the test.
    Forked, not spawned: a spawned rank spends seconds importing torch and the project again, most of what these
    tests would take."""
    mp.start_processes(_single_threaded, args=(worker, *args), nprocs=world, start_method="fork")


def _single_threaded(rank: int, worker, *args) -> None:
    # The parent's OpenMP threads are not in a forked process: a pool of more than one thread would wait for them.
    torch.set_num_threads(1)
    worker(rank, *args)


def run_with_stacks(command: list[str], *, timeout: float, env: dict[str, str] | None = None,
                    **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(command, capture_output=True, text=True), except that a command still running after
    `timeout` seconds fails the test with every Python stack of its process group: faulthandler (on by
    PYTHONFAULTHANDLER) prints them on the SIGABRT sent to the group, the command's children and loader workers
    included, so a hang that happens only under a loaded CI machine shows where it waited."""
    env = {**(os.environ if env is None else env), "PYTHONFAULTHANDLER": "1"}
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True, **kwargs) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGABRT)
            try:
                stdout, stderr = process.communicate(timeout=30)
            finally:
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGKILL)
            raise AssertionError(f"{' '.join(command)} still ran after {timeout} s; its stacks:\n"
                                 f"{stdout[-3000:]}\n{stderr[-20000:]}") from None
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def run_train(args: list[str], *, torchrun: int = 0, timeout: int = 300) -> subprocess.CompletedProcess:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}"]
    command = (launcher if torchrun else [sys.executable]) + [os.path.join(ROOT, "train.py"), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    result = run_with_stacks(command, cwd=ROOT, env=env, timeout=timeout)
    if result.returncode != 0:
        raise AssertionError(f"{' '.join(command)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result


# A vit_tiny a few units wide, fp32: a step takes milliseconds on a CPU.
SMALL_MODEL = ["model.embed_dim=8", "model.vision.width=8", "model.vision.heads=1", "model.vision.layers=1",
               "model.text.width=8", "model.text.heads=1", "model.text.layers=1"]


def proc_stat(pid: int) -> tuple[str, list[str]] | None:
    """Process `pid`'s command name and the fields of /proc/<pid>/stat after it (state, parent, group, session, ...),
    or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.index("(") + 1 : stat.rindex(")")], stat.rsplit(")", 1)[1].split()


def small_trainer(shapes: dict[str, str], run_dir, *extra: str, evaluate: bool = False):
    """An in-process Trainer of the SMALL_MODEL on `shapes` (batch 8, no loader workers), evaluating the held-out
    shards only with `evaluate`."""
    import torch  # here, not at the top: every test loads conftest, and most never build a Trainer

    from src.parallel.distributed import DistInfo
    from src.trainer.trainer import Trainer

    data = data_overrides(shapes) if evaluate else [
        f"data.shards='{shapes['shards']}'", "data.eval_shards=null", "data.generate=false"]
    cfg = compose_config([
        "experiment=quickstart", *SMALL_MODEL, *data, f"trainer.run_dir={run_dir}", "trainer.progress=false",
        "data.batch_size=8", "data.num_workers=0", "trainer.log_every=1", "optim.warmup_steps=1", "logger=none",
        *extra,
    ])
    run_dir.mkdir(parents=True, exist_ok=True)  # train.py makes it
    return Trainer(cfg, str(run_dir), DistInfo(0, 1, 0, torch.device("cpu")))


FAULT_LEDGER: list[list] = []  # (guarantee, faults injected, runs that went on to finish, samples lost) per row


def pytest_runtest_logreport(report) -> None:
    FAULT_LEDGER.extend(value for name, value in report.user_properties if name == "fault ledger")


def pytest_terminal_summary(terminalreporter) -> None:
    """The fault ledger of tests/reliability, the counts behind docs/reliability.md."""
    if not FAULT_LEDGER:
        return
    terminalreporter.section("fault ledger (docs/reliability.md)")
    terminalreporter.write_line(f"{'guarantee':<48} {'faults':>7} {'survived':>9} {'samples lost':>13}")
    for row in sorted(FAULT_LEDGER):
        terminalreporter.write_line(f"{row[0]:<48} {row[1]:>7} {row[2]:>9} {row[3]:>13}")
    totals = [sum(row[i] for row in FAULT_LEDGER) for i in (1, 2, 3)]
    terminalreporter.write_line(f"{'total':<48} {totals[0]:>7} {totals[1]:>9} {totals[2]:>13}")
