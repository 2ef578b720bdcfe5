"""One run of every buggy step of the catalogue, shared by the tests that judge them.

Each launch of torch ranks or of a JAX worker costs seconds, so the catalogue runs and the
rank-skew runs of `crosscheck.bugs.catalogue_run` go through the real runners once per test session;
test_bug_catalogue, test_torch_bugs and test_jax_bugs each judge the same outputs their own way.
"""

from __future__ import annotations

import functools

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
    return run_steps(catalogue_runs(FRAMEWORKS) + skew_runs(FRAMEWORKS))
