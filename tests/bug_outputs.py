"""One run of every buggy step of the catalogue, shared by the tests that judge them.

Each launch of torch ranks or of a JAX worker costs seconds, so the catalogue runs and the
rank-skew runs of `crosscheck.bugs.catalogue_run` go through the real runners once per test session;
test_bug_catalogue, test_torch_bugs and test_jax_bugs each judge the same outputs their own way.
"""

from __future__ import annotations

import functools

from crosscheck.bugs.catalogue_run import run_steps, skew_runs
from crosscheck.diagnosis.patterns import BugOutput, BugRun, catalogue_runs

FRAMEWORKS = ("torch", "jax")


@functools.cache
def catalogue_outputs() -> dict[BugRun, BugOutput | BaseException]:
    return run_steps(catalogue_runs(FRAMEWORKS) + skew_runs(FRAMEWORKS))
