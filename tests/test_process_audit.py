"""The suite's own audit of leaked processes (tests/conftest.py, tests/process_audit.py) fails
the session, run alone and on pytest-xdist's workers (`make test` runs ``-n 2``): a worker's
finding must reach the result, not only the worker."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

TESTS = Path(__file__).resolve().parent

LEAKING_TEST = """
import pathlib
import subprocess
import time


def test_leaves_a_process_running():
    child = subprocess.Popen(["sleep", "60"])
    # Until its exec, /proc shows the child as a fork of this process, whose environment
    # block is this process's at its own start, without the marker conftest added later: the
    # audit could run before the exec and miss it. Wait for the exec (bounded).
    cmdline = pathlib.Path(f"/proc/{child.pid}/cmdline")
    deadline = time.monotonic() + 10
    while not cmdline.read_bytes().startswith(b"sleep") and time.monotonic() < deadline:
        time.sleep(0.01)


def test_leaves_nothing():
    pass
"""


@pytest.mark.parametrize("workers", [(), ("-n", "2", "--dist", "loadfile")], ids=["alone", "xdist"])
def test_a_leaked_process_fails_the_session(pytester: pytest.Pytester, workers) -> None:
    for name in ("conftest.py", "process_audit.py"):
        pytester.path.joinpath(name).write_text((TESTS / name).read_text())
    pytester.makepyfile(test_leak=LEAKING_TEST)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *workers)
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    result.assert_outcomes(passed=2)  # the tests pass: the audit alone fails the session
    result.stdout.fnmatch_lines(
        [
            "*processes left behind by the test session:*",
            "*still running after its call returned: pid * sleep 60*",
        ]
    )
