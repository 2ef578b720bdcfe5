"""Multi-term objectives in the main job: each implementation against the oracle, and each
term's layout dependence (docs/objectives.md).

The objectives of `crosscheck.contract.objective_catalogue` run on its two fixtures at every
layout R in {1, 2, 4}, M in {1, 2}.

Rows, as `crosscheck.contract.cases.CaseResult`:

* ``objective`` (per implementation, fixture, objective and layout): the implementation's
  gradient of every trained param against the oracle's, and every term's count and
  denominators equal to the oracle's; per-term losses, counts and denominators go to the
  run's log (`term_log_records`);
* ``term-layout`` (oracle): each term's gradient at each layout against its gradient at
  (1, 1). An update-scope term must not move (1e-12); a local one is expected to move, and
  the row shows by how much (``differs, as expected`` above `LAYOUT_MOVE`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from crosscheck.contract.cases import CaseResult
from crosscheck.contract.objective import ObjectiveResult, objective_loss_and_grad
from crosscheck.contract.objective_catalogue import (
    OBJECTIVE_FIXTURES,
    OBJECTIVE_LAYOUTS,
    OBJECTIVES,
    term_name,
)
from crosscheck.contract.spec import get_spec
from crosscheck.fixtures.builtin import builtin_fixture
from crosscheck.fixtures.objective_params import objective_params
from crosscheck.judge.compare import FLOAT64_RTOL, tree_rel_err

#: A local term "moves" with the layout when its gradient changes by more than this relative
#: to its own size: far above float64 rounding (1e-15), far below the changes seen (1e-3).
LAYOUT_MOVE = 1e-9


class ObjectiveCase(NamedTuple):
    """One objective computed by one implementation at one layout."""

    impl: str
    objective: str
    fixture: str
    world_size: int
    accum_steps: int


class TermOutput(NamedTuple):
    """What an implementation reports for one term (the update log)."""

    name: str
    loss: float
    count: int
    denominators: tuple[float, ...]


class ObjectiveOutput(NamedTuple):
    grads: dict[str, np.ndarray]
    loss: float
    terms: tuple[TermOutput, ...]


def oracle_objective(objective: str, fixture: str, R: int, M: int) -> ObjectiveResult:
    """The oracle's objective, gradient and terms for one case."""
    fx = builtin_fixture(fixture)
    return objective_loss_and_grad(objective_params(fx), fx.layout(R, M), OBJECTIVES[objective])


def compare_objective(case: ObjectiveCase, output: ObjectiveOutput | BaseException) -> CaseResult:
    """The ``objective`` row of one case: gradients, and every term's count and D."""
    row = {
        "check": "objective",
        "fixture": case.fixture,
        "scheme": case.objective,
        "impl": case.impl,
        "strategy": "precount",
        "world_size": case.world_size,
        "accum_steps": case.accum_steps,
        "dtype": "float64",
        "reference": "oracle",
    }
    if isinstance(output, BaseException):
        detail = f"{type(output).__name__}: {output}"
        return CaseResult(**row, max_rel_err=math.inf, ok=False, detail=detail, not_run=True)
    expected = oracle_objective(case.objective, case.fixture, case.world_size, case.accum_steps)
    error = tree_rel_err(output.grads, expected.grads).max_rel_err
    wrong = [
        got.name
        for got, want in zip(output.terms, expected.terms, strict=True)
        if got.count != want.count or not np.array_equal(got.denominators, want.denominators)
    ]
    detail = f"term counts or denominators differ: {', '.join(wrong)}" if wrong else ""
    # float64 on both sides, the same sums in another order: FLOAT64_RTOL (1e-12).
    ok = error <= FLOAT64_RTOL and not wrong
    return CaseResult(**row, max_rel_err=error, ok=ok, detail=detail)


def term_log_records(case: ObjectiveCase, output: ObjectiveOutput) -> list[dict[str, Any]]:
    """One JSONL record per term of a case: what the update log of a real loop would hold."""
    return [
        {
            "record": "term",
            **case._asdict(),
            "term": term.name,
            "loss": term.loss,
            "count": term.count,
            "denominators": list(term.denominators),
        }
        for term in output.terms
    ]


def _term_grads(objective: str, fixture: str, term: dict, R: int, M: int) -> dict:
    fx = builtin_fixture(fixture)
    return objective_loss_and_grad(objective_params(fx), fx.layout(R, M), [term]).grads


def _layout_local(term: Mapping[str, Any]) -> bool:
    if term["kind"] == "moe_lb":
        return term.get("scope", "update") != "update"
    return not get_spec(term.get("scheme", {})).layout_invariant


def _term_layout_row(
    objective: str, fixture: str, term: dict, R: int, M: int, **judgement
) -> CaseResult:
    """A term's row at layout (R, M) against (1, 1), with what it found (`judgement`)."""
    local = _layout_local(term)
    return CaseResult(
        check="term-layout",
        fixture=fixture,
        scheme=f"{objective}/{term_name(term)}",
        impl="oracle",
        strategy="closed-form",
        world_size=R,
        accum_steps=M,
        dtype="float64",
        reference="oracle R=1,M=1",
        extra={"expected": "layout-dependent" if local else "invariant"},
        **judgement,
    )


def _term_layouts(objectives: Sequence[str], fixtures: Sequence[str]):
    """Every (objective, fixture, term, R, M) the term-layout rows cover."""
    for objective in objectives:
        for fixture in fixtures:
            for term in OBJECTIVES[objective]:
                for R, M in OBJECTIVE_LAYOUTS:
                    yield objective, fixture, term, R, M


def term_layout_rows(objectives: Sequence[str], fixtures: Sequence[str]) -> list[CaseResult]:
    """Every term's gradient at every layout against (1, 1), from the oracle."""
    rows = []
    references: dict[tuple[str, str, str], dict] = {}
    for objective, fixture, term, R, M in _term_layouts(objectives, fixtures):
        which = (objective, fixture, term_name(term))
        if which not in references:
            references[which] = _term_grads(objective, fixture, term, 1, 1)
        reference = references[which]
        moved = tree_rel_err(_term_grads(objective, fixture, term, R, M), reference).max_rel_err
        # A local term is expected to move; the row shows by how much (a layout that happens
        # to leave it unchanged is no failure). An update-scope one must not move beyond
        # float64 rounding.
        ok = _layout_local(term) or moved <= FLOAT64_RTOL
        rows.append(_term_layout_row(objective, fixture, term, R, M, max_rel_err=moved, ok=ok))
    return rows


def planned_term_layout_rows(
    objectives: Sequence[str], fixtures: Sequence[str], detail: str
) -> list[CaseResult]:
    """The rows `term_layout_rows` is to produce, as they read when it produced none."""
    return [
        _term_layout_row(*where, max_rel_err=math.inf, ok=False, detail=detail, not_run=True)
        for where in _term_layouts(objectives, fixtures)
    ]


def objective_cases(impls: Sequence[str]) -> list[ObjectiveCase]:
    """Every (impl, objective, fixture, layout) of the main job."""
    return [
        ObjectiveCase(impl, objective, fixture, R, M)
        for impl in impls
        for objective in OBJECTIVES
        for fixture in OBJECTIVE_FIXTURES
        for R, M in OBJECTIVE_LAYOUTS
    ]


OnObjective = Callable[[ObjectiveCase, ObjectiveOutput | BaseException], None]
