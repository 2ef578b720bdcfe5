"""The JAX bug catalogue in its own process: ``python -m crosscheck.bugs.jax_bugs_worker``.

Started by `crosscheck.bugs.jax_bugs`, once per dtype, with eight fake CPU devices (x64 and
the device count are process-global in JAX). Reads a pickled job ``{"runs": [BugRun...],
"dtype": str}`` and writes ``{BugRun: BugOutput | str}``, a string being the traceback of a run
that failed. Runs are validated one by one, so a bad run fails alone; the valid ones are grouped
by (R, batch shape) and each group runs every pattern it needs in one compiled sweep
(`jax_impl.harness.bugs_sweep`), reused for every fixture and skew of that shape.
"""

from __future__ import annotations

import dataclasses
import sys
import traceback
from collections.abc import Sequence

import numpy as np

from crosscheck.contract.fixture import BATCH_KEYS
from crosscheck.diagnosis.patterns import (
    CLIP_PER_MICROBATCH_NORM,
    NUM_WINDOWS,
    RANK_SKEW,
    BugOutput,
    BugRun,
)
from crosscheck.fixtures.builtin import builtin_fixture
from crosscheck.launch.workers import launch_arrays, serve_job

Results = dict[BugRun, BugOutput | str]


def _prepare(run: BugRun, dtype: str):
    """(params, laid-out batch, the fixture's group_ids or None) of a run, or ValueError
    naming what is wrong with it."""
    import jax_impl
    from jax_impl.harness.bugs_sweep import check_patterns, check_world_size

    check_patterns([run.pattern])
    check_world_size(run.world_size)
    fixture = builtin_fixture(run.fixture)
    arrays, _ = launch_arrays(run.fixture)  # the token arrays and the fixture's v2 fields
    batch = jax_impl.lay_out_global_batch(
        {key: arrays[key] for key in BATCH_KEYS},
        run.world_size,
        run.accum_steps,
        vocab_size=fixture.vocab_size,
        # Soft weights in the denominator dtype (float64 with x64, else float32), never in
        # the params' dtype: jax_impl refuses weights narrower than float32.
        weights_dtype=None,
    )
    params = jax_impl.params_from_numpy(fixture.params(), dtype)
    return params, batch, arrays.get("group_ids")


def _share_id_space(prepared: dict, group: Sequence[BugRun]) -> None:
    """Give the batches of `group` (one shape) one id space: the number of group and
    document ids is static in a compiled program, so fixtures of one shape share a compile
    only when they share it (each was laid out with its own largest ids + 1). A larger id
    space adds ids no token holds: zero counts, never read."""
    batches = [prepared[run][1] for run in group]
    space = {
        "num_groups": max(batch.num_groups for batch in batches),
        "num_documents": max(batch.num_documents for batch in batches),
    }
    for run in group:
        params, batch, group_ids = prepared[run]
        prepared[run] = (params, dataclasses.replace(batch, **space), group_ids)


def run_all(runs: Sequence[BugRun], dtype: str) -> Results:
    """Every run of one dtype; a failure is recorded as its traceback, by run."""
    from jax_impl.harness.bugs_sweep import make_bug_sweep

    results: Results = {}
    prepared = {}
    context_runs = [run for run in runs if run.context_size > 1]
    pipeline_runs = [run for run in runs if run.pipeline_stages > 1]
    for run in runs:
        if run.context_size > 1 or run.pipeline_stages > 1:
            continue
        try:
            if run.dtype != dtype:
                raise ValueError(f"{run.describe()} sent to the {dtype} worker")
            prepared[run] = _prepare(run, dtype)
        except Exception:
            results[run] = traceback.format_exc(limit=4)
    results.update(_run_context_parallel(context_runs, dtype))
    results.update(_run_pipelines(pipeline_runs, dtype))
    # One sweep per (R, [R, M, B, T]): the union of the patterns any fixture of that shape
    # needs; every fixture (and every rank-skew factor) of the shape reuses its compile.
    groups: dict[tuple, list[BugRun]] = {}
    for run, (_, batch, _) in prepared.items():
        groups.setdefault((run.world_size, np.shape(batch.targets)), []).append(run)
    for group in groups.values():
        _share_id_space(prepared, group)
    for (world_size, _), group in sorted(groups.items()):
        patterns = sorted({run.pattern for run in group})
        calls: dict[tuple[str, float], list[BugRun]] = {}
        for run in group:
            # Only rank-skew reads the skew; every other run rides along with any call.
            skew = run.skew if run.pattern == RANK_SKEW else None
            calls.setdefault((run.fixture, skew), []).append(run)
        for fixture_name in sorted({fixture for fixture, _ in calls}):
            skews = sorted({s for f, s in calls if f == fixture_name and s is not None}) or [1.0]
            waiting = calls.get((fixture_name, None), [])
            for skew in skews:
                todo = waiting + calls.get((fixture_name, skew), [])
                waiting = []
                try:
                    sweep = make_bug_sweep(
                        patterns,
                        world_size,
                        clip_norm=CLIP_PER_MICROBATCH_NORM,
                        num_windows=NUM_WINDOWS,
                    )
                    params, batch, group_ids = prepared[todo[0]]
                    outs = sweep(params, batch, skew, group_ids)
                except Exception:  # a failed sweep fails its own runs, by name
                    message = traceback.format_exc(limit=8)
                    results.update({run: message for run in todo})
                    continue
                for run in todo:
                    out = outs[run.pattern]
                    results[run] = BugOutput(
                        grads=out.grads, logged_denominator=out.logged_denominator
                    )
    return results


def _run_context_parallel(runs: Sequence[BugRun], dtype: str) -> Results:
    """The context-parallel runs: one sweep per fixture and layout holding every pattern of
    the catalogue at that layout (the runs' programs are compiled per pattern set and shape)."""
    from jax_impl.harness.bugs_context import run_context_bug_steps
    from jax_impl.harness.bugs_sweep import check_world_size

    results: Results = {}
    by_layout: dict[tuple, list[BugRun]] = {}
    patterns_at: dict[tuple, set[str]] = {}
    for run in runs:
        where = (run.fixture, run.world_size, run.accum_steps, run.context_size, run.context_order)
        by_layout.setdefault(where, []).append(run)
        patterns_at.setdefault(where[1:4], set()).add(run.pattern)
    for (fixture, R, M, C, order), group in sorted(by_layout.items()):
        try:
            if dtype != "float64" or any(run.dtype != dtype for run in group):
                raise ValueError(f"{group[0].describe()}: context-parallel runs are float64")
            check_world_size(R * C)
            arrays, params = launch_arrays(fixture)
            outs = run_context_bug_steps(
                sorted(patterns_at[R, M, C]),
                {key: arrays[key] for key in BATCH_KEYS},
                params,
                R,
                M,
                C,
                order,
                dtype=dtype,
                num_windows=NUM_WINDOWS,
            )
        except Exception:  # a failed sweep fails its own runs, by name
            message = traceback.format_exc(limit=8)
            results.update({run: message for run in group})
            continue
        for run in group:
            out = outs[run.pattern]
            results[run] = BugOutput(grads=out.grads, logged_denominator=out.logged_denominator)
    return results


def _run_pipelines(runs: Sequence[BugRun], dtype: str) -> Results:
    """The pipeline runs (`jax_impl.harness.bugs_pipeline`), float64, one at a time."""
    from jax_impl.harness.bugs_pipeline import run_pipeline_bug_step
    from jax_impl.harness.bugs_sweep import check_world_size

    results: Results = {}
    for run in runs:
        try:
            if dtype != "float64" or run.dtype != dtype or run.pipeline_stages != 2:
                raise ValueError(f"{run.describe()}: pipeline runs are float64 on 2 stages")
            check_world_size(run.num_processes)
            arrays, params = launch_arrays(run.fixture)
            out = run_pipeline_bug_step(
                run.pattern,
                {key: arrays[key] for key in BATCH_KEYS},
                params,
                run.world_size,
                run.accum_steps,
                num_windows=NUM_WINDOWS,
            )
            results[run] = BugOutput(grads=out.grads, logged_denominator=out.logged_denominator)
        except Exception:  # a failed run fails alone, by name
            results[run] = traceback.format_exc(limit=8)
    return results


def main(argv: Sequence[str]) -> int:
    return serve_job(argv, lambda job: run_all(job["runs"], job["dtype"]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
