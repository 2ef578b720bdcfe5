"""Running the multi-term buggy steps: one torch launch per world size, one JAX worker.

The steps are ``torch_impl.harness.objective_bugs`` (DDP on gloo) and
``jax_impl.harness.objective_bugs`` (``shard_map`` on eight fake CPU devices, float64); each
gets the built-in fixture's batch, the model family's params (`objective_params`) and the
catalogue's objective, and hands back every trained param's gradient as float64 numpy. They
are started through `crosscheck.launch.workers` like the main job's: every wait is bounded, a
launch or worker that fails fails the runs it carried, by name, and every process it started
is gone when it returns. torch and JAX are imported only when something is launched; this
module run as ``python -m crosscheck.bugs.objective_steps JOB OUT`` is the JAX worker.
"""

from __future__ import annotations

import sys
import tempfile
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from crosscheck.contract.fixture import BATCH_KEYS
from crosscheck.fixtures.builtin import builtin_fixture
from crosscheck.fixtures.objective_params import objective_params
from crosscheck.launch.workers import (
    first_disagreeing_rank,
    launch_each,
    layout_problem,
    run_jax_job,
    serve_job,
)
from crosscheck.run.jax_worker import id_space

WORKER_MODULE = "crosscheck.bugs.objective_steps"
#: R = 4 with every pattern at one layout takes seconds; the bounds only catch a hang.
LAUNCH_TIMEOUT_S = 240.0
COLLECTIVE_TIMEOUT_S = 60.0
WORKER_TIMEOUT_S = 240.0

Grads = dict[str, np.ndarray]
Outcome = Grads | BaseException


@dataclass(frozen=True, kw_only=True, slots=True)
class ObjectiveBugRun:
    """One buggy step: `pattern` hitting term `target` of `terms`, in `framework`, at a layout."""

    pattern: str
    target: str
    framework: str
    fixture: str
    world_size: int
    accum_steps: int
    #: The objective, as a tuple of term dicts' items (hashable: a run is a dict key).
    terms: tuple[tuple[tuple[str, Any], ...], ...]

    @property
    def term_dicts(self) -> list[dict[str, Any]]:
        return [dict(items) for items in self.terms]

    @property
    def named(self) -> str:
        """What the diagnosis must name: the pattern on its term."""
        return f"{self.pattern}({self.target})"

    def describe(self) -> str:
        return (
            f"{self.named} {self.framework} {self.fixture} R={self.world_size},M={self.accum_steps}"
        )


def frozen_terms(terms: Sequence[Mapping[str, Any]]) -> tuple[tuple[tuple[str, Any], ...], ...]:
    """`terms` in the hashable form `ObjectiveBugRun` keeps."""
    return tuple(tuple(sorted(t.items())) for t in terms)


class ObjectiveStepError(RuntimeError):
    """A buggy step that did not run; the message names it and says why."""


# ---- torch: one launch per world size ----------------------------------------------------------


def _torch_case(run: ObjectiveBugRun):
    from torch_impl.harness.objective_bugs import ObjectiveBugCase

    fixture = builtin_fixture(run.fixture)
    return ObjectiveBugCase(
        label=run.describe(),
        pattern=run.pattern,
        target=run.target,
        batch={k: np.asarray(getattr(fixture, k)) for k in BATCH_KEYS},
        params=objective_params(fixture),
        terms=run.term_dicts,
        accum_steps=run.accum_steps,
        vocab_size=fixture.vocab_size,
    )


def _same_on_every_rank(run: ObjectiveBugRun, per_rank: list) -> Grads:
    """Rank 0's gradient, after checking every rank holds the same bytes (one all-reduce)."""
    rank = first_disagreeing_rank(per_rank)
    if rank is not None:
        raise ObjectiveStepError(f"{run.describe()}: rank {rank} ended with another gradient")
    return per_rank[0].grads


def run_torch(runs: Sequence[ObjectiveBugRun]) -> dict[ObjectiveBugRun, Outcome]:
    """Every torch run's gradient, or the error it met; one launch of R ranks per world size."""
    from torch_impl.harness.objective_bugs import run_objective_bug_cases

    outcomes: dict[ObjectiveBugRun, Outcome] = {}
    by_size: dict[int, list[ObjectiveBugRun]] = {}
    for run in runs:
        problem = layout_problem(run.fixture, run.world_size, run.accum_steps)
        if problem:
            outcomes[run] = ValueError(f"{run.describe()}: {problem}")
        else:
            by_size.setdefault(run.world_size, []).append(run)
    for world_size, group in sorted(by_size.items()):
        results = launch_each(
            run_objective_bug_cases,
            world_size,
            group,
            _torch_case,
            _same_on_every_rank,
            timeout_s=LAUNCH_TIMEOUT_S,
            collective_timeout_s=COLLECTIVE_TIMEOUT_S,
        )
        outcomes.update(zip(group, results, strict=True))
    return outcomes


# ---- JAX: one worker process, x64, eight CPU devices -------------------------------------------


def run_jax(
    runs: Sequence[ObjectiveBugRun], *, timeout_s: float = WORKER_TIMEOUT_S
) -> dict[ObjectiveBugRun, Outcome]:
    """Every JAX run's gradient, or the error it met; all in one worker bounded by `timeout_s`."""
    if not runs:
        return {}
    with tempfile.TemporaryDirectory(prefix="gradweight-objective-bugs-") as tmp:
        try:
            results = run_jax_job(
                WORKER_MODULE,
                {"runs": list(runs), "dtype": "float64"},
                Path(tmp),
                timeout_s=timeout_s,
                use_zygote=False,
            )
        except Exception as error:  # the worker died, hung or wrote nothing: all its runs fail
            return {
                run: ObjectiveStepError(f"{run.describe()}: the JAX worker failed: {error}")
                for run in runs
            }
    outcomes: dict[ObjectiveBugRun, Outcome] = {}
    for run in runs:
        result = results.get(run, "the worker returned no result for this run")
        failed = isinstance(result, str)
        outcomes[run] = ObjectiveStepError(f"{run.describe()}:\n{result}") if failed else result
    return outcomes


def jax_grads(runs: Sequence[ObjectiveBugRun]) -> dict[ObjectiveBugRun, Grads | str]:
    """In the worker: every run's gradient, or its traceback; one program per (pattern, R)."""
    import jax_impl
    from jax_impl.harness.objective_bugs import make_objective_bug_fn

    results: dict[ObjectiveBugRun, Grads | str] = {}
    programs: dict[tuple, Any] = {}
    # One id space for every fixture (static in a compiled program): fixtures of one shape
    # then share the program of their pattern and layout, as in the main worker.
    space = id_space([run.fixture for run in runs])
    for run in runs:
        try:
            fixture = builtin_fixture(run.fixture)
            R, M = run.world_size, run.accum_steps
            key = (run.pattern, run.target, run.terms, R)
            if key not in programs:
                mesh = jax_impl.data_mesh(R)
                programs[key] = make_objective_bug_fn(run.pattern, run.term_dicts, run.target, mesh)
            arrays = {k: np.asarray(getattr(fixture, k)) for k in BATCH_KEYS}
            batch = jax_impl.lay_out_global_batch(
                arrays, R, M, vocab_size=fixture.vocab_size, **space
            )
            grads = programs[key](objective_params(fixture), batch)
            results[run] = {k: np.asarray(v, dtype=np.float64) for k, v in grads.items()}
        except Exception:  # this run fails by name with its traceback; the others still run
            results[run] = traceback.format_exc(limit=8)
    return results


def main(argv: Sequence[str]) -> int:
    return serve_job(argv, lambda job: jax_grads(job["runs"]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
