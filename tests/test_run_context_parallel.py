"""The context-parallel rows of `crosscheck run` (crosscheck.run.context_parallel).

Every implementation that splits rows over context ranks (jax-shard_map and jax-jit on a
("data", "context") mesh, torch-ddp and torch-fsdp2 on R C gloo processes) runs every intended
scheme at two of the family's DP x CP layouts, through the family's own jobs (the ones
`run_matrix` schedules); every row must pass, each layout and implementation must be there,
and the oracle's invariance rows must hold at every layout of the family. The verdict itself
is held to fail: a wrong gradient, a wrong per-process count, an error, a row that never came
back.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from crosscheck.cli.parser import build_parser
from crosscheck.run import context_jax, context_torch
from crosscheck.run import context_parallel as cp
from crosscheck.run.plan import Plan
from crosscheck.run.rows import missing_rows

#: The family's plumbing on two of its layouts (both orders, C = 2 and 4, DP and accumulation
#: beside) and one fixture: every scheme on every front-end at every layout is
#: tests/test_jax_context_parallel.py's and tests/test_torch_context_parallel.py's.
SUBSET_LAYOUTS = ((2, 1, 2, "contiguous"), (1, 2, 4, "zigzag"))


@functools.cache
def family_rows() -> tuple[list, list]:
    """(the planned subset, its rows) through the family's jobs, judged as `run_matrix`
    judges them."""
    from crosscheck.launch.schedule import run_jobs

    cases = [
        c
        for c in cp.context_cases(cp.IMPLS)
        if c.fixture == "rollouts" and c.layout in SUBSET_LAYOUTS
    ]
    rows = []

    def on_done(case, output) -> None:
        rows.append(cp.compare_context(case, output))

    run_jobs([*context_jax.jobs(cases, on_done), *context_torch.jobs(cases, on_done)])
    return cases, rows


def test_every_implementation_matches_the_oracle_at_context_layouts() -> None:
    planned, rows = family_rows()
    failed = [f"{r.impl} {r.fixture} {r.scheme} {r.extra}: {r.detail}" for r in rows if not r.ok]
    assert not failed, "\n".join(failed[:20])
    assert len(rows) == len(planned) == len(cp.IMPLS) * len(cp.context_schemes()) * 2
    seen = {(r.impl, r.world_size, r.accum_steps, r.extra["context_size"]) for r in rows}
    assert seen == {(impl, R, M, C) for impl in cp.IMPLS for R, M, C, _ in SUBSET_LAYOUTS}
    assert not missing_rows(cp.planned_rows(planned, with_oracle=False, detail="lost"), rows)
    # The default run plans every implementation, fixture, scheme and layout of the family.
    assert len(cp.context_cases(Plan().impls)) == 4 * 2 * len(cp.context_schemes()) * 4


def test_the_oracle_weighs_every_intended_scheme_alike_at_every_context_layout() -> None:
    rows = cp.invariance_rows()
    assert len(rows) == len(cp.CONTEXT_FIXTURES) * len(cp.context_schemes()) * 4
    assert all(r.ok for r in rows), [r for r in rows if not r.ok][:3]


def test_a_wrong_gradient_a_wrong_count_and_an_error_fail_their_rows() -> None:
    case = cp.ContextCase("torch-ddp", "packed", "token_mean", 2, 1, 2, "contiguous")
    expected = cp._oracle(case.fixture, case.scheme, *case.layout)
    counts = tuple(int(n) for n in expected.rank_valid_tokens)
    right = cp.ContextOutput(dict(expected.grads), counts)
    assert cp.compare_context(case, right).ok
    scaled = {k: v * (1 + 1e-9) for k, v in expected.grads.items()}
    assert not cp.compare_context(case, cp.ContextOutput(scaled, counts)).ok
    nan = {k: np.full_like(v, np.nan) for k, v in expected.grads.items()}
    assert not cp.compare_context(case, cp.ContextOutput(nan, counts)).ok
    shifted = (counts[0] + 1, *counts[1:])
    row = cp.compare_context(case, cp.ContextOutput(dict(expected.grads), shifted))
    assert not row.ok and "valid targets" in row.detail
    row = cp.compare_context(case, RuntimeError("rank 1 died"))
    assert not row.ok and row.not_run and "rank 1 died" in row.detail


def test_a_case_that_never_came_back_is_a_failing_row() -> None:
    planned = cp.context_cases(["jax-jit"])[:3]
    rows = [cp.compare_context(c, RuntimeError("x")) for c in planned[1:]]
    missing = missing_rows(cp.planned_rows(planned, with_oracle=False, detail="lost"), rows)
    assert len(missing) == 1 and missing[0].scheme == planned[0].scheme and missing[0].not_run


def test_the_family_is_on_by_default_and_off_when_asked_or_narrowed() -> None:
    assert Plan().context_parallel is True
    assert Plan(fixtures=["packed"]).context_parallel is False
    from crosscheck.cli.commands import _plan

    args = build_parser().parse_args(["run", "--no-context-parallel"])
    assert _plan(args).context_parallel is False


@pytest.mark.parametrize("impl", ["jax-pmap", "jax-multiprocess", "oracle"])
def test_implementations_without_a_context_split_get_no_rows(impl: str) -> None:
    assert cp.context_cases([impl]) == []
