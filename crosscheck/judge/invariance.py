"""Layout invariance of the oracle: the same global batch under every layout (R, M).

An intended scheme's gradient must not depend on how the batch is split over ranks and
microbatches; an accidental scheme's does, and by how much is the answer to "we doubled
accumulation after losing GPUs: why did the recipe change?". Each case compares the gradient
at layout (R, M) with the gradient at (1, 1), the single-device reference.
"""

from __future__ import annotations

import numpy as np

from crosscheck.contract.cases import CaseResult, oracle_case
from crosscheck.contract.fixture import Fixture
from crosscheck.contract.oracle import loss_and_grad
from crosscheck.contract.schemes import resolve_scheme
from crosscheck.judge.compare import FLOAT64_RTOL, tree_rel_err


def weight_ratio(token_weights: np.ndarray, valid: np.ndarray) -> float:
    """Largest over smallest effective weight among valid tokens of nonzero weight."""
    weights = token_weights[valid & (token_weights > 0)]
    if weights.size == 0:
        return 1.0
    return float(weights.max() / weights.min())


def layout_invariance(
    fixture: Fixture, scheme_name: str, layouts: list[tuple[int, int]]
) -> list[CaseResult]:
    """The oracle gradient at each layout against the single-device gradient at (1, 1)."""
    scheme = resolve_scheme(scheme_name)
    reference = loss_and_grad(fixture, scheme, 1, 1).grads
    rows = []
    for R, M in layouts:
        result = loss_and_grad(fixture, scheme, R, M)
        err = tree_rel_err(result.grads, reference).max_rel_err
        # Intended: identical to float64 rounding. Accidental: any finite value is what the
        # scheme does; its deviation is reported, and a NaN is still a failure.
        ok = err <= FLOAT64_RTOL if scheme.intended else bool(np.isfinite(err))
        rows.append(
            CaseResult(
                check="layout-invariance",
                **oracle_case(fixture.name, scheme.name, R, M).coordinates(),
                max_rel_err=err,
                ok=ok,
                reference="oracle at R=1,M=1",
                weight_ratio=weight_ratio(result.token_weights, fixture.valid),
            )
        )
    return rows
