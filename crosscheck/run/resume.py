"""Checkpoint-resume rows: stop, save, restart in fresh processes, continue, compare.

For each framework the default set stops a (2, 2) run after its first update and resumes at
(2, 2), at (4, 1) and at (1, 4) (the world size changes, the global batch does not), and stops
it in the middle of the second update's accumulation window, after one of its two
microbatches. The params after the last update must equal the same implementation's
uninterrupted run and the oracle's.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable

from crosscheck.contract.cases import (
    Case,
    CaseResult,
    ResumeCase,
    ResumeOutput,
    TrainSettings,
    case_grid,
)
from crosscheck.fixtures.builtin import builtin_fixture
from crosscheck.judge.compare import RTOL_BY_DTYPE, tree_rel_err
from crosscheck.launch.schedule import Job
from crosscheck.run.rows import clip_convention, oracle_records

#: impl -> module providing run_resume(cases, settings, on_done)
RESUME_RUNNERS: dict[str, str] = {
    "torch-ddp": "crosscheck.run.torch_runner",
    "jax-pmap": "crosscheck.run.jax_resume",
}

#: Processes a resume job keeps busy: torch starts ranks at world sizes 2, then 1, 2 and 4
#: (about 2 at a time); JAX runs one worker process per phase.
RESUME_PROCESSES: dict[str, int] = {"torch-ddp": 2, "jax-pmap": 1}
#: CPU seconds per resume case (measured on 2 cores): JAX compiles the split windows.
RESUME_COST_PER_CASE: dict[str, float] = {"torch-ddp": 0.09, "jax-pmap": 0.15}

#: (resume R, resume M, microbatches done in the stopped update)
SCENARIOS: tuple[tuple[int, int, int], ...] = ((2, 2, 0), (4, 1, 0), (1, 4, 0), (2, 2, 1))


#: The layout every resume case starts at; a stop between updates may resume at another layout
#: of the same R x M (`SCENARIOS`), so a fixture's rows must divide by R M.
START_LAYOUT = (2, 2)


def starting_cases(
    impls: list[str], fixtures: list[str], schemes: list[str], strategies: list[str]
) -> list[Case]:
    """The run that the resume cases of each (impl, fixture, scheme, strategy) stop and
    resume: at `START_LAYOUT`, float64."""
    return case_grid(impls, fixtures, [START_LAYOUT], schemes, strategies)


def default_cases(
    impls: list[str], fixtures: list[str], schemes: list[str], strategies: list[str]
) -> list[ResumeCase]:
    """Every scenario of `SCENARIOS` for each starting case of a resumable implementation on
    a fixture whose rows divide among the starting layout's R M."""
    runnable = [impl for impl in impls if impl in RESUME_RUNNERS]
    dividing = [f for f in fixtures if builtin_fixture(f).fits(*START_LAYOUT)]
    return [
        ResumeCase(
            **start.coordinates(),
            resume_world_size=R,
            resume_accum_steps=M,
            stop_after_microbatches=microbatches,
        )
        for start in starting_cases(runnable, dividing, schemes, strategies)
        for R, M, microbatches in SCENARIOS
    ]


def compare_resume(case: ResumeCase, output: ResumeOutput, settings: TrainSettings) -> CaseResult:
    """The resumed run against the uninterrupted one and against the oracle."""
    # Cached: the cases of one run share their uninterrupted oracle run.
    expected = oracle_records(
        case.fixture,
        case.scheme,
        case.world_size,
        case.accum_steps,
        dataclasses.replace(settings, num_updates=case.num_updates),
        clip_convention(case.impl),
    )[-1].params
    vs_self = tree_rel_err(output.resumed, output.uninterrupted)
    vs_oracle = tree_rel_err(output.resumed, expected)
    worst = max(vs_self, vs_oracle, key=lambda e: e.max_rel_err)
    rtol = RTOL_BY_DTYPE[case.dtype]
    return resume_row(
        case,
        max_rel_err=worst.max_rel_err,
        ok=worst.max_rel_err <= rtol,
        detail=(
            f"vs uninterrupted {vs_self.max_rel_err:.2e}, vs oracle {vs_oracle.max_rel_err:.2e}"
            + ("" if worst.max_rel_err <= rtol else f"; worst {worst.describe()}")
        ),
    )


def resume_row(
    case: ResumeCase, *, max_rel_err: float, ok: bool, detail: str, not_run: bool = False
) -> CaseResult:
    """The case's resume row; `not_run` when the case raised or never came back."""
    stop = f"stop after {case.stop_after_updates}"
    if case.stop_after_microbatches:
        stop += f"+{case.stop_after_microbatches}mb"
    resumed_at = f"R={case.resume_world_size},M={case.resume_accum_steps}"
    # The row's strategy says where the run stopped and where it resumed.
    where = case.coordinates() | {"strategy": f"{case.strategy}, {stop} -> {resumed_at}"}
    return CaseResult(
        check="resume",
        **where,
        max_rel_err=max_rel_err,
        ok=ok,
        reference=f"uninterrupted run and oracle after {case.num_updates} updates",
        detail=detail,
        not_run=not_run,
    )


def resume_jobs(
    cases: list[ResumeCase],
    settings: TrainSettings,
    on_row: Callable[[CaseResult], None],
) -> list[Job]:
    """One job per implementation: run its resume cases, report a row each through `on_row`."""
    by_impl: dict[str, list[ResumeCase]] = {}
    for case in cases:
        by_impl.setdefault(case.impl, []).append(case)
    return [
        Job(
            name=f"resume {impl}",
            processes=RESUME_PROCESSES[impl],
            cost=RESUME_COST_PER_CASE[impl] * len(group),
            run=functools.partial(_run_impl, impl, group, settings, on_row),
        )
        for impl, group in by_impl.items()
    ]


def _run_impl(
    impl: str,
    cases: list[ResumeCase],
    settings: TrainSettings,
    on_row: Callable[[CaseResult], None],
) -> None:
    def on_done(case: ResumeCase, result: ResumeOutput | BaseException) -> None:
        if isinstance(result, BaseException):
            row = resume_row(
                case,
                max_rel_err=float("inf"),
                ok=False,
                detail=f"{type(result).__name__}: {result}",
                not_run=True,
            )
        else:
            row = compare_resume(case, result, settings)
        on_row(row)

    try:
        runner = importlib.import_module(RESUME_RUNNERS[impl])
        runner.run_resume(cases, settings, on_done)
    except Exception as error:  # the runner itself failed: every case it had fails
        for case in cases:
            on_done(case, error)
