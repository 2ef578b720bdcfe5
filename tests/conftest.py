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


#: A directory every xdist worker of the session shares (tests/bug_outputs.py keeps the one
#: run of the bug catalogue there): the parent of the workers' own base temporary directories,
#: which pytest removes with its older runs.
SHARED_DIR_ENV = "GRADWEIGHT_TEST_SHARED_DIR"


@pytest.fixture(scope="session", autouse=True)
def _shared_directory(tmp_path_factory: pytest.TempPathFactory) -> None:
    base = tmp_path_factory.getbasetemp()
    os.environ[SHARED_DIR_ENV] = str(base.parent if "PYTEST_XDIST_WORKER" in os.environ else base)


#: Where an xdist worker hands its audit to the controller (`config.workeroutput`, which xdist
#: sends once the worker's session has finished).
LEAKS_KEY = "gradweight_process_leaks"
_reported_by_workers: list[str] = []


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the session when a process it started outlived its test (see process_audit).

    Under pytest-xdist (``make test`` runs ``-n 2``) every worker imports this file, takes a
    marker of its own and audits its own processes, but a worker's exit status does not reach
    the result: it hands what it found to the controller (`LEAKS_KEY`), which prints it and
    fails the session. The controller runs no test and starts nothing: it audits no marker."""
    config = session.config
    if config.pluginmanager.has_plugin("dsession"):  # the xdist controller
        problems = list(_reported_by_workers)
    else:
        problems = leaks(os.environ[SESSION_MARKER])
        workeroutput = getattr(config, "workeroutput", None)
        if workeroutput is not None:  # an xdist worker
            workeroutput[LEAKS_KEY] = problems
            return
    if problems:
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        lines = ["processes left behind by the test session:", *problems]
        if reporter is not None:
            reporter.write_line("\n".join(lines), red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent when the suite runs alone
def pytest_testnodedown(node: object, error: object) -> None:
    """The controller collects each worker's audit as the worker ends."""
    _reported_by_workers.extend(getattr(node, "workeroutput", {}).get(LEAKS_KEY, []))
