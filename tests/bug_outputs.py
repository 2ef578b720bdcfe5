"""One run of every buggy step of the catalogue, shared by the tests that judge them.

Each launch of torch ranks or of a JAX worker costs seconds, so the catalogue runs and the
rank-skew runs of `crosscheck.bugs.catalogue_run` go through the real runners once per test session;
test_bug_catalogue, test_torch_bugs and test_jax_bugs each judge the same outputs their own way.
"""

from __future__ import annotations

import fcntl
import functools
import os
import pickle
from pathlib import Path

from crosscheck.bugs.catalogue_run import SKEW, run_steps, skew_runs
from crosscheck.diagnosis.patterns import BugOutput, BugRun, catalogue_runs

FRAMEWORKS = ("torch", "jax")


def skew_run(framework: str, dtype: str, skew: float) -> BugRun:
    """The rank-skew run of `crosscheck.bugs.catalogue_run` for this framework, dtype and skew
    (the session's run holds it: its fixture, layout and skews are the catalogue's own)."""
    (run,) = [r for r in skew_runs((framework,)) if (r.dtype, r.skew) == (dtype, skew)]
    return run


def judged_runs(framework: str) -> tuple[list[BugRun], list[BugRun]]:
    """What test_jax_bugs and test_torch_bugs hold to numpy for one framework: its runs of the
    catalogue, and the rank-skew runs with no skew (float64 and float32) and with SKEW."""
    points = (("float64", 1.0), ("float32", 1.0), ("float64", SKEW))
    skewed = [skew_run(framework, dtype, skew) for dtype, skew in points]
    return catalogue_runs((framework,)), skewed


def bug_output(run: BugRun) -> BugOutput:
    """`run`'s output in the session's one run; a run that raised fails the test, with its error."""
    result = catalogue_outputs()[run]
    if isinstance(result, BaseException):
        raise AssertionError(f"{run.describe()} failed: {result!r}") from result
    return result


@functools.cache
def catalogue_outputs() -> dict[BugRun, BugOutput | BaseException]:
    """Every run's output, computed once per test session.

    Under pytest-xdist the workers share one computation: the first to ask runs the steps
    and pickles them into a file of the session's shared directory (tests/conftest.py, under
    pytest's own temporary directory, which pytest removes with its older runs), holding an
    exclusive lock meanwhile; a worker that asks later waits for the lock and reads the file
    (the three files that judge the catalogue often land on both workers, and running every
    step twice would cost half a minute of CPU)."""
    session = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    shared = os.environ.get("GRADWEIGHT_TEST_SHARED_DIR")
    if session is None or shared is None:
        return _run_everything()
    path = Path(shared) / f"bug-outputs-{session}.pkl"
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if path.exists():
            with path.open("rb") as f:
                return pickle.load(f)
        outputs = _run_everything()
        partial = path.with_suffix(".partial")
        # An error as its text: an exception class with its own __init__ may not unpickle.
        shared = {
            run: RuntimeError(f"{type(out).__name__}: {out}")
            if isinstance(out, BaseException)
            else out
            for run, out in outputs.items()
        }
        with partial.open("wb") as f:
            pickle.dump(shared, f)
        partial.replace(path)  # whole or absent: a worker never reads half a file
        return outputs


def _run_everything() -> dict[BugRun, BugOutput | BaseException]:
    return run_steps(catalogue_runs(FRAMEWORKS) + skew_runs(FRAMEWORKS))
