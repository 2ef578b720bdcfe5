"""Running the JAX side of the bug catalogue without importing JAX here.

The patterns are those of `crosscheck.diagnosis.patterns`.

x64 and the fake-device count are process-global in JAX, so each dtype's runs go to their own
worker process (`crosscheck.bugs.jax_bugs_worker`) with eight CPU devices, started and
waited for by `jax_impl.harness.launch.run_workers`: every wait is bounded, and a worker that
crashes or hangs fails the runs it carried, not the caller. The workers of different dtypes run side
by side and independently: one failing does not stop the other.
"""

from __future__ import annotations

import importlib
import importlib.util
import pickle
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

from crosscheck.diagnosis.patterns import BugOutput, BugRun
from crosscheck.run.jax_runner import _worker_env

WORKER_MODULE = "crosscheck.bugs.jax_bugs_worker"
WORKER_TIMEOUT_S = 300.0
DTYPES = ("float64", "float32", "bfloat16")

Outcome = BugOutput | BaseException


class JaxBugRunError(RuntimeError):
    """A run the JAX bug worker could not complete; the message names the run and says why."""


def _launch() -> ModuleType:
    """`jax_impl.harness.launch` without importing JAX into this process.

    Importing it as a submodule would run ``jax_impl/__init__`` and import JAX, and launch.py
    needs only the standard library: unless the package is already imported, the file is
    loaded alone, under its own name ``jax_impl.harness.launch``. One module, whichever way it was
    loaded, holds the registry of the process groups this process started, so
    `jax_impl.harness.launch.terminate_all` (and `crosscheck.launch.processes`, which looks the
    module up by that name) stops every JAX worker. Later ``from jax_impl.harness.launch import
    ...`` statements get this same module.
    """
    name = "jax_impl.harness.launch"
    if name not in sys.modules:
        if "jax_impl" in sys.modules:  # the package is there already: import as usual
            return importlib.import_module(name)
        path = Path(__file__).resolve().parents[2] / "jax_impl" / "harness" / "launch.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses resolve annotations through sys.modules
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


def _run_worker(
    launch: ModuleType, dtype: str, runs: Sequence[BugRun], work: Path, timeout_s: float
) -> dict:
    """One worker for one dtype: {run: outcome} for every run it was given."""
    job, out = work / f"job-{dtype}.pkl", work / f"out-{dtype}.pkl"
    job.write_bytes(pickle.dumps({"runs": list(runs), "dtype": dtype}))
    command = [sys.executable, "-m", WORKER_MODULE, str(job), str(out)]
    try:
        launch.run_workers([command], timeout_s=timeout_s, log_dir=work / dtype, env=_worker_env())
        results = pickle.loads(out.read_bytes())
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
    launch = _launch()  # once, before the threads
    with (
        tempfile.TemporaryDirectory(prefix="gradweight-jax-bugs-") as tmp,
        ThreadPoolExecutor(max_workers=len(by_dtype)) as pool,
    ):
        futures = [
            pool.submit(_run_worker, launch, dtype, group, Path(tmp), timeout_s)
            for dtype, group in sorted(by_dtype.items())
        ]
        for future in futures:
            outcomes.update(future.result())
    return {bug_run: outcomes[bug_run] for bug_run in runs}  # in the order asked
