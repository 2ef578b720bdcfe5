"""The bug catalogue run: every docs/bugs.md pattern in every framework, detected and named.

Each buggy step (``torch_impl.harness.bugs``, ``jax_impl.harness.bugs``, described in
`crosscheck.diagnosis.patterns`) runs on its fixtures and layouts in real processes; its gradient
goes through verification (against the intended scheme, at the precision its own noise shows) and
through the diagnosis, which must name the pattern. The same run measures how small a distortion
verification still flags: a correct token-mean step whose rank 0 loss is scaled by a skew
(``rank-skew``); the skew 1 run's measured noise gives the minimum detectable skew of its
framework and dtype, and the other skews must fall on the side of it they are on. The multi-term
rows (`crosscheck.bugs.objective_catalogue`) follow them; they run beside the single-term steps.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from crosscheck.bugs.objective_catalogue import (
    OBJECTIVE_PATTERNS,
    ObjectiveBugResult,
    run_objective_catalogue,
)
from crosscheck.bugs.objective_steps import ObjectiveBugRun, Outcome
from crosscheck.contract.schemes import resolve_scheme
from crosscheck.diagnosis.diagnose import Diagnosis, diagnose
from crosscheck.diagnosis.patterns import (
    CLIP_PER_MICROBATCH_NORM,
    NUM_WINDOWS,
    PATTERNS,
    PIPELINE_STAGE_PARAMS,
    RANK_SKEW,
    BugOutput,
    BugRun,
    catalogue_runs,
)
from crosscheck.fixtures.builtin import builtin_fixture
from crosscheck.judge.compare import finite_or_none

_RUNNERS = {"torch": "crosscheck.bugs.torch_bugs", "jax": "crosscheck.bugs.jax_bugs"}

#: The distortion every float64 and float32 run must flag, and where sensitivity is measured.
SKEW = 1.01
SKEW_FIXTURE, SKEW_LAYOUT = "ragged", (2, 1)
#: The rank-skew runs per dtype: 1 (the noise floor: the correct step, whose own noise gives
#: the measured minimum detectable skew), a skew about half the documented minimum's distance
#: from 1 (passes) and one about twice it (flagged), and SKEW. The brackets are fixed
#: numbers, not derived from the tolerances, so that a tolerance changed by mistake moves
#: the measured minimum out of them. Documented minimums (docs/bugs.md): float64 1 + 1.0e-12,
#: float32 1 + 1.02e-5, bf16 1 + 2.41e-2.
SKEWS: dict[str, tuple[float, ...]] = {
    "float64": (1.0, 1.0 + 5e-13, 1.0 + 2e-12, SKEW),
    "float32": (1.0, 1.0 + 5e-6, 1.0 + 2e-5, SKEW),
    # bf16 params: SKEW is below what bf16 can detect (a scalar rounded to 8 bits is already
    # 0.4% off), so it must pass; 1.05 must be flagged.
    "bfloat16": (1.0, SKEW, 1.05),
}
#: The dtypes at which a SKEW-sized distortion must be flagged.
SKEW_FLAGGED_AT: tuple[str, ...] = ("float64", "float32")


@dataclass(frozen=True, kw_only=True, slots=True)
class BugResult:
    """One catalogue row: a buggy step, whether verification caught it, what it was named."""

    run: BugRun
    detected: bool
    diagnosed_as: str
    weight_ratio: float
    scale: float
    intended_error: float
    explanation: str
    error: str = ""  # the step failed to run: why

    @property
    def ok(self) -> bool:
        return not self.error and self.detected and self.diagnosed_as == self.run.pattern

    def to_json(self) -> dict[str, Any]:
        return {
            "pattern": self.run.pattern,
            "framework": self.run.framework,
            "fixture": self.run.fixture,
            "world_size": self.run.world_size,
            "accum_steps": self.run.accum_steps,
            "context_size": self.run.context_size,
            "context_order": self.run.context_order,
            "pipeline_stages": self.run.pipeline_stages,
            "dtype": self.run.dtype,
            "detected": self.detected,
            "diagnosed_as": self.diagnosed_as,
            "weight_ratio": finite_or_none(self.weight_ratio),
            "scale": finite_or_none(self.scale),
            "intended_error": finite_or_none(self.intended_error),
            "ok": self.ok,
            "explanation": self.explanation,
            "error": self.error,
        }


def run_steps(runs: list[BugRun]) -> dict[BugRun, BugOutput | BaseException]:
    """Run every buggy step, one thread per framework (their work is in child processes)."""
    by_framework: dict[str, list[BugRun]] = {}
    for run in runs:
        if run.framework not in _RUNNERS:
            raise ValueError(f"{run.describe()}: framework must be torch or jax")
        by_framework.setdefault(run.framework, []).append(run)

    def run_framework(framework: str, group: list[BugRun]):
        try:
            return importlib.import_module(_RUNNERS[framework]).run(group)
        except Exception as error:  # a framework that cannot start fails its runs, by name
            return dict.fromkeys(group, error)

    results: dict[BugRun, BugOutput | BaseException] = {}
    with ThreadPoolExecutor(max_workers=max(1, len(by_framework))) as pool:
        for outcome in pool.map(lambda item: run_framework(*item), sorted(by_framework.items())):
            results.update(outcome)
    return results


def intended_of(run: BugRun) -> str:
    return "token_mean" if run.pattern == RANK_SKEW else PATTERNS[run.pattern].intended


def diagnose_run(run: BugRun, output: BugOutput) -> Diagnosis:
    """The diagnosis of a buggy step's second window, with what the harness knows of it."""
    fixture = builtin_fixture(run.fixture)
    R, M = run.world_size, run.accum_steps
    scheme = resolve_scheme(intended_of(run))
    D = scheme.global_denominator(fixture.layout(R, M))
    return diagnose(
        fixture,
        R,
        M,
        output.grads,
        scheme,
        context_size=run.context_size,
        context_order=run.context_order,
        # The catalogue's pipelines are the two-stage cut of the bilinear model.
        pipeline_stages=PIPELINE_STAGE_PARAMS if run.pipeline_stages > 1 else (),
        dtype=run.dtype,
        # Judged at the step's own dtype: the catalogue knows it, and its sensitivity figures
        # are each dtype's (an automatic verdict would accept a float64 step at float32-level).
        precision=run.dtype,
        logged_denominator=output.logged_denominator,
        # Every step ran NUM_WINDOWS identical windows; the diagnosed one is the last.
        previous_denominators=(D,) * (NUM_WINDOWS - 1),
        max_grad_norm=CLIP_PER_MICROBATCH_NORM,
        framework=run.framework,
    )


#: The fields of a catalogue row that are its diagnosis's, under the same names.
_FROM_DIAGNOSIS = ("detected", "weight_ratio", "scale", "intended_error", "explanation")


def judge(run: BugRun, output: BugOutput | BaseException) -> BugResult:
    if isinstance(output, BaseException):
        return BugResult(
            run=run,
            detected=False,
            diagnosed_as="-",
            weight_ratio=math.nan,
            scale=math.nan,
            intended_error=math.inf,
            explanation="",
            error=f"{type(output).__name__}: {output}",
        )
    d = diagnose_run(run, output)
    return BugResult(
        run=run,
        diagnosed_as=d.best_match,
        **{name: getattr(d, name) for name in _FROM_DIAGNOSIS},
    )


def skew_runs(frameworks: tuple[str, ...]) -> list[BugRun]:
    """rank-skew per framework and dtype at every skew of `SKEWS`."""
    R, M = SKEW_LAYOUT
    where = {"pattern": RANK_SKEW, "fixture": SKEW_FIXTURE, "world_size": R, "accum_steps": M}
    return [
        BugRun(**where, framework=fw, dtype=dtype, skew=skew)
        for fw in frameworks
        for dtype, skews in SKEWS.items()
        for skew in skews
    ]


@dataclass(frozen=True, slots=True)
class SkewResult:
    """One rank-skew run: flagged or not, against the measured minimum of its kind."""

    run: BugRun
    rel_err: float  # worst-leaf, against the intended token-mean gradient
    flagged: bool
    #: The precision the run was judged at, and what it was named.
    precision: str
    diagnosed_as: str
    #: The minimum detectable skew minus 1 of this framework and dtype, measured from the
    #: skew 1 run's own noise (``Diagnosis.detectable_skew``); nan when that run failed.
    minimum: float
    error: str = ""  # the step failed to run: why

    @property
    def expected(self) -> bool:
        """Verification should flag it: the skew is beyond the measured minimum."""
        return self.run.skew - 1.0 > self.minimum

    @property
    def ok(self) -> bool:
        named = not self.flagged or self.diagnosed_as == RANK_SKEW
        ran = not self.error and math.isfinite(self.minimum)
        return ran and self.flagged is self.expected and named


def measured_minimum(
    outputs: Mapping[BugRun, BugOutput | BaseException],
) -> dict[tuple[str, str], float]:
    """(framework, dtype) -> minimum detectable skew minus 1, from the skew 1 run's noise."""
    minimum = {}
    for run, output in outputs.items():
        if run.pattern != RANK_SKEW or run.skew != 1.0:
            continue
        value = math.nan
        if not isinstance(output, BaseException):
            d = diagnose_run(run, output)
            if d.detectable_skew is not None and not d.detected:
                value = d.detectable_skew[1]
        minimum[(run.framework, run.dtype)] = value
    return minimum


def judge_skew(
    run: BugRun, output: BugOutput | BaseException, minimum: Mapping[tuple[str, str], float]
) -> SkewResult:
    floor = minimum.get((run.framework, run.dtype), math.nan)
    if isinstance(output, BaseException):
        return SkewResult(
            run, math.inf, False, "-", "-", floor, f"{type(output).__name__}: {output}"
        )
    d = diagnose_run(run, output)
    return SkewResult(run, d.intended_error, d.detected, d.precision, d.best_match, floor)


@dataclass(frozen=True, slots=True)
class CatalogueRun:
    results: list[BugResult]
    skews: list[SkewResult]
    #: (framework, dtype) -> measured minimum detectable skew minus 1.
    minimum_skew: dict[tuple[str, str], float]
    #: The multi-term rows, after the single-term ones.
    objectives: list[ObjectiveBugResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in [*self.results, *self.skews, *self.objectives])

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "results": [r.to_json() for r in self.results],
            "objective_results": [r.to_json() for r in self.objectives],
            "skew": {
                "fixture": SKEW_FIXTURE,
                "world_size": SKEW_LAYOUT[0],
                "accum_steps": SKEW_LAYOUT[1],
                "minimum_detectable": [
                    {"framework": fw, "dtype": dtype, "minus_one": finite_or_none(value)}
                    for (fw, dtype), value in sorted(self.minimum_skew.items())
                ],
                "runs": [
                    {
                        "framework": s.run.framework,
                        "dtype": s.run.dtype,
                        "skew": s.run.skew,
                        "rel_err": finite_or_none(s.rel_err),
                        "precision": s.precision,
                        "flagged": s.flagged,
                        "expected": s.expected,
                        "diagnosed_as": s.diagnosed_as,
                        "error": s.error,
                    }
                    for s in self.skews
                ],
            },
        }


def _on_fixtures(runs: list[BugRun], fixtures: Sequence[str]) -> list[BugRun]:
    """The catalogue's runs moved onto `fixtures` (names or .npz paths): every pattern at each
    of its layouts that divides a fixture's rows. Whether the name still comes out is what
    such a run shows: a fixture on which two patterns coincide cannot name them apart."""
    moved: dict[BugRun, None] = {}
    for run in runs:
        for name in fixtures:
            fixture = builtin_fixture(name)
            if run.layout.divides(fixture.num_rows) and run.layout.splits(fixture.seq_len):
                moved[replace(run, fixture=name)] = None
    if not moved:
        layouts = sorted({str(r.layout) for r in runs})
        raise ValueError(
            f"no layout of the catalogue ({', '.join(layouts)}) divides the rows and positions "
            f"of {', '.join(fixtures)}"
        )
    return list(moved)


def run_catalogue(
    frameworks: tuple[str, ...] = ("torch", "jax"),
    patterns: Sequence[str] | None = None,
    outputs: Mapping[BugRun, BugOutput | BaseException] | None = None,
    fixtures: Sequence[str] | None = None,
    objective_outputs: Mapping[ObjectiveBugRun, Outcome] | None = None,
) -> CatalogueRun:
    """Run the catalogue (optionally some patterns only) and the skew runs, and judge them.

    `fixtures` (built-in names or fixture .npz paths) replace the catalogue's own fixtures:
    each pattern runs at its layouts that divide them (the skew runs stay on their own
    fixture: they measure sensitivity). `outputs`, when given, holds the steps' results
    already (tests share one run); runs it lacks are run now. Every planned run must come
    back: one that does not is a failure row saying so, never a silent gap. The multi-term
    rows (`patterns` may name them too; `objective_outputs` as `outputs`) stay on their own
    fixture and layouts, and run in a thread beside the single-term steps.
    """
    for name in patterns or ():
        if name not in PATTERNS and name not in OBJECTIVE_PATTERNS:
            known = ", ".join([*PATTERNS, *OBJECTIVE_PATTERNS])
            raise ValueError(f"unknown pattern {name!r}; known: {known}")
    for framework in frameworks:
        if framework not in _RUNNERS:
            raise ValueError(f"unknown framework {framework!r}; known: {', '.join(_RUNNERS)}")
    runs = [r for r in catalogue_runs(frameworks) if patterns is None or r.pattern in patterns]
    if fixtures and runs:
        runs = _on_fixtures(runs, fixtures)
    if not runs and not (patterns is None or set(patterns) & set(OBJECTIVE_PATTERNS)):
        raise ValueError(
            f"no catalogue run for patterns {', '.join(patterns or ())} in "
            f"{', '.join(frameworks)}: nothing would be checked"
        )
    skews = skew_runs(frameworks)
    known = dict(outputs or {})
    with ThreadPoolExecutor(max_workers=1) as pool:
        # Every launch and worker it starts is bounded (crosscheck.bugs.objective_steps).
        rows = pool.submit(run_objective_catalogue, frameworks, patterns, objective_outputs)
        known.update(run_steps([run for run in runs + skews if run not in known]))
        objective_rows = rows.result()
    missing = RuntimeError("planned but never reported by its runner")
    outputs = {run: known.get(run, missing) for run in runs + skews}
    minimum = measured_minimum(outputs)
    return CatalogueRun(
        results=[judge(run, outputs[run]) for run in runs],
        skews=[judge_skew(run, outputs[run], minimum) for run in skews],
        minimum_skew=minimum,
        objectives=objective_rows,
    )
