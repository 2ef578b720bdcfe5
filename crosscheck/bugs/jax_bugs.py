"""Running the JAX side of the bug catalogue without importing JAX here.

The patterns are those of `crosscheck.diagnosis.patterns`.

x64 and the fake-device count are process-global in JAX, so each dtype's runs go to their own
worker process (`crosscheck.bugs.jax_bugs_worker`) with eight CPU devices, started and waited
for by `crosscheck.launch.worker_processes.run_workers`: every wait is bounded, and a worker
that crashes or hangs fails the runs it carried, not the caller. The workers of different
dtypes run side by side and independently: one failing does not stop the other.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from crosscheck.diagnosis.patterns import BugOutput, BugRun
from crosscheck.launch.workers import run_jax_job

WORKER_MODULE = "crosscheck.bugs.jax_bugs_worker"
WORKER_TIMEOUT_S = 300.0
DTYPES = ("float64", "float32", "bfloat16")

Outcome = BugOutput | BaseException


class JaxBugRunError(RuntimeError):
    """A run the JAX bug worker could not complete; the message names the run and says why."""


def _run_worker(dtype: str, runs: Sequence[BugRun], work: Path, timeout_s: float) -> dict:
    """One worker for one dtype: {run: outcome} for every run it was given."""
    try:
        results = run_jax_job(
            WORKER_MODULE,
            {"runs": list(runs), "dtype": dtype},
            work / dtype,
            timeout_s=timeout_s,
            use_zygote=False,
        )
    except Exception as error:  # the worker died, hung or wrote nothing: all its runs fail
        return {
            run: JaxBugRunError(f"{run.describe()}: the {dtype} JAX bug worker failed: {error}")
            for run in runs
        }
    outcomes: dict[BugRun, Outcome] = {}
    for run in runs:
        result = results.get(run, "the worker returned no result for this run")
        if isinstance(result, str):
            outcomes[run] = JaxBugRunError(f"{run.describe()} failed in the JAX worker:\n{result}")
        else:
            outcomes[run] = result
    return outcomes


def run(runs: list[BugRun], *, timeout_s: float = WORKER_TIMEOUT_S) -> dict[BugRun, Outcome]:
    """Every JAX bug run -> its BugOutput, or the exception that says why it has none.

    One worker process per dtype (float64 with x64, float32 and bfloat16 without), each
    bounded by `timeout_s`. A run that is not for JAX, or of another dtype, gets a ValueError
    without starting anything.
    """
    outcomes: dict[BugRun, Outcome] = {}
    by_dtype: dict[str, list[BugRun]] = {}
    for bug_run in runs:
        if bug_run.framework != "jax":
            outcomes[bug_run] = ValueError(f"{bug_run.describe()}: not a JAX run")
        elif bug_run.dtype not in DTYPES:
            outcomes[bug_run] = ValueError(
                f"{bug_run.describe()}: dtype {bug_run.dtype!r} is not one of {DTYPES}"
            )
        else:
            by_dtype.setdefault(bug_run.dtype, []).append(bug_run)
    if not by_dtype:
        return outcomes
    with (
        tempfile.TemporaryDirectory(prefix="gradweight-jax-bugs-") as tmp,
        ThreadPoolExecutor(max_workers=len(by_dtype)) as pool,
    ):
        futures = [
            pool.submit(_run_worker, dtype, group, Path(tmp), timeout_s)
            for dtype, group in sorted(by_dtype.items())
        ]
        for future in futures:
            outcomes.update(future.result())
    return {bug_run: outcomes[bug_run] for bug_run in runs}  # in the order asked
