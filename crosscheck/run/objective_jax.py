"""The JAX side of the objective rows: ``python -m crosscheck.run.objective_jax JOB OUT``.

One worker process (eight CPU devices, x64) computes every objective case of the job with
``jax_impl.objective.make_objective_fn`` under ``shard_map``, one compiled program per
objective and layout (the fixtures share a shape), and returns plain numpy for the parent to
judge (`crosscheck.run.objectives`).
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Sequence

import numpy as np

from crosscheck.contract.fixture import BATCH_KEYS
from crosscheck.fixtures.builtin import builtin_fixture
from crosscheck.fixtures.objective_params import objective_params
from crosscheck.launch.schedule import Job
from crosscheck.launch.workers import report_jax_job, serve_job
from crosscheck.run.jax_worker import id_space
from crosscheck.run.objectives import (
    OBJECTIVES,
    ObjectiveCase,
    ObjectiveOutput,
    OnObjective,
    TermOutput,
    term_name,
)

IMPL = "jax-shard_map"
WORKER_TIMEOUT_S = 300.0


def run_cases(job: dict) -> dict[ObjectiveCase, ObjectiveOutput | str]:
    """In the worker: every case of the job; a failing case gets its traceback."""
    import jax

    import jax_impl
    from jax_impl.objective import make_objective_fn

    results: dict[ObjectiveCase, ObjectiveOutput | str] = {}
    programs: dict[tuple[str, int], object] = {}
    # One id space for every fixture (static in the program): fixtures of one shape then
    # share one compiled program per objective and layout, as in the main worker.
    space = id_space([case.fixture for case in job["cases"]])
    for case in job["cases"]:
        try:
            fixture = builtin_fixture(case.fixture)
            R, M = case.world_size, case.accum_steps
            key = (case.objective, R)
            if key not in programs:
                programs[key] = make_objective_fn(OBJECTIVES[case.objective], jax_impl.data_mesh(R))
            arrays = {k: np.asarray(getattr(fixture, k)) for k in BATCH_KEYS}
            batch = jax_impl.lay_out_global_batch(
                arrays, R, M, vocab_size=fixture.vocab_size, **space
            )
            # On the host first: indexing a jax array would compile a small program per
            # shape and index kind (gathers, slices) in every worker.
            out = jax.tree.map(np.asarray, programs[key](objective_params(fixture), batch))
            names = [term_name(t) for t in OBJECTIVES[case.objective]]
            results[case] = ObjectiveOutput(
                grads=out.grads,
                loss=float(out.loss),
                terms=tuple(
                    TermOutput(
                        name,
                        float(out.term_losses[i]),
                        int(out.term_counts[i]),
                        tuple(float(d) for d in out.term_denominators[i]),
                    )
                    for i, name in enumerate(names)
                ),
            )
        except Exception:  # this case fails by name with its traceback; the others still run
            results[case] = traceback.format_exc(limit=8)
    return results


def _run(cases: list[ObjectiveCase], on_done: OnObjective) -> None:
    report_jax_job(
        "crosscheck.run.objective_jax",
        cases,
        on_done,
        timeout_s=WORKER_TIMEOUT_S,
        prefix="gradweight-objective-",
    )


def jobs(cases: list[ObjectiveCase], on_done: OnObjective) -> list[Job]:
    """One worker for every JAX objective case (programs: one per objective and R)."""
    if not cases:
        return []
    programs = len({(c.objective, c.world_size) for c in cases})
    return [Job(f"{IMPL} objectives", 1, 1.0 + 0.8 * programs, lambda: _run(cases, on_done))]


def main(argv: Sequence[str]) -> int:
    return serve_job(argv, run_cases)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
