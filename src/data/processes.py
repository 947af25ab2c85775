"""The processes the loader starts, and how each ends together with the process that started it: DataLoader workers
and the commands of `pipe:` shard URLs.

A trainer killed by SIGKILL or the out-of-memory killer runs no clean-up, so nothing here relies on one. Workers ask
the kernel for a SIGKILL when their trainer dies (Linux's PR_SET_PDEATHSIG) and also watch their parent id, and a
`pipe:` command runs in a process group of its own under a shell that kills that whole group when its worker dies.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator

import torch.multiprocessing

STOP_SIGNALS = {signal.SIGTERM, signal.SIGUSR1}
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_LIBC = ctypes.CDLL(None, use_errno=True)
# Off Linux there is no prctl: workers then rely on the parent check alone.
_PRCTL = getattr(_LIBC, "prctl", None)
SIG_DFL = 0  # <signal.h>
# How often a worker checks that its trainer is still its parent (the fallback to the kernel's death signal).
PARENT_CHECK_S = 1.0
# The command runs in the background of a shell that waits for it. The shell gets SIGHUP when the worker that
# started it dies, however it dies, and then kills the command's whole process group (a pipeline's processes,
# each command of `cmd; exit 1`), itself included. SIGHUP because the stop signals stay blocked (see below).
SUPERVISED_COMMAND = 'trap "kill -KILL 0" HUP; eval "$1" & wait $!'
# A command that has not exited this long after its output was read or closed is killed (its status is unknown).
EXIT_GRACE_S = 5.0


# A worker hands each batch's shared memory to the training process through a Unix socket made under the temporary
# directory (torch's file_descriptor sharing strategy, by multiprocessing's resource sharer:
# TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX). A socket's path holds at most 107 bytes; past it every batch fails to
# send, in a thread of the worker, and the training process waits for it for ever.
SOCKET_PATH_MAX = 107
SOCKET_PATH_UNDER_TEMP = len("/pymp-12345678/listener-12345678")


def check_worker_temp_dir(num_workers: int) -> None:
    """Refuses worker processes whose batches could not reach the training process: a temporary directory too
    long for the socket the batches' shared memory travels through."""
    if not num_workers or torch.multiprocessing.get_sharing_strategy() != "file_descriptor":
        return
    temp = tempfile.gettempdir()
    length, longest = len(os.fsencode(temp)), SOCKET_PATH_MAX - SOCKET_PATH_UNDER_TEMP
    if length > longest:
        raise ValueError(
            f"the temporary directory {temp!r} is {length} bytes long: the loader's worker processes "
            f"pass batches through a Unix socket under it, whose path may be {SOCKET_PATH_MAX} bytes, so the "
            f"directory may be at most {longest}: set TMPDIR to a shorter one (say /tmp), or data.num_workers=0")


def die_with_parent(sig: int) -> None:
    """Ask the kernel to send `sig` to this process when the thread that started it ends (Linux only)."""
    if _PRCTL is not None and _PRCTL(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")


def shield_worker(worker_id: int, trainer: int) -> None:
    """DataLoader `worker_init_fn` (`trainer` is the pid of the process that starts the workers).

    Schedulers signal every process of a job (SLURM; torchrun signals each rank's process group), but only the
    training process may act on SIGTERM / SIGUSR1: it finishes its step and writes a checkpoint, which needs the
    batch its workers are making. So a worker keeps those signals blocked, and leaves only on a SIGTERM from its
    parent (the DataLoader shutting it down), or when its parent is gone: a worker orphaned by a killed trainer
    would otherwise keep its memory and a core for good."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # already blocked when started by start_workers()
    die_with_parent(signal.SIGKILL)
    if os.getppid() != trainer:  # the trainer died before the line above
        os._exit(0)

    def obey_parent_only() -> None:
        while True:
            info = signal.sigtimedwait({signal.SIGTERM}, PARENT_CHECK_S)
            if (info is not None and info.si_pid == trainer) or os.getppid() != trainer:
                os._exit(0)

    threading.Thread(target=obey_parent_only, daemon=True).start()


def worker_start_method() -> str | None:
    """How to start DataLoader workers that begin once training runs: fork (quick; None is DataLoader's default)
    in a process that has not used CUDA, spawn in one that has. A child forked after CUDA started inherits a
    half-copied state of the CUDA driver's threads and the GPU decoder's, and the evaluation's workers, forked
    beside a training run on an H100, died of segmentation faults; spawned ones start afresh."""
    return "spawn" if torch.cuda.is_initialized() else None


@contextlib.contextmanager
def start_workers() -> Iterator[None]:
    """Around iter(DataLoader(...)): the workers start with the stop signals blocked, so that none of them
    reaches a worker before `shield_worker` runs; the training process gets its own once this ends."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def prepare_command(reader: int) -> None:
    """In the forked child, before the shell starts: its own process group (so that ending it ends everything it
    started), the stop signals blocked like its worker's (the command must deliver the batch the trainer's last step
    needs), and SIGHUP when the reader's thread ends."""
    os.setpgid(0, 0)
    signal.pthread_sigmask(signal.SIG_SETMASK, STOP_SIGNALS)
    # A shell cannot trap a signal ignored when it started, and a trainer run under nohup ignores SIGHUP, as its
    # workers then do. libc's signal(), not signal.signal: this may be a worker's reading thread, not its main one.
    _LIBC.signal(signal.SIGHUP, SIG_DFL)
    die_with_parent(signal.SIGHUP)
    if os.getppid() != reader:
        os._exit(1)


def exited(pid: int, timeout: float) -> bool:
    """Whether child `pid` exits within `timeout` seconds; it is left unreaped, so its pid (and process group id)
    cannot be reused meanwhile."""
    deadline = time.monotonic() + timeout
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class CommandStream:
    """The standard output of a `pipe:` URL's shell command, read as a file."""

    def __init__(self, command: str):
        self.command = command
        self.proc = subprocess.Popen(
            ["/bin/sh", "-c", SUPERVISED_COMMAND, "sh", command], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            preexec_fn=functools.partial(prepare_command, os.getpid()),
        )

    def __str__(self) -> str:
        return f"pipe command {self.command!r}"

    def read(self, size: int = -1) -> bytes:
        return self.proc.stdout.read(size)

    def end(self, drain: bool, grace_s: float) -> int | None:
        """Stop reading and end the command's process group; its exit status, or None when it had not exited within
        `grace_s` and was killed. `drain` reads the rest of its output first (a tar's end-of-archive padding), so that
        a command that is done is not cut off mid-write; otherwise a command still writing gets SIGPIPE."""
        if drain:
            while self.proc.stdout.read(1 << 16):
                pass
        self.proc.stdout.close()
        finished = exited(self.proc.pid, grace_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # what is left of the group, or all of it
        status = self.proc.wait()
        return status if finished else None
