r"""The multi-term rows of the bug catalogue: each docs/bugs.md objective pattern, named.

An objective of several terms can be wrong while every term on its own is right: one
auxiliary term k is weighted against the main term in a way the objective did not mean
(docs/bugs.md, "Multi-term objectives"). Each pattern runs as a buggy step of each framework
(`crosscheck.bugs.objective_steps`) on the ``packed`` fixture at layouts where it shows:

* (R, M) = (2, 2): R M > 1, so a term normalized per microbatch (sibling-term-scope), or from
  microbatch-local routing statistics (aux-global-count-local-stats), differs from the
  update's normalization, and R > 1 for the world-size factor;
* (4, 1): the same across ranks only, without accumulation.

shifted-aux-count (scale n'/n) and aux-coefficient-twice (scale λ_k) show at every layout.

aux-summed-over-microbatches hits a term meant per microbatch (a MoE model's own router loss,
meant as the mean over the update's R M forwards), which `TERMS` has none of: it runs on its
own objective, `MICROBATCH_TERMS`, the same four terms with moe_lb at ``microbatch`` scope, so
that every other row keeps `TERMS`. Its factor R M is aux-world-size-factor's R wherever M = 1
(the diagnosis calls (4, 1) ``ambiguous``, both names fitting), and at R = 1 only the missing
1 / M shows, not the DDP factor: it runs at (2, 2) and (2, 4) (one ``packed`` row per
microbatch), where R M is neither R nor M, so that no row claims a name its layout cannot show.

Each gradient g goes to `diagnose_objective`, which fits it on the numpy oracle's per-term and
per-(term, microbatch) gradients: a row is *detected* when the intended objective does not
fit (worst-leaf error or a unit weight off beyond 1e-12 plus the noise), and *named* when the
one minimal explanation left is the pattern on the right term, e.g.
``sibling-term-scope(z_loss)``. A pattern not named is a failure of the ``bugs`` command.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from crosscheck.bugs.objective_steps import (
    ObjectiveBugRun,
    Outcome,
    frozen_terms,
    run_jax,
    run_torch,
)
from crosscheck.diagnosis.objective_diagnosis import diagnose_objective
from crosscheck.fixtures.builtin import builtin_fixture
from crosscheck.fixtures.objective_params import TOP_K, objective_params
from crosscheck.judge.compare import finite_or_none

#: The objective every pattern hits one term of: a main cross-entropy and three auxiliaries
#: of different kinds, so that each pattern has a term it is written for.
TERMS: tuple[dict[str, Any], ...] = (
    {"kind": "ce"},
    {"kind": "z_loss", "coefficient": 0.1},
    {"kind": "mtp", "coefficient": 0.3},
    {"kind": "moe_lb", "coefficient": 0.5, "top_k": TOP_K},
)
#: pattern -> the term it hits: a per-token token-mean term for the scope, the rolled mask's
#: mtp for the count, moe_lb (computed replicated, or from local statistics) for the MoE two.
OBJECTIVE_PATTERNS: dict[str, str] = {
    "sibling-term-scope": "z_loss",
    "shifted-aux-count": "mtp",
    "aux-world-size-factor": "moe_lb",
    "aux-global-count-local-stats": "moe_lb",
    # λ = 0.1 is no world size: the diagnosis cannot mistake it for aux-world-size-factor.
    "aux-coefficient-twice": "z_loss",
    # The router loss of each forward (microbatch scope), x R and never / M: x R M.
    "aux-summed-over-microbatches": "moe_lb",
}
#: `TERMS` with moe_lb per microbatch (micro-batch load balancing, as a MoE model computes its
#: router loss in its own forward): what aux-summed-over-microbatches weighs wrongly.
MICROBATCH_TERMS: tuple[dict[str, Any], ...] = tuple(
    {**term, "scope": "microbatch"} if term["kind"] == "moe_lb" else term for term in TERMS
)
#: pattern -> its objective, where not `TERMS`.
PATTERN_TERMS: dict[str, tuple[dict[str, Any], ...]] = {
    "aux-summed-over-microbatches": MICROBATCH_TERMS,
}
FIXTURE = "packed"
LAYOUTS: tuple[tuple[int, int], ...] = ((2, 2), (4, 1))
#: pattern -> its layouts, where not `LAYOUTS`: R > 1 and M > 1, so that x R M is neither the
#: world-size factor x R (M = 1) nor a plain x M.
PATTERN_LAYOUTS: dict[str, tuple[tuple[int, int], ...]] = {
    "aux-summed-over-microbatches": ((2, 2), (2, 4)),
}
_RUNNERS = {"torch": run_torch, "jax": run_jax}


@dataclass(frozen=True, kw_only=True, slots=True)
class ObjectiveBugResult:
    """One multi-term catalogue row: detected (intended does not fit) and what it was named."""

    run: ObjectiveBugRun
    detected: bool
    diagnosed_as: str
    #: Worst-leaf relative error of the intended objective's gradient.
    intended_error: float
    #: Worst-leaf relative error of the pattern's own prediction (inf when not a candidate).
    pattern_error: float
    explanation: str
    error: str = ""  # the step failed to run: why

    @property
    def ok(self) -> bool:
        return not self.error and self.detected and self.diagnosed_as == self.run.named

    def to_json(self) -> dict[str, Any]:
        return {
            "pattern": self.run.pattern,
            "target": self.run.target,
            "framework": self.run.framework,
            "fixture": self.run.fixture,
            "world_size": self.run.world_size,
            "accum_steps": self.run.accum_steps,
            "detected": self.detected,
            "diagnosed_as": self.diagnosed_as,
            "expected": self.run.named,
            "intended_error": finite_or_none(self.intended_error),
            "pattern_error": finite_or_none(self.pattern_error),
            "ok": self.ok,
            "explanation": self.explanation,
            "error": self.error,
        }


def terms_of(pattern: str) -> tuple[dict[str, Any], ...]:
    """The objective `pattern` runs on."""
    return PATTERN_TERMS.get(pattern, TERMS)


def layouts_of(pattern: str) -> tuple[tuple[int, int], ...]:
    """The (R, M) layouts `pattern` runs at: where it shows and only it fits."""
    return PATTERN_LAYOUTS.get(pattern, LAYOUTS)


def objective_runs(
    frameworks: Sequence[str] = ("torch", "jax"), patterns: Sequence[str] | None = None
) -> list[ObjectiveBugRun]:
    """Every (pattern, framework, layout) of the multi-term catalogue, optionally some
    patterns only (names not among `OBJECTIVE_PATTERNS` are ignored: the single-term
    catalogue's)."""
    for framework in frameworks:
        if framework not in _RUNNERS:
            raise ValueError(f"unknown framework {framework!r}; known: {', '.join(_RUNNERS)}")
    return [
        ObjectiveBugRun(
            pattern=pattern,
            target=target,
            framework=framework,
            fixture=FIXTURE,
            world_size=R,
            accum_steps=M,
            terms=frozen_terms(terms_of(pattern)),
        )
        for pattern, target in OBJECTIVE_PATTERNS.items()
        if patterns is None or pattern in patterns
        for framework in frameworks
        for R, M in layouts_of(pattern)
    ]


def run_objective_steps(runs: Sequence[ObjectiveBugRun]) -> dict[ObjectiveBugRun, Outcome]:
    """Every run's gradient or error; the frameworks side by side (their work is in child
    processes), each in its own thread so that one failing to start fails only its runs."""
    by_framework: dict[str, list[ObjectiveBugRun]] = {}
    for run in runs:
        by_framework.setdefault(run.framework, []).append(run)

    def one(framework: str, group: list[ObjectiveBugRun]) -> dict[ObjectiveBugRun, Outcome]:
        try:
            return _RUNNERS[framework](group)
        except Exception as error:  # e.g. a framework that cannot be imported
            return dict.fromkeys(group, error)

    outcomes: dict[ObjectiveBugRun, Outcome] = {}
    with ThreadPoolExecutor(max_workers=max(1, len(by_framework))) as pool:
        for result in pool.map(lambda item: one(*item), sorted(by_framework.items())):
            outcomes.update(result)
    return outcomes


def judge_objective(run: ObjectiveBugRun, outcome: Outcome) -> ObjectiveBugResult:
    """The row of one run: its gradient diagnosed against the whole objective."""
    if isinstance(outcome, BaseException):
        return ObjectiveBugResult(
            run=run,
            detected=False,
            diagnosed_as="-",
            intended_error=math.inf,
            pattern_error=math.inf,
            explanation="",
            error=f"{type(outcome).__name__}: {outcome}",
        )
    fixture = builtin_fixture(run.fixture)
    layout = fixture.layout(run.world_size, run.accum_steps)
    d = diagnose_objective(objective_params(fixture), layout, run.term_dicts, outcome)
    return ObjectiveBugResult(
        run=run,
        detected=not d.intended_fits,
        diagnosed_as=d.best_match,
        intended_error=d.intended_error,
        pattern_error=d.candidate_errors.get(run.named, math.inf),
        explanation=d.explanation,
    )


def run_objective_catalogue(
    frameworks: Sequence[str] = ("torch", "jax"),
    patterns: Sequence[str] | None = None,
    outputs: Mapping[ObjectiveBugRun, Outcome] | None = None,
) -> list[ObjectiveBugResult]:
    """The multi-term rows: run what `outputs` lacks, then judge every planned run (one
    that never came back is a failure row saying so, never a silent gap)."""
    runs = objective_runs(frameworks, patterns)
    known = dict(outputs or {})
    known.update(run_objective_steps([run for run in runs if run not in known]))
    missing = RuntimeError("planned but never reported by its runner")
    return [judge_objective(run, known.get(run, missing)) for run in runs]
