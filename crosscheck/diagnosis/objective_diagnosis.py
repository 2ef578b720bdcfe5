r"""Diagnose a multi-term objective's gradient: how each term is weighted, and which bug.

`diagnose_objective(params, batch, terms, grads)` takes the gradient some code produced for
the objective `terms` (docs/objectives.md) on `batch` laid out as [R, M, B, T] and says:

* **per-term scales** :math:`s_k`: least squares of g on the intended per-term gradients
  :math:`g_k = \sum_u G_{k,u}` (`objective_candidates.unit_gradients`), 1 for a correct step;
* **per-(term, unit) weights** :math:`w_{k,u}` over the microbatches u = (r, m), and over the
  ranks (columns :math:`\sum_m G_{k,(r,m)}`): least squares of g on the :math:`G_{k,u}`,
  NaN where a unit has no token of the term or the system is too ill-conditioned to
  separate it; 1 everywhere for a correct step, :math:`1/(R M n_u / n)` on a term normalized
  per microbatch;
* the **residual** :math:`\lVert g - \sum w_{k,u} G_{k,u}\rVert / \lVert g \rVert`: the step's
  rounding when its error is a reweighting of units, large when the term's form changed
  (local routing statistics);
* whether the **intended objective fits**: its worst-leaf relative error
  :math:`\max_{\text{leaf}} \lVert g - g^{int} \rVert_\infty / \lVert g^{int}\rVert_\infty`
  within `rtol` (the contract's float64 test, docs/contract.md);
* **best_match**: ``intended``, one pattern of `objective_candidates` with the term it hits
  (``sibling-term-scope(z_loss)``), ``ambiguous`` or ``unknown``.

Naming follows `crosscheck.diagnosis.naming`: the intended objective, when it fits, is the
answer (a pattern that coincides with it at this layout, R = 1 for ``aux-world-size-factor``
or R M = 1 for ``sibling-term-scope``, names nothing); a name is given only when exactly one
explanation fits; a reweighting pattern (``sibling-term-scope``) is not named where a plain
per-term scale fits as well, since the layout did not show the reweighting; several fitting
explanations give ``ambiguous`` (listed in `explanations`), none gives ``unknown``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from crosscheck.contract.layout import LaidOutBatch
from crosscheck.contract.objective_terms import Term, parse_objective
from crosscheck.diagnosis.objective_candidates import candidates, flat_keys, flatten

#: float64 arithmetic: the oracle and a float64 step differ by a few ulps per token in the
#: order of their sums, ~1e-15 relative over a few hundred tokens; 1e-12 is the contract's
#: float64 tolerance (crosscheck.judge.compare.RTOL_BY_DTYPE), and every pattern moves some
#: leaf by far more (1e-4 and up on the fixtures). A float32 step needs rtol=1e-5.
RTOL_FLOAT64 = 1e-12
#: Beyond this condition number of the column-normalized system, the per-unit weights are not
#: separable at float64 (1e-16 x cond would reach the tolerance's scale).
MAX_CONDITION = 1e8
INTENDED, AMBIGUOUS, UNKNOWN = "intended", "ambiguous", "unknown"
#: The per-term scale family (every term as intended, each scaled): not itself a pattern.
TERM_SCALE = "term-scale"
#: Patterns that reweigh a term's units against each other rather than scale it.
_REWEIGHTING = frozenset({"sibling-term-scope"})


@dataclass(frozen=True)
class ObjectiveDiagnosis:
    """What `diagnose_objective` found (see the module docstring)."""

    best_match: str
    intended_fits: bool
    #: Worst-leaf relative error of the intended objective's gradient.
    intended_error: float
    #: s_k per term name.
    term_scales: dict[str, float]
    #: Worst-leaf relative error of the best per-term scaling.
    term_scale_error: float
    #: w_{k,(r,m)} per term name, [R, M]; NaN where not identifiable.
    unit_weights: dict[str, np.ndarray]
    #: w_{k,r} per term name, [R]; NaN where not identifiable.
    rank_weights: dict[str, np.ndarray]
    #: Relative residual of the per-(term, microbatch) fit.
    residual: float
    #: Condition number of the column-normalized per-(term, microbatch) system.
    condition: float
    #: Minimal explanations that fit: one for a name, several when ambiguous.
    explanations: tuple[str, ...]
    #: Worst-leaf error of every candidate name (its best variant).
    candidate_errors: dict[str, float] = field(default_factory=dict)
    explanation: str = ""


def worst_leaf_error(actual: np.ndarray, expected: np.ndarray, sizes: Sequence[int]) -> float:
    """max over leaves of max|actual - expected| / max|expected| (a zero leaf: max|actual|)."""
    worst, start = 0.0, 0
    for size in sizes:
        a, e = actual[start : start + size], expected[start : start + size]
        start += size
        scale = np.abs(e).max() if size else 0.0
        diff = np.abs(a - e).max() if size else 0.0
        worst = max(worst, float(diff / scale) if scale > 0 else float(diff))
    return worst


def _fit(columns: np.ndarray, target: np.ndarray) -> tuple[np.ndarray, float, float]:
    """Least squares of `target` on the nonzero `columns` [P, C]: (coefficients with NaN for
    the columns that cannot be separated, relative residual, condition number)."""
    norms = np.linalg.norm(columns, axis=0)
    live = norms > 0
    coefficients = np.full(columns.shape[1], np.nan)
    if not live.any():
        return coefficients, 1.0, np.inf
    # Normalize the columns so that the condition number measures their geometry, not the
    # terms' coefficients (a z-loss at 1e-2 is not less identifiable than the ce).
    scaled = columns[:, live] / norms[live]
    solution, *_ = np.linalg.lstsq(scaled, target, rcond=None)
    singular = np.linalg.svd(scaled, compute_uv=False)
    condition = float(singular[0] / singular[-1]) if singular[-1] > 0 else np.inf
    residual = np.linalg.norm(target - scaled @ solution)
    relative = float(residual / np.linalg.norm(target)) if np.linalg.norm(target) else 0.0
    if condition <= MAX_CONDITION:
        coefficients[live] = solution / norms[live]
    return coefficients, relative, condition


def diagnose_objective(
    params: Mapping[str, np.ndarray],
    batch: LaidOutBatch,
    terms: Sequence[Mapping[str, Any] | Term],
    grads: Mapping[str, Any],
    *,
    main: str | None = None,
    rtol: float = RTOL_FLOAT64,
) -> ObjectiveDiagnosis:
    """Diagnose `grads` (a dict of trained-param gradients) against the objective `terms`.

    `main` names the main term (default: the first); patterns hit the other terms.
    """
    objective = parse_objective(terms)
    keys = flat_keys(params)
    sizes = [int(np.size(params[k])) for k in keys]
    g = flatten(grads, keys)
    R, M = batch.targets.shape[:2]
    intended, basis, found = candidates(params, batch, objective, main)
    names = [t.name for t in objective]

    intended_error = worst_leaf_error(g, intended, sizes)
    intended_fits = intended_error <= rtol

    per_term = np.stack([basis[n].sum(axis=0) for n in names], axis=1)
    scales, _, _ = _fit(per_term, g)
    # A term whose gradient cannot be separated scales as intended in the prediction.
    scaled = per_term @ np.where(np.isnan(scales), 1.0, scales)
    term_scale_error = worst_leaf_error(g, scaled, sizes)

    per_unit = np.concatenate([basis[n].T for n in names], axis=1)  # [P, K (R M)]
    unit_fit, residual, condition = _fit(per_unit, g)
    per_rank = np.concatenate([basis[n].reshape(R, M, -1).sum(axis=1).T for n in names], axis=1)
    rank_fit, _, _ = _fit(per_rank, g)

    errors: dict[str, float] = {}
    for candidate in found:
        # A candidate that coincides with the intended objective here names nothing.
        if worst_leaf_error(candidate.prediction, intended, sizes) <= rtol:
            continue
        error = worst_leaf_error(g, candidate.prediction, sizes)
        errors[candidate.name] = min(error, errors.get(candidate.name, np.inf))
    fits = [name for name, error in errors.items() if error <= rtol]
    if intended_fits:
        explanations: list[str] = [INTENDED]
    else:
        explanations = fits
        reweighting = any(n.split("(")[0] in _REWEIGHTING for n in fits)
        if reweighting and term_scale_error <= rtol:
            explanations = [*fits, TERM_SCALE]
    best = explanations[0] if len(explanations) == 1 else (AMBIGUOUS if explanations else UNKNOWN)
    return ObjectiveDiagnosis(
        best_match=best,
        intended_fits=intended_fits,
        intended_error=intended_error,
        term_scales=dict(zip(names, scales.tolist(), strict=True)),
        term_scale_error=term_scale_error,
        unit_weights={
            n: unit_fit[i * R * M : (i + 1) * R * M].reshape(R, M) for i, n in enumerate(names)
        },
        rank_weights={n: rank_fit[i * R : (i + 1) * R] for i, n in enumerate(names)},
        residual=residual,
        condition=condition,
        explanations=tuple(explanations),
        candidate_errors=errors,
        explanation=_explain(best, explanations, intended_error, names, scales),
    )


def _explain(best: str, explanations, error: float, names, scales) -> str:
    """One sentence for a person."""
    if best == INTENDED:
        return f"Every term is weighted as intended (worst-leaf error {error:.1e})."
    scaled = ", ".join(f"{n} x{s:.6g}" for n, s in zip(names, scales, strict=True))
    if best == UNKNOWN:
        return f"No pattern fits (worst-leaf error {error:.1e}); per-term scales: {scaled}."
    if best == AMBIGUOUS:
        return f"Several explanations fit equally: {', '.join(explanations)}."
    return f"{best} (per-term scales: {scaled}); docs/bugs.md, multi-term objectives."
