"""The main job: build the case matrix, run every implementation on it, and check the results.

Each framework's runner turns its cases into jobs that reuse processes: one torch process
group per world size, one JAX worker per in-process front-end and world size, one multi-process
JAX launch per world size, one resume round trip per framework. `crosscheck.schedule` runs the
jobs side by side on the machine's cores. The rows that come back are compared with the oracle
as they arrive; rows across cases (implementations against each other, world-size change)
follow.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from crosscheck.cases import STRATEGIES, Case, CaseOutput, CaseResult, RankMetrics, TrainSettings
from crosscheck.catalogue import BUILTIN_FIXTURES, builtin_fixture
from crosscheck.clipping import clip_placement
from crosscheck.harness import (
    compare_with_oracle,
    cross_implementation,
    failed_case,
    world_size_change,
)
from crosscheck.invariance import layout_invariance
from crosscheck.resume import default_cases, resume_jobs
from crosscheck.runners import IMPLEMENTATIONS, framework_of, runner_for
from crosscheck.schedule import Job, JobTiming, run_jobs
from crosscheck.schemes import SCHEMES, get_scheme

#: Clip-placement rows use the token mean with a threshold that some microbatches exceed on
#: every fixture (their norms run 0.04 to 0.35) and one above every update norm (<= 0.44),
#: where both placements must agree.
CLIP_THRESHOLDS: tuple[float, ...] = (0.15, 1.0)

#: Layouts of the same global batch with R x M = 4: losing half the ranks and doubling the
#: accumulation must not change an intended scheme's update.
WORLD_SIZE_CHANGE_FAMILY: tuple[tuple[int, int], ...] = ((1, 4), (2, 2), (4, 1))


@dataclass(kw_only=True)
class Plan:
    """What to run; defaults are the default matrix of `python -m crosscheck run`."""

    fixtures: list[str] = field(default_factory=lambda: list(BUILTIN_FIXTURES))
    schemes: list[str] = field(default_factory=lambda: list(SCHEMES))
    impls: list[str] = field(default_factory=lambda: ["oracle", *IMPLEMENTATIONS])
    world_sizes: list[int] = field(default_factory=lambda: [1, 2, 4])
    accum_steps: list[int] = field(default_factory=lambda: [1, 2])
    strategies: list[str] = field(default_factory=lambda: list(STRATEGIES))
    dtypes: list[str] = field(default_factory=lambda: ["float64"])
    world_size_change: bool = True
    resume: bool = True
    #: Schemes of the resume rows (each resume case costs two process starts per framework).
    resume_schemes: list[str] = field(default_factory=lambda: ["token_mean", "sequence_mean"])
    #: Fixtures of the resume rows (those also in `fixtures`): by default the four of shape
    #: (8, 64). What a resume can get wrong (partial window sums, optimizer state, the global
    #: denominator across a world-size change) shows on any of them, and one shape means one
    #: set of compiled JAX programs; ragged's 144 rows would add a third of the resume time
    #: and no new way to fail. `crosscheck run --fixture` sets both lists.
    resume_fixtures: list[str] = field(
        default_factory=lambda: ["packed", "empty-rank", "multimodal", "soft-weights"]
    )
    settings: TrainSettings = field(default_factory=TrainSettings)

    def validate(self) -> None:
        """Raise ValueError naming the first unknown name."""
        for name in [*self.fixtures, *self.resume_fixtures]:
            builtin_fixture(name)
        for name in self.schemes:
            get_scheme(name)
        for impl in self.impls:
            if impl != "oracle":
                framework_of(impl)
        for strategy in self.strategies:
            if strategy not in STRATEGIES:
                raise ValueError(f"unknown strategy {strategy!r}; known: {', '.join(STRATEGIES)}")
        for dtype in self.dtypes:
            if dtype not in ("float64", "float32"):
                raise ValueError(f"dtype must be float64 or float32, got {dtype!r}")

    def layouts(self, fixture: str) -> list[tuple[int, int]]:
        """The (R, M) of the plan that divide the fixture, plus the world-size-change family."""
        num_rows = builtin_fixture(fixture).num_rows
        wanted = {(R, M) for R in self.world_sizes for M in self.accum_steps}
        if self.world_size_change:
            wanted |= set(WORLD_SIZE_CHANGE_FAMILY)
        return sorted(layout for layout in wanted if num_rows % (layout[0] * layout[1]) == 0)

    def cases(self) -> list[Case]:
        cases = []
        for impl in self.impls:
            if impl == "oracle":
                continue
            supports = runner_for(framework_of(impl)).supports
            for fixture in self.fixtures:
                for R, M in self.layouts(fixture):
                    for scheme in self.schemes:
                        # An accidental scheme has no strategy: it is the naive loop itself.
                        strategies = self.strategies if get_scheme(scheme).intended else ["naive"]
                        for strategy in strategies:
                            for dtype in self.dtypes:
                                case = Case(
                                    impl=impl,
                                    fixture=fixture,
                                    scheme=scheme,
                                    strategy=strategy,
                                    world_size=R,
                                    accum_steps=M,
                                    dtype=dtype,
                                )
                                if supports(case):
                                    cases.append(case)
        return cases


@dataclass
class MatrixRun:
    rows: list[CaseResult]
    outputs: dict[Case, CaseOutput]
    timings: list[JobTiming] = field(default_factory=list)

    def metrics(self) -> list[tuple[Case, RankMetrics]]:
        return [(case, m) for case, out in sorted(self.outputs.items()) for m in out.metrics]


def run_matrix(
    plan: Plan, on_progress: Callable[[int, int, Case | None], None] | None = None
) -> MatrixRun:
    """Run the plan; `on_progress(done, total, case)` is called as cases finish."""
    plan.validate()
    rows: list[CaseResult] = []
    cases = plan.cases()
    outputs: dict[Case, CaseOutput] = {}
    lock = threading.Lock()
    done = 0

    def on_done(case: Case, result: CaseOutput | BaseException) -> None:
        nonlocal done
        row = (
            failed_case(case, result)
            if isinstance(result, BaseException)
            else compare_with_oracle(case, result, plan.settings)
        )
        with lock:
            rows.append(row)
            if not isinstance(result, BaseException):
                outputs[case] = result
            done += 1
            if on_progress is not None:
                on_progress(done, len(cases), case)

    def on_resume_row(row: CaseResult) -> None:
        with lock:
            rows.append(row)

    by_framework: dict[str, list[Case]] = {}
    for case in cases:
        by_framework.setdefault(framework_of(case.impl), []).append(case)
    jobs = [
        job
        for framework, group in sorted(by_framework.items())
        for job in runner_for(framework).jobs(group, plan.settings, on_done)
    ]
    if plan.resume:
        resume_cases = default_cases(
            plan.impls,
            [name for name in plan.fixtures if name in plan.resume_fixtures],
            [name for name in plan.resume_schemes if name in plan.schemes],
            plan.strategies,
        )
        jobs += resume_jobs(resume_cases, plan.settings, on_resume_row)
    oracle_rows: list[CaseResult] = []
    if "oracle" in plan.impls:
        # The oracle's own rows (float64 numpy, under a second) in this process, while the
        # jobs' work happens in their child processes.
        jobs.append(Job("oracle rows", 1, 1.0, lambda: oracle_rows.extend(_oracle_rows(plan))))
    if on_progress is not None:
        on_progress(0, len(cases), None)
    timings = run_jobs(jobs)
    rows[:0] = oracle_rows
    rows.extend(cross_implementation(outputs))
    if plan.world_size_change:
        rows.extend(world_size_change(outputs, [WORLD_SIZE_CHANGE_FAMILY]))
    return MatrixRun(rows=rows, outputs=outputs, timings=timings)


def _oracle_rows(plan: Plan) -> list[CaseResult]:
    """Layout invariance of every scheme and clip placement, from the oracle alone."""
    rows: list[CaseResult] = []
    for fixture in plan.fixtures:
        layouts = [
            (R, M)
            for R, M in plan.layouts(fixture)
            if R in plan.world_sizes and M in plan.accum_steps
        ]
        for scheme in plan.schemes:
            rows.extend(layout_invariance(builtin_fixture(fixture), scheme, layouts))
        for max_norm in CLIP_THRESHOLDS:
            rows.extend(
                clip_placement(builtin_fixture(fixture), "token_mean", R, M, max_norm)
                for R, M in layouts
                if R * M > 1
            )
    return rows
