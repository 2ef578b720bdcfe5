"""Shared test set-up.

JAX reads XLA_FLAGS once, at import: eight fake CPU devices must be requested before any test
module imports jax, so it happens here, first. Tests that need them check `jax.device_count()`
and fail (never skip) when the devices are missing.

Every process the suite starts inherits a session marker; at the end the suite checks that
none of them is still alive (tests/process_audit.py) and fails otherwise.
"""

import importlib.util
import os
import uuid
from pathlib import Path

import pytest
from process_audit import SESSION_MARKER, leaks

# The verify steps are named from the repository root, as a user names theirs
# (``tests.jax_verify_steps:...``); an installed regular package called `tests` wins over this
# directory at every position of sys.path and breaks every one of them with a misleading
# ModuleNotFoundError. Say so once, up front.
_tests = importlib.util.find_spec("tests")
if _tests is not None and _tests.origin and Path(_tests.origin).parent != Path(__file__).parent:
    raise pytest.UsageError(
        f"an installed package named 'tests' ({_tests.origin}) shadows this repository's tests/ "
        "directory for the steps the suite imports as tests.<module>; remove it (python "
        "scripts/drop_stray_tests_package.py; `make conformance` runs it after installing verl)"
    )

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
# Keep numpy/BLAS to one thread per process: the multi-process tests start several processes
# on a 2-core machine, and oversubscribed BLAS threads only make them slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ[SESSION_MARKER] = uuid.uuid4().hex


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the session when a process it started outlived its test (see process_audit).

    Under pytest-xdist (``make test`` runs ``-n 2``) every worker imports this file, takes a
    marker of its own and audits its own processes; the controller, which runs no test,
    audits nothing (its marker is only in the workers' starting environment)."""
    if session.config.pluginmanager.has_plugin("dsession"):
        return
    problems = leaks(os.environ[SESSION_MARKER])
    if problems:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        lines = ["processes left behind by the test session:", *problems]
        if reporter is not None:
            reporter.write_line("\n".join(lines), red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
