"""Verify a user's training step: does it weight tokens the way the intended scheme says?

`verify` runs the step (see `crosscheck.protocol` for what it is given and must return) on
several fixtures and layouts, in real processes, and compares every gradient with the
oracle's for the intended scheme at the dtype's tolerance; every gradient is also diagnosed.
Several layouts by default, because one layout can hide a weighting bug: a per-rank mean is
exact whenever every rank holds the same number of tokens, and a per-microbatch mean is
rank-mean at M = 1.

``assert_weighting`` is the pytest-friendly form: it raises AssertionError whose message is
the diagnosis.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from crosscheck.catalogue import builtin_fixture
from crosscheck.compare import FLOAT64_RTOL, finite_or_none
from crosscheck.diagnose import Diagnosis, diagnose
from crosscheck.protocol import StepError, VerifyJob, VerifyOutput
from crosscheck.schemes import get_scheme

FRAMEWORKS = {"torch": "crosscheck.runners.torch_verify", "jax": "crosscheck.runners.jax_verify"}
#: Two fixtures whose ranks and microbatches hold different token counts (so local means
#: differ from global ones) and one of them packed (so per-row is not per-sequence).
DEFAULT_FIXTURES: tuple[str, ...] = ("packed", "ragged")
#: Ranks alone, accumulation alone, both, and four ranks.
DEFAULT_LAYOUTS: tuple[tuple[int, int], ...] = ((2, 1), (1, 2), (2, 2), (4, 1))
DEFAULT_TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class VerifyCase:
    """The step on one fixture and layout: its error against the oracle and its diagnosis."""

    job: VerifyJob
    max_rel_err: float
    ok: bool
    diagnosis: Diagnosis | None
    error: str = ""  # the step could not be run or read: why

    def to_json(self) -> dict[str, Any]:
        return {
            "fixture": self.job.fixture,
            "world_size": self.job.world_size,
            "accum_steps": self.job.accum_steps,
            "max_rel_err": finite_or_none(self.max_rel_err),
            "ok": self.ok,
            "diagnosis": None if self.diagnosis is None else self.diagnosis.to_json(),
            "error": self.error,
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class VerifyReport:
    framework: str
    step: str
    scheme: str
    cases: list[VerifyCase] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.cases) and all(case.ok for case in self.cases)

    @property
    def max_rel_err(self) -> float:
        return max((case.max_rel_err for case in self.cases), default=math.inf)

    @property
    def diagnosis(self) -> Diagnosis | None:
        """The most telling case's diagnosis: a failing one if any, on a layout with both
        ranks and microbatches (only there are rank-mean and microbatch-mean different), then
        the largest layout, then the largest error."""
        diagnosed = [case for case in self.cases if case.diagnosis is not None]
        failing = [case for case in diagnosed if not case.ok] or diagnosed
        if not failing:
            return None
        best = max(
            failing,
            key=lambda c: (
                min(c.job.world_size, c.job.accum_steps) > 1,
                c.job.world_size * c.job.accum_steps,
                c.max_rel_err,
                c.job,
            ),
        )
        return best.diagnosis

    def message(self) -> str:
        """One paragraph: the verdict, the worst error, the diagnosis, any step errors."""
        verdict = "matches" if self.ok else "does NOT match"
        lines = [
            f"{self.step} ({self.framework}) {verdict} {self.scheme} on "
            f"{len(self.cases)} fixture/layout cases (worst relative error "
            f"{self.max_rel_err:.2e}, tolerance {FLOAT64_RTOL:.0e})."
        ]
        d = self.diagnosis
        if d is not None:
            lines.append(
                f"Diagnosis on {d.fixture} R={d.world_size} M={d.accum_steps}: "
                f"{d.best_match}. {d.explanation}"
            )
        lines += [f"{case.job.describe()}: {case.error}" for case in self.cases if case.error]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        d = self.diagnosis

        summary = {
            "best_match": "error" if d is None else d.best_match,
            "weight_ratio": None if d is None else finite_or_none(d.weight_ratio),
            "scale": None if d is None else finite_or_none(d.scale),
            "residual": None if d is None else finite_or_none(d.residual),
            "explanation": "" if d is None else d.explanation,
            "fixture": None if d is None else d.fixture,
            "world_size": None if d is None else d.world_size,
            "accum_steps": None if d is None else d.accum_steps,
        }
        return {
            "ok": self.ok,
            "framework": self.framework,
            "step": self.step,
            "scheme": self.scheme,
            "max_rel_err": finite_or_none(self.max_rel_err),
            "tolerance": FLOAT64_RTOL,
            "diagnosis": summary,
            "cases": [case.to_json() for case in self.cases],
            "errors": [case.error for case in self.cases if case.error],
        }


def step_name(step: str | Callable) -> str:
    """'module:function' for a step given by name or as an importable function."""
    if isinstance(step, str):
        module, sep, function = step.partition(":")
        if not sep or not module or not function:
            raise ValueError(f"a step is named MODULE:FUNCTION, got {step!r}")
        return step
    module = getattr(step, "__module__", None)
    qualname = getattr(step, "__qualname__", "")
    if not module or module == "__main__" or "<" in qualname:
        raise ValueError(
            f"the step {step!r} must be a module-level function of an importable module "
            "(it runs in fresh processes, which import it by name)"
        )
    return f"{module}:{qualname}"


def jobs_for(
    fixtures: Sequence[str] | None,
    world_sizes: Sequence[int] | None,
    accum_steps: Sequence[int] | None,
) -> list[VerifyJob]:
    """Every (fixture, R, M) asked for whose R M divides the fixture's rows."""
    names = list(fixtures or DEFAULT_FIXTURES)
    if world_sizes is None and accum_steps is None:
        layouts = list(DEFAULT_LAYOUTS)
    else:
        layouts = [(R, M) for R in world_sizes or (1, 2) for M in accum_steps or (1, 2)]
    jobs = []
    for name in names:
        rows = builtin_fixture(name).num_rows
        jobs += [
            VerifyJob(fixture=name, world_size=R, accum_steps=M)
            for R, M in layouts
            if rows % (R * M) == 0
        ]
    if not jobs:
        raise ValueError(f"no layout of {layouts} divides the rows of {', '.join(names)}")
    return jobs


def judge(job: VerifyJob, scheme: str, output: VerifyOutput | BaseException) -> VerifyCase:
    """Diagnose one gradient; the diagnosis holds its error against the intended scheme's
    oracle gradient and whether verification (float64 tolerance) fails."""
    if isinstance(output, BaseException):
        return VerifyCase(job, math.inf, False, None, f"{type(output).__name__}: {output}")
    fixture = builtin_fixture(job.fixture)
    try:
        d = diagnose(fixture, job.world_size, job.accum_steps, output.grads, scheme)
    except ValueError as error:  # wrong keys or shapes that got past the runner
        return VerifyCase(job, math.inf, False, None, f"StepError: {error}")
    return VerifyCase(job, d.intended_error, not d.detected, d)


def verify(
    step: str | Callable,
    *,
    framework: str,
    scheme: str,
    fixtures: Sequence[str] | None = None,
    world_sizes: Sequence[int] | None = None,
    accum_steps: Sequence[int] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> VerifyReport:
    """Run `step` (see crosscheck.protocol) on every fixture and layout and judge it.

    Layouts default to DEFAULT_LAYOUTS; given `world_sizes` and/or `accum_steps`, their
    product (the missing one defaults to (1, 2)). The report's `ok` is True only when every
    gradient matches the oracle's for `scheme` within float64 tolerance.
    """
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework must be one of {', '.join(FRAMEWORKS)}, got {framework!r}")
    scheme_name = get_scheme(scheme).name
    if not get_scheme(scheme_name).intended:
        raise ValueError(f"verify checks an intended scheme; {scheme_name!r} is accidental")
    name = step_name(step)
    jobs = jobs_for(fixtures, world_sizes, accum_steps)
    runner = importlib.import_module(FRAMEWORKS[framework])
    outputs = runner.run(name, jobs, timeout_s=timeout_s)
    cases = [
        judge(job, scheme_name, outputs.get(job, StepError("the runner returned nothing")))
        for job in jobs
    ]
    return VerifyReport(framework=framework, step=name, scheme=scheme_name, cases=cases)


def assert_weighting(step: str | Callable, **kwargs: Any) -> VerifyReport:
    """`verify(step, **kwargs)`, raising AssertionError with the diagnosis unless it matches."""
    report = verify(step, **kwargs)
    if not report.ok:
        raise AssertionError(report.message())
    return report
