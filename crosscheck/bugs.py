"""The bug catalogue run: every BUGS.md pattern in every framework, detected and named.

Each buggy step (``torch_impl.bugs``, ``jax_impl.bugs``, described in `crosscheck.patterns`)
runs on its fixtures and layouts in real processes; its gradient goes through verification
(against the intended scheme, at the dtype's tolerance) and through the diagnosis, which must
name the pattern. The same run measures how small a distortion verification still flags: a
correct token-mean step whose rank 0 loss is scaled by a skew (``rank-skew``).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from crosscheck.catalogue import builtin_fixture
from crosscheck.compare import RTOL_BY_DTYPE, finite_or_none, tree_rel_err
from crosscheck.diagnose import Diagnosis, diagnose
from crosscheck.oracle import loss_and_grad, weighted_grad
from crosscheck.patterns import (
    CLIP_PER_MICROBATCH_NORM,
    NUM_WINDOWS,
    PATTERNS,
    RANK_SKEW,
    BugOutput,
    BugRun,
    catalogue_runs,
)
from crosscheck.schemes import get_scheme

_RUNNERS = {"torch": "crosscheck.runners.torch_bugs", "jax": "crosscheck.runners.jax_bugs"}

#: The distortion the issue asks to be flagged, and where the sensitivity is measured.
SKEW = 1.01
SKEW_FIXTURE, SKEW_LAYOUT = "ragged", (2, 1)


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
    scheme = get_scheme(intended_of(run))
    D = scheme.global_denominator(fixture.layout(R, M))
    return diagnose(
        fixture,
        R,
        M,
        output.grads,
        scheme.name,
        dtype=run.dtype,
        logged_denominator=output.logged_denominator,
        # Every step ran NUM_WINDOWS identical windows; the diagnosed one is the last.
        previous_denominators=(D,) * (NUM_WINDOWS - 1),
        max_grad_norm=CLIP_PER_MICROBATCH_NORM,
    )


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
        detected=d.detected,
        diagnosed_as=d.best_match,
        weight_ratio=d.weight_ratio,
        scale=d.scale,
        intended_error=d.intended_error,
        explanation=d.explanation,
    )


def skew_runs(frameworks: tuple[str, ...], minimum: dict[str, float]) -> list[BugRun]:
    """rank-skew per framework and dtype at: 1 (the noise floor), half and twice the minimum
    detectable skew's distance from 1 (bracketing it), and SKEW."""
    R, M = SKEW_LAYOUT
    return [
        BugRun(
            pattern=RANK_SKEW,
            framework=fw,
            fixture=SKEW_FIXTURE,
            world_size=R,
            accum_steps=M,
            dtype=dtype,
            skew=skew,
        )
        for fw in frameworks
        for dtype in ("float64", "float32")
        for skew in (
            1.0,
            1.0 + (minimum[dtype] - 1.0) / 2,
            1.0 + (minimum[dtype] - 1.0) * 2,
            SKEW,
        )
    ]


def minimum_detectable_skew(dtype: str) -> float:
    """Smallest s such that scaling rank 0's token weights by s fails verification.

    Scaling rank 0's share G_0 of the gradient by s moves every leaf by (s - 1) G_0, so the
    worst-leaf relative error is (s - 1) k with k = max over leaves of max|G_0| / max|G|:
    s_min = 1 + tol / k, in exact arithmetic; an implementation's own rounding (far below
    tol by construction of the tolerances) blurs it by at most that much.
    """
    fixture = builtin_fixture(SKEW_FIXTURE)
    R, M = SKEW_LAYOUT
    result = loss_and_grad(fixture, "token_mean", R, M)
    rank_of = np.repeat(np.arange(R), fixture.num_rows // R)[:, None]
    share = weighted_grad(
        fixture.params(), fixture.inputs, fixture.targets, result.token_weights * (rank_of == 0)
    )
    k = max(
        float(np.max(np.abs(share[key]))) / float(np.max(np.abs(result.grads[key])))
        for key in share
    )
    return 1.0 + RTOL_BY_DTYPE[dtype] / k


@dataclass(frozen=True, slots=True)
class SkewResult:
    run: BugRun
    rel_err: float  # against the intended token-mean gradient
    flagged: bool
    #: Verification should flag it: the skew is beyond the minimum detectable one.
    expected: bool


def judge_skew(
    run: BugRun, output: BugOutput | BaseException, minimum: dict[str, float]
) -> SkewResult:
    expected_flag = run.skew >= minimum[run.dtype]
    if isinstance(output, BaseException):
        return SkewResult(run, math.inf, False, expected_flag)
    fixture = builtin_fixture(run.fixture)
    expected = loss_and_grad(fixture, "token_mean", run.world_size, run.accum_steps).grads
    err = tree_rel_err(output.grads, expected).max_rel_err
    return SkewResult(run, err, not err <= RTOL_BY_DTYPE[run.dtype], expected_flag)


@dataclass(frozen=True, slots=True)
class CatalogueRun:
    results: list[BugResult]
    skews: list[SkewResult]
    minimum_skew: dict[str, float]

    @property
    def ok(self) -> bool:
        skew_ok = all(s.flagged == s.expected for s in self.skews)
        return all(r.ok for r in self.results) and skew_ok

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "results": [r.to_json() for r in self.results],
            "skew": {
                "fixture": SKEW_FIXTURE,
                "world_size": SKEW_LAYOUT[0],
                "accum_steps": SKEW_LAYOUT[1],
                "minimum_detectable": self.minimum_skew,
                "runs": [
                    {
                        "framework": s.run.framework,
                        "dtype": s.run.dtype,
                        "skew": s.run.skew,
                        "rel_err": finite_or_none(s.rel_err),
                        "flagged": s.flagged,
                        "expected": s.expected,
                    }
                    for s in self.skews
                ],
            },
        }


def run_catalogue(
    frameworks: tuple[str, ...] = ("torch", "jax"),
    patterns: Sequence[str] | None = None,
    outputs: Mapping[BugRun, BugOutput | BaseException] | None = None,
) -> CatalogueRun:
    """Run the catalogue (optionally some patterns only) and the skew runs, and judge them.

    `outputs`, when given, holds the steps' results already (tests share one run); runs it
    lacks are run now.
    """
    for name in patterns or ():
        if name not in PATTERNS:
            raise ValueError(f"unknown pattern {name!r}; known: {', '.join(PATTERNS)}")
    runs = [r for r in catalogue_runs(frameworks) if patterns is None or r.pattern in patterns]
    minimum = {dtype: minimum_detectable_skew(dtype) for dtype in ("float64", "float32")}
    skews = skew_runs(frameworks, minimum)
    known = dict(outputs or {})
    known.update(run_steps([run for run in runs + skews if run not in known]))
    outputs = known
    return CatalogueRun(
        results=[judge(run, outputs[run]) for run in runs],
        skews=[judge_skew(run, outputs[run], minimum) for run in skews],
        minimum_skew=minimum,
    )
