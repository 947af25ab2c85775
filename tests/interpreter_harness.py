"""Running Triton kernels on the CPU in CI, through Triton's interpreter.

Triton reads TRITON_INTERPRET when a kernel is defined, i.e. on import, so a kernel test file runs itself
in a subprocess that sets it: its `test_kernels_under_the_interpreter` calls `run_under_interpreter`, and its
tests marked `interpreted` run only in that subprocess. Tests on CUDA are in tests/gpu/.
"""

import os
import subprocess
import sys

import pytest

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs in test_kernels_under_the_interpreter's subprocess")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_under_interpreter(test_file: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest", test_file]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and " failed" not in result.stdout
