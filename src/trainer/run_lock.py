"""One run per run directory: an advisory lock (flock) on `run.lock` in it, held for the life of the process.

Two runs on one directory destroy each other's work (the second cuts the first's metrics.jsonl back, both write and
rename the same checkpoints), so the second stops at once, naming the directory and the holder. The lock belongs
to the open file: the kernel releases it when the process ends however it ends (SIGKILL, out of memory), so a
crash never leaves a stale lock, and the pid in the file is only there to be reported. Under torchrun rank 0 takes
it for the whole group and tells the other ranks whether it got it."""

from __future__ import annotations

import fcntl
import os
import socket

from src.parallel.distributed import broadcast_object

LOCK_FILE = "run.lock"


class RunDirInUse(RuntimeError):
    """Another process holds the run directory's lock."""


class RunLock:
    """The held lock (`fd` None on ranks other than 0): `close()` releases it, and so does the end of the process."""

    def __init__(self, fd: int | None):
        self.fd = fd
        if fd is not None:
            # Forked children (loader workers) share the open file and with it the lock: each closes its copy, so
            # one that outlives the trainer does not keep the directory locked. (Closing a copy releases nothing.)
            os.register_at_fork(after_in_child=self.close)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def take(run_dir: str) -> int:
    """Lock `run_dir` (made if absent) for this process; the file descriptor that holds the lock."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, LOCK_FILE)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 256, 0).decode("utf-8", "replace").strip() or "a process that has not written its pid"
        os.close(fd)
        raise RunDirInUse(
            f"{run_dir} is in use by another run ({holder}, holding {path}): two runs on one directory overwrite "
            "each other's metrics and checkpoints. Wait for it to end or stop it, or set trainer.run_dir to another "
            "directory"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    return fd


def lock_run_dir(run_dir: str, is_main: bool) -> RunLock:
    """Rank 0 takes the lock; every rank raises RunDirInUse if it could not (collective)."""
    fd, error = None, None
    if is_main:
        try:
            fd = take(run_dir)
        except RunDirInUse as err:
            error = str(err)
    error = broadcast_object(error)
    if error is not None:
        raise RunDirInUse(error)
    return RunLock(fd)
