"""The JAX side of the context-parallel rows: ``python -m crosscheck.run.context_jax JOB OUT``.

One worker process (eight CPU devices, x64) runs every case of the job with
`jax_impl.context_parallel` on a ("data", "context") mesh: one compiled sweep of every scheme
per front-end (shard_map, global-view jit) and layout, run on each fixture (they share a
shape), and returns plain numpy for the parent to judge (`crosscheck.run.context_parallel`).
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Sequence

import numpy as np

from crosscheck.contract.fixture import BATCH_KEYS, ROW_FIELD_KEYS
from crosscheck.fixtures.builtin import builtin_fixture
from crosscheck.launch.schedule import Job
from crosscheck.launch.workers import report_jax_job, serve_job
from crosscheck.run.context_parallel import (
    JAX_FRONT_ENDS,
    ContextCase,
    ContextOutput,
    OnContext,
)
from crosscheck.run.jax_worker import id_space

WORKER_TIMEOUT_S = 300.0


def run_cases(job: dict) -> dict[ContextCase, ContextOutput | str]:
    """In the worker: one program per front-end and layout holding every scheme, run on each
    fixture; a layout whose program fails fails its cases with the traceback."""
    import optax

    from jax_impl.context_parallel import (
        context_mesh,
        lay_out_context_parallel,
        make_context_parallel_global_sweep,
        make_context_parallel_sweep,
    )
    from jax_impl.update import StepConfig

    make_sweep = {
        "shard_map": make_context_parallel_sweep,
        "jit": make_context_parallel_global_sweep,
    }
    results: dict[ContextCase, ContextOutput | str] = {}
    by_program: dict[tuple, list[ContextCase]] = {}
    for case in job["cases"]:
        by_program.setdefault((case.impl, *case.layout), []).append(case)
    fixtures = {name: builtin_fixture(name) for name in {c.fixture for c in job["cases"]}}
    # One static size for the id ranges of every fixture: one compile serves them all.
    sizes = id_space(list(fixtures))
    for (impl, R, M, C, order), group in sorted(by_program.items()):
        schemes = sorted({case.scheme for case in group})
        asked = {(case.fixture, case.scheme): case for case in group}
        try:
            configs = [StepConfig(optimizer=optax.sgd(0.1), scheme=name) for name in schemes]
            sweep = make_sweep[JAX_FRONT_ENDS[impl]](configs, context_mesh(R, C))
            for name, fixture in sorted(fixtures.items()):
                arrays = {key: getattr(fixture, key) for key in (*BATCH_KEYS, *ROW_FIELD_KEYS)}
                batch = lay_out_context_parallel(
                    arrays, R, M, C, order, vocab_size=fixture.vocab_size, **sizes
                )
                outs = sweep([fixture.params()] * len(configs), batch)
                for scheme, out in zip(schemes, outs, strict=True):
                    if (name, scheme) in asked:
                        results[asked[name, scheme]] = ContextOutput(
                            {k: np.asarray(v, dtype=np.float64) for k, v in out.grads.items()},
                            tuple(int(n) for n in np.asarray(out.rank_valid_tokens).ravel()),
                        )
        except Exception:  # the program's cases fail by name with the traceback
            message = traceback.format_exc(limit=8)
            results.update({case: message for case in group if case not in results})
    return results


def _run(cases: list[ContextCase], on_done: OnContext) -> None:
    report_jax_job(
        "crosscheck.run.context_jax",
        cases,
        on_done,
        timeout_s=WORKER_TIMEOUT_S,
        prefix="gradweight-context-",
    )


def jobs(cases: list[ContextCase], on_done: OnContext) -> list[Job]:
    """One worker for every JAX context-parallel case (a program per front-end and layout)."""
    mine = [c for c in cases if c.impl in JAX_FRONT_ENDS]
    if not mine:
        return []
    programs = len({(c.impl, c.layout) for c in mine})
    return [Job("jax context-parallel rows", 1, 2.0 + 3.0 * programs, lambda: _run(mine, on_done))]


def main(argv: Sequence[str]) -> int:
    return serve_job(argv, run_cases)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
