"""Guarantee 8: a checkpoint write that fails because the disk is full removes its partial directory, prunes nothing,
leaves the previous checkpoint intact and stops with a message saying what to do; the run then resumes from that
checkpoint and logs exactly the metrics of an uninterrupted run.

Two real ways to fill the disk, one after the other on the same run, each where the machine allows it:
- ENOSPC: the checkpoints directory of the failing run is a 100 MiB tmpfs (in a user and mount namespace of its
  own, `unshare`, so no root is needed and nothing leaks), already holding the 65 MB step-4 checkpoint: the kernel
  answers the step-8 write with ENOSPC.
- EFBIG: the failing run has RLIMIT_FSIZE = 30 MB (`prlimit`): the kernel answers the write of the 43 MB
  train_state.pt with EFBIG (Python ignores SIGXFSZ), which is how a file-size or quota limit shows.
"""

import os
import shutil
import subprocess

import pytest

from tests.reliability.harness import LEDGER, Training, assert_same_metrics, latest_step, run_args, train

# In namespaces of its own: a tmpfs over the checkpoints directory, holding a copy of what was there; after the
# run, what the tmpfs holds is copied to $3, outside it.
TMPFS = """set -e
scratch=$1 checkpoints=$2 after=$3; shift 3
mount -t tmpfs -o size=100m tmpfs "$scratch"
cp -a "$checkpoints/." "$scratch/"
mount --bind "$scratch" "$checkpoints"
set +e; "$@"; code=$?
cp -a "$checkpoints" "$after"; exit $code"""


def disk_limits(tmp_path, checkpoints) -> dict[str, list[str]]:
    """Command prefixes that run train.py with a filled disk, by the errno they cause; those this machine allows."""
    limits = {}
    namespaces = ["unshare", "--user", "--map-root-user", "--mount"]
    if shutil.which("unshare") and subprocess.run(
        [*namespaces, "sh", "-c", "mount -t tmpfs tmpfs /mnt"], capture_output=True
    ).returncode == 0:
        (tmp_path / "scratch").mkdir()
        (tmp_path / "copy").mkdir()
        limits["ENOSPC"] = [*namespaces, "sh", "-c", TMPFS, "sh",
                            str(tmp_path / "scratch"), str(checkpoints), str(tmp_path / "copy" / "checkpoints")]
    if shutil.which("prlimit"):
        limits["EFBIG"] = ["prlimit", f"--fsize={30_000_000}", "--"]
    return limits


@pytest.mark.slow
def test_full_disk_during_a_checkpoint_write(shapes, baseline, tmp_path):
    run_dir = tmp_path / "run"
    checkpoints = run_dir / "checkpoints"
    limits = disk_limits(tmp_path, checkpoints)
    if not limits:
        pytest.skip("neither unshare (with user namespaces) nor prlimit is available to fill a disk")
    args = run_args(shapes, run_dir)
    train([*args, "trainer.stop_at_step=4"], tmp_path / "1.log")

    for errno_name, wrapper in limits.items():
        failing = Training(args, tmp_path / f"{errno_name}.log", wrapper=wrapper)
        assert failing.wait() == 1
        output = failing.output()
        assert f"could not write checkpoint {checkpoints}/step_00000008.tmp: [Errno" in output
        assert {"ENOSPC": "No space left on device", "EFBIG": "File too large"}[errno_name] in output
        assert f"the previous checkpoint {checkpoints}/step_00000004 is intact" in output
        assert "The disk is full" in output and "trainer.keep_last_k" in output
        # What the failing run left (for the tmpfs, a copy: it ended with the run): step 4 alone, loadable.
        left = tmp_path / "copy" if errno_name == "ENOSPC" else run_dir
        assert os.listdir(left / "checkpoints") == ["step_00000004"]
        assert latest_step(left) == 4

    train(args, tmp_path / "last.log")
    assert_same_metrics(baseline, run_dir)
    LEDGER.append((f"8 disk full ({', '.join(limits)})", len(limits), 1, 0))
