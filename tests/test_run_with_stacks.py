"""The suite's subprocess runner: a hung command fails its test with the stacks of every process it started."""

import sys

import pytest
from conftest import run_with_stacks


def test_a_hung_command_fails_with_its_childrens_stacks(tmp_path):
    script = tmp_path / "hangs.py"
    script.write_text("import subprocess, sys\n"
                      "subprocess.run([sys.executable, '-c', 'import time\\ndef waits_here():\\n    time.sleep(60)\\n"
                      "waits_here()'])\n")
    with pytest.raises(AssertionError, match="still ran after 2 s") as failure:
        run_with_stacks([sys.executable, str(script)], timeout=2)
    assert "waits_here" in str(failure.value)  # the grandchild's frame
    assert str(script) in str(failure.value)  # the child's


def test_a_finished_command_returns_its_output():
    result = run_with_stacks([sys.executable, "-c", "import sys; print('out'); sys.exit(3)"], timeout=30)
    assert (result.returncode, result.stdout) == (3, "out\n")
