"""The main job: build the case matrix, run every implementation on it, and check the results.

Each framework's runner turns its cases into jobs that reuse processes: one torch process
group per world size, one JAX worker per in-process front-end and world size, one multi-process
JAX launch per world size, one resume round trip per framework. `crosscheck.launch.schedule` runs
the jobs side by side on the machine's cores. The rows that come back are compared with the oracle
as they arrive; rows across cases (implementations against each other, world-size change)
follow.

Nothing is dropped silently. `Plan.build` lists every combination of the plan's product that
does not run, with the reason (a layout that does not divide the fixture, a strategy an
implementation has no way to run), and refuses a plan that would run nothing at all, or in
which a value the user named explicitly (`Plan.explicit`) runs in no case. After the run,
every planned case, resume case and oracle row that never came back becomes a failing row.
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from crosscheck.contract.cases import (
    Case,
    CaseOutput,
    CaseResult,
    RankMetrics,
    SkippedCase,
    TrainSettings,
)
from crosscheck.fixtures.builtin import builtin_fixture
from crosscheck.judge.clipping import clip_placement, clip_strategy
from crosscheck.judge.invariance import layout_invariance
from crosscheck.launch.schedule import Job, JobTiming, run_jobs
from crosscheck.run import (
    context_jax,
    context_parallel,
    context_torch,
    objective_jax,
    objective_torch,
)
from crosscheck.run.implementations import framework_of, runner_for
from crosscheck.run.objectives import (
    OBJECTIVE_FIXTURES,
    OBJECTIVES,
    ObjectiveCase,
    ObjectiveOutput,
    compare_objective,
    objective_cases,
    planned_term_layout_rows,
    term_layout_rows,
    term_log_records,
)
from crosscheck.run.plan import WORLD_SIZE_CHANGE_FAMILY, Plan
from crosscheck.run.resume import resume_jobs, resume_row
from crosscheck.run.rows import (
    compare_with_oracle,
    cross_implementation,
    failed_case,
    missing_rows,
    world_size_change,
)

#: Clip-placement rows use the token mean with a threshold that some microbatches exceed on
#: every fixture (their norms run 0.04 to 0.35) and one above every update norm (<= 0.44),
#: where both placements must agree.
CLIP_THRESHOLDS: tuple[float, ...] = (0.15, 1.0)

#: The implementations that compute the multi-term objectives (`crosscheck.run.objectives`).
OBJECTIVE_IMPLS: tuple[str, ...] = (objective_jax.IMPL, objective_torch.IMPL)

#: The detail of a failing row for work that was planned and never came back.
NEVER_REPORTED = "planned but never reported: no output and no error came back for it"


@dataclass
class MatrixRun:
    rows: list[CaseResult]
    outputs: dict[Case, CaseOutput]
    timings: list[JobTiming] = field(default_factory=list)
    #: What the plan's product names but does not run, and why.
    skipped: list[SkippedCase] = field(default_factory=list)
    #: Per term of every objective case: loss, count and denominators (the update log).
    term_logs: list[dict] = field(default_factory=list)

    def metrics(self) -> list[tuple[Case, RankMetrics]]:
        return [(case, m) for case, out in sorted(self.outputs.items()) for m in out.metrics]


def run_matrix(
    plan: Plan, on_progress: Callable[[int, int, Case | None], None] | None = None
) -> MatrixRun:
    """Run the plan; `on_progress(done, total, case)` is called as cases finish.

    Raises PlanError (before any process starts) when the plan would run nothing or a value
    it names explicitly runs in no case. Every planned case, resume case and oracle row that
    does not come back, or comes back twice, becomes a failing row.
    """
    build = plan.build()
    cases = build.cases
    planned = set(cases)
    rows: list[CaseResult] = []
    outputs: dict[Case, CaseOutput] = {}
    reported: Counter[Case] = Counter()
    lock = threading.Lock()
    done = 0

    def on_done(case: Case, result: CaseOutput | BaseException) -> None:
        nonlocal done
        row = _judge(case, result, plan.settings.for_dtype(case.dtype))
        with lock:
            reported[case] += 1
            if case not in planned:
                row = failed_case(case, "reported by its runner but never planned", False)
            elif reported[case] > 1:
                row = failed_case(case, f"reported {reported[case]} times by its runner", False)
            else:
                done += 1
                if not isinstance(result, BaseException):
                    outputs[case] = result
            rows.append(row)
            if on_progress is not None:
                on_progress(done, len(cases), case)

    resume_rows: list[CaseResult] = []

    def on_resume_row(row: CaseResult) -> None:
        with lock:
            resume_rows.append(row)

    # One group per framework and dtype: each dtype trains with its own settings
    # (TrainSettings.for_dtype: bf16 with SGD).
    by_framework: dict[tuple[str, str], list[Case]] = {}
    for case in cases:
        by_framework.setdefault((framework_of(case.impl), case.dtype), []).append(case)
    jobs = [
        job
        for (framework, dtype), group in sorted(by_framework.items())
        for job in runner_for(framework).jobs(group, plan.settings.for_dtype(dtype), on_done)
    ]
    jobs += resume_jobs(build.resume_cases, plan.settings, on_resume_row)
    objective_rows: list[CaseResult] = []
    term_logs: list[dict] = []
    # The objectives are float64 (the oracle's closed form is their reference).
    objectives = plan.objectives and "float64" in plan.dtypes
    planned_objectives = (
        objective_cases([i for i in plan.impls if i in OBJECTIVE_IMPLS]) if objectives else []
    )

    def on_objective(case: ObjectiveCase, output: ObjectiveOutput | BaseException) -> None:
        try:
            row = compare_objective(case, output)
        except Exception as error:  # an output that cannot be compared fails its own row
            row = compare_objective(case, error)
            output = error
        with lock:
            objective_rows.append(row)
            if not isinstance(output, BaseException):
                term_logs.extend(term_log_records(case, output))

    for runner in (objective_jax, objective_torch):
        jobs += runner.jobs([c for c in planned_objectives if c.impl == runner.IMPL], on_objective)
    context_rows: list[CaseResult] = []
    # Float64 too: the oracle's closed form is their reference.
    context = plan.context_parallel and "float64" in plan.dtypes
    planned_context = context_parallel.context_cases(plan.impls) if context else []

    def on_context(
        case: context_parallel.ContextCase,
        output: context_parallel.ContextOutput | BaseException,
    ) -> None:
        try:
            row = context_parallel.compare_context(case, output)
        except Exception as error:  # an output that cannot be compared fails its own row
            row = context_parallel.compare_context(case, error)
        with lock:
            context_rows.append(row)

    for context_runner in (context_jax, context_torch):
        jobs += context_runner.jobs(planned_context, on_context)
    oracle_rows: list[CaseResult] = []
    oracle_errors: list[BaseException] = []
    if build.oracle_layouts or ((objectives or planned_context) and "oracle" in plan.impls):

        def oracle_job() -> None:
            try:
                oracle_rows.extend(_oracle_rows(plan, build.oracle_layouts))
                if objectives:
                    oracle_rows.extend(term_layout_rows(list(OBJECTIVES), OBJECTIVE_FIXTURES))
                if planned_context and "oracle" in plan.impls:
                    invariance = context_parallel.invariance_rows()
                    with lock:
                        context_rows.extend(invariance)
            except Exception as error:  # its rows fail below, by name, with this error
                oracle_errors.append(error)

        # The oracle's own rows (float64 numpy, under a second) in this process, while the
        # jobs' work happens in their child processes.
        jobs.append(Job("oracle rows", 1, 1.0, oracle_job))
    if on_progress is not None:
        on_progress(0, len(cases), None)
    timings = run_jobs(jobs)
    # Bookkeeping, one way for every family: each planned item's row as it reads when the
    # item never reported; those no runner answered stand in the rows by name.
    rows += missing_rows((failed_case(case, NEVER_REPORTED) for case in cases), rows)
    oracle_detail = (
        f"{NEVER_REPORTED} ({type(oracle_errors[0]).__name__}: {oracle_errors[0]})"
        if oracle_errors
        else NEVER_REPORTED
    )
    expected_oracle = _planned_oracle_rows(plan, build.oracle_layouts, oracle_detail)
    if objectives and "oracle" in plan.impls:
        expected_oracle += planned_term_layout_rows(
            list(OBJECTIVES), OBJECTIVE_FIXTURES, oracle_detail
        )
    oracle_rows += missing_rows(expected_oracle, oracle_rows)
    resume_rows += missing_rows(
        (
            resume_row(case, max_rel_err=math.inf, ok=False, detail=NEVER_REPORTED, not_run=True)
            for case in build.resume_cases
        ),
        resume_rows,
    )
    rows[:0] = oracle_rows
    objective_rows += missing_rows(
        (compare_objective(case, RuntimeError(NEVER_REPORTED)) for case in planned_objectives),
        objective_rows,
    )
    rows.extend(objective_rows)
    context_rows += missing_rows(
        context_parallel.planned_rows(
            planned_context, with_oracle="oracle" in plan.impls, detail=NEVER_REPORTED
        ),
        context_rows,
    )
    rows.extend(context_rows)
    rows.extend(resume_rows)
    rows.extend(cross_implementation(outputs))
    if plan.world_size_change:
        rows.extend(world_size_change(outputs, [WORLD_SIZE_CHANGE_FAMILY]))
    return MatrixRun(
        rows=rows,
        outputs=outputs,
        timings=timings,
        skipped=build.skipped,
        term_logs=term_logs,
    )


def _judge(case: Case, result: CaseOutput | BaseException, settings: TrainSettings) -> CaseResult:
    """The case's row; an output that cannot even be compared (wrong keys or shapes) fails."""
    if isinstance(result, BaseException):
        return failed_case(case, result)
    try:
        return compare_with_oracle(case, result, settings)
    except Exception as error:
        return failed_case(case, f"its output could not be compared with the oracle: {error}")


def _oracle_rows(plan: Plan, layouts: dict[str, list[tuple[int, int]]]) -> list[CaseResult]:
    """Layout invariance of every scheme and clip placement, from the oracle alone."""
    rows: list[CaseResult] = []
    schemes = plan.schemes_by_fixture()
    for fixture, fixture_layouts in layouts.items():
        for scheme in schemes[fixture]:
            rows.extend(layout_invariance(builtin_fixture(fixture), scheme, fixture_layouts))
        for max_norm in CLIP_THRESHOLDS:
            rows.extend(
                clip_placement(builtin_fixture(fixture), "token_mean", R, M, max_norm)
                for R, M in fixture_layouts
                if R * M > 1
            )
    return rows


def _planned_oracle_rows(
    plan: Plan, layouts: dict[str, list[tuple[int, int]]], detail: str
) -> list[CaseResult]:
    """The rows `_oracle_rows` is to produce, as they read when it produced none: a
    layout-invariance row per scheme at every layout, a clipping row per threshold at every
    layout of more than one microbatch."""

    def row(check: str, fixture: str, scheme: str, strategy: str, R: int, M: int) -> CaseResult:
        return CaseResult(
            check=check,
            fixture=fixture,
            scheme=scheme,
            impl="oracle",
            strategy=strategy,
            world_size=R,
            accum_steps=M,
            dtype="float64",
            max_rel_err=math.inf,
            ok=False,
            reference="oracle",
            detail=detail,
            not_run=True,
        )

    rows = []
    schemes = plan.schemes_by_fixture()
    for fixture, fixture_layouts in layouts.items():
        for R, M in fixture_layouts:
            rows += [
                row("layout-invariance", fixture, scheme, "closed-form", R, M)
                for scheme in schemes[fixture]
            ]
            if R * M > 1:
                rows += [
                    row("clipping", fixture, "token_mean", clip_strategy(c), R, M)
                    for c in CLIP_THRESHOLDS
                ]
    return rows
