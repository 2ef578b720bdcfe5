r"""Diagnose a multi-term objective's gradient: how each term is weighted, and which bug.

`diagnose_objective(params, batch, terms, grads)` takes the gradient some code produced for
the objective `terms` (docs/objectives.md) on `batch` laid out as [R, M, B, T] and says:

* **per-term scales** :math:`s_k`: least squares of g on the intended per-term gradients
  :math:`g_k = \sum_u G_{k,u}` (`objective_candidates.unit_gradients`), 1 for a correct step;
* **per-(term, unit) weights** :math:`w_{k,u}` over the microbatches u = (r, m), and over the
  ranks (columns :math:`\sum_m G_{k,(r,m)}`): least squares of g on the :math:`G_{k,u}`,
  NaN where a unit has no token of the term or its gradient lies in the span of the
  others'; 1 everywhere for a correct step, :math:`1/(R M n_u / n)` on a term normalized
  per microbatch;
* the **residual** :math:`\lVert g - \sum w_{k,u} G_{k,u}\rVert / \lVert g \rVert`: the step's
  rounding when its error is a reweighting of units, large when the term's form changed
  (local routing statistics);
* whether the **intended objective fits**, judged as the single-term verdict judges: its
  worst-leaf relative error
  :math:`\max_{\text{leaf}} \lVert g - g^{int} \rVert_\infty / \lVert g^{int}\rVert_\infty`
  within `rtol` (the contract's float64 test, docs/contract.md) *and* every identifiable
  unit weight within `rtol` plus `Z_SCORE` standard errors of the measured noise,
  :math:`|w_{k,u} - 1| \le \tau + z\,\mathrm{se}(w_{k,u})` (a small skew of a small term
  hides in the worst leaf, not in its own weight);
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
from typing import Any, NamedTuple

import numpy as np

from crosscheck.contract.layout import LaidOutBatch
from crosscheck.contract.objective import objective_loss_and_grad
from crosscheck.contract.objective_terms import Term, parse_objective
from crosscheck.diagnosis.objective_candidates import Candidate, candidates, flat_keys, flatten
from crosscheck.diagnosis.verdict import Z_SCORE

#: float64 arithmetic: the oracle and a float64 step differ by a few ulps per token in the
#: order of their sums, ~1e-15 relative over a few hundred tokens; 1e-12 is the contract's
#: float64 tolerance (crosscheck.judge.compare.RTOL_BY_DTYPE), and every pattern moves some
#: leaf by far more (1e-4 and up on the fixtures). A float32 step needs rtol=1e-5.
RTOL_FLOAT64 = 1e-12
#: Below this distance of a normalized column from the span of the others, its weight is not
#: separable at float64: rounding of 1e-16 would move it by 1e-10, far past the tolerance.
MIN_SEPARATION = 1e-6
#: How many times the rounding shift of the oracle's own gradient a unit's recovered weight
#: may sit from 1 (`rounding_allowance`). The step rounds in another order than the oracle,
#: so its shift on a unit is of the same size but not the same value: the largest shift over
#: a term's units, times this, bounds every unit of the term. Measured: the oracle's one-pass
#: gradient against its per-unit sums moved examples/objectives.py MOE's moe_lb units (columns
#: 1e-4 of the cross-entropy's) by up to 1.0e-11 on packed at R = 2, M = 4, past 1e-12 plus
#: six standard errors of the residual's noise (1e-12): rounding of the large term's leaves
#: that the residual does not see.
ROUNDING_MARGIN = 8.0
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
    #: max over units of |w_{k,u} - 1| - z se(w_{k,u}): the weight test passes at <= rtol.
    unit_excess: float
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
    #: Candidates that predict the intended gradient at this layout (aux-world-size-factor at
    #: R = 1): they name nothing here, and are consistent with a case the intended fits.
    coinciding: tuple[str, ...] = ()
    #: Per term name, max over its identifiable units of |w_{k,u} - 1| - z se(w_{k,u}) (0 when
    #: none is identifiable): the term is weighted as intended when this is within the tolerance.
    term_excess: dict[str, float] = field(default_factory=dict)


def worst_leaf_error(
    actual: np.ndarray, expected: np.ndarray, sizes: Sequence[int], skip: Sequence[int] = ()
) -> float:
    """max over leaves of max|actual - expected| / max|expected| (a zero leaf: max|actual|);
    inf when `actual` is not finite (max() would silently drop a NaN: 0/0 is never a fit).
    `skip`: indices of leaves left out (a model's parameters no term gives a gradient)."""
    if not np.isfinite(actual).all():
        return np.inf
    worst, start = 0.0, 0
    for index, size in enumerate(sizes):
        a, e = actual[start : start + size], expected[start : start + size]
        start += size
        if index in skip:
            continue
        scale = np.abs(e).max() if size else 0.0
        diff = np.abs(a - e).max() if size else 0.0
        worst = max(worst, float(diff / scale) if scale > 0 else float(diff))
    return worst


class _Fit(NamedTuple):
    """Least squares of a gradient on columns: coefficients and their standard errors (NaN
    for the columns that cannot be separated), relative residual, condition number."""

    coefficients: np.ndarray
    standard_errors: np.ndarray
    residual: float
    condition: float


def _fit(columns: np.ndarray, target: np.ndarray) -> _Fit:
    r"""Least squares of `target` on the nonzero `columns` [P, C].

    A column's coefficient is determined, whatever the other columns, exactly when it is not in
    their span: with :math:`\delta_j` the distance of the normalized column j from the span
    of the others, its coefficient has the standard error :math:`\hat\sigma / \delta_j`
    (the classical :math:`\hat\sigma \sqrt{((B^\top B)^{-1})_{jj}}` when B has full rank),
    :math:`\hat\sigma = \lVert r \rVert / \sqrt{P - \operatorname{rank} B}` as in
    `crosscheck.diagnosis.verdict`: the rounding of a float64 step is noise-like across
    components. A column with :math:`\delta_j` below `MIN_SEPARATION` is not identifiable
    (NaN): two terms with proportional gradients on a unit (a ce and its local sibling on a
    microbatch of one segment) cannot be told apart, and the others still can.
    """
    norms = np.linalg.norm(columns, axis=0)
    live = np.flatnonzero(norms > 0)
    coefficients = np.full(columns.shape[1], np.nan)
    errors = np.full(columns.shape[1], np.nan)
    if live.size == 0:
        return _Fit(coefficients, errors, 1.0, np.inf)
    # Normalize the columns so that separations and the condition number measure their
    # geometry, not the terms' coefficients (a z-loss at 1e-2 is no less identifiable).
    scaled = columns[:, live] / norms[live]
    solution, _, rank, singular = np.linalg.lstsq(scaled, target, rcond=None)
    condition = float(singular[0] / singular[-1]) if singular[-1] > 0 else np.inf
    residual = float(np.linalg.norm(target - scaled @ solution))
    dof = scaled.shape[0] - rank
    sigma = residual / np.sqrt(dof) if dof > 0 else np.nan
    for i, j in enumerate(live):
        others = np.delete(scaled, i, axis=1)
        along = np.linalg.lstsq(others, scaled[:, i], rcond=None)[0] if others.size else 0.0
        separation = float(np.linalg.norm(scaled[:, i] - others @ along)) if others.size else 1.0
        if separation >= MIN_SEPARATION:
            coefficients[j] = solution[i] / norms[j]
            errors[j] = sigma / separation / norms[j]
    size = float(np.linalg.norm(target))
    return _Fit(coefficients, errors, residual / size if size else 0.0, condition)


def worst_unit_excess(
    fit: _Fit, units: slice = slice(None), allowance: np.ndarray | None = None
) -> float:
    """max over identifiable units of |w - 1| - z se - a: the intended objective's weight
    test passes when this is within the tolerance (every unit's weight within tolerance plus
    `Z_SCORE` standard errors of the measured noise, as the single-term verdict judges, plus
    its rounding `allowance` a, zero where none is given). `units`: one term's columns only."""
    w, se = fit.coefficients[units], fit.standard_errors[units]
    a = np.zeros_like(w) if allowance is None else allowance[units]
    known = ~np.isnan(w) & ~np.isnan(se)
    if not known.any():
        return 0.0
    return float((np.abs(w[known] - 1.0) - Z_SCORE * se[known] - a[known]).max())


def rounding_allowance(per_unit: np.ndarray, reference: np.ndarray, K: int) -> np.ndarray:
    """Per unit column: `ROUNDING_MARGIN` times the largest |w - 1| that the fit finds on
    `reference` among the units of the same term (K columns per term). `reference` is the
    intended gradient computed in one pass, while the columns are its per-unit parts: its
    recovered weights differ from 1 by rounding alone."""
    shift = np.abs(_fit(per_unit, reference).coefficients - 1.0)
    allowance = np.zeros(per_unit.shape[1])
    for start in range(0, per_unit.shape[1], K):
        term = shift[start : start + K]
        known = term[~np.isnan(term)]
        allowance[start : start + K] = ROUNDING_MARGIN * known.max() if known.size else 0.0
    return allowance


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
    # The same objective's gradient in one pass: how far rounding alone moves a unit's weight.
    one_pass = flatten(objective_loss_and_grad(params, batch, objective).grads, keys)
    return diagnose_columns(
        g, sizes, names, basis, intended, found, (R, M), rtol, reference=one_pass
    )


def diagnose_columns(
    g: np.ndarray,
    sizes: Sequence[int],
    names: Sequence[str],
    basis: Mapping[str, np.ndarray],
    intended: np.ndarray,
    found: Sequence[Candidate],
    layout: tuple[int, int],
    rtol: float = RTOL_FLOAT64,
    dead: Sequence[int] = (),
    reference: np.ndarray | None = None,
) -> ObjectiveDiagnosis:
    """`diagnose_objective` on given columns: the flat gradient `g` (leaves of `sizes`), each
    term's per-microbatch intended gradients ``basis[name]`` [R M, P] (rank-major), their sum
    `intended` and the patterns' predictions `found`. The oracle gives these for the fixture
    model family (`objective_candidates.candidates`); a user's own model gives them from its
    own backward passes (``crosscheck.verification.objective_model``), which also names the
    leaves no term reaches (`dead`): the worst-leaf errors leave them out, the fits keep them,
    and the intended objective fits only where the fit's residual is within `rtol` too.
    `reference`: the intended gradient computed in one pass (the oracle's), whose recovered
    weights show how far rounding alone moves each term's units (`rounding_allowance`);
    None: no allowance beyond the residual's noise."""
    R, M = layout
    intended_error = worst_leaf_error(g, intended, sizes, dead)

    per_term = np.stack([basis[n].sum(axis=0) for n in names], axis=1)
    scales = _fit(per_term, g).coefficients
    # A term whose gradient cannot be separated scales as intended in the prediction.
    scaled = per_term @ np.where(np.isnan(scales), 1.0, scales)
    term_scale_error = worst_leaf_error(g, scaled, sizes, dead)

    per_unit = np.concatenate([basis[n].T for n in names], axis=1)  # [P, K (R M)]
    units = _fit(per_unit, g)
    unit_fit, residual, condition = units.coefficients, units.residual, units.condition
    K = R * M
    allowance = None if reference is None else rounding_allowance(per_unit, reference, K)
    # The worst-leaf test alone would pass a small skew of a small term's unit (its share of
    # every leaf below 1e-12); the weight test, as in the single-term verdict, does not.
    unit_excess = worst_unit_excess(units, allowance=allowance) if np.isfinite(g).all() else np.inf
    # The residual: what no reweighting of the terms' units explains (gradient on a leaf no
    # term reaches, a term whose form changed) is no rounding once it passes the tolerance.
    intended_fits = intended_error <= rtol and unit_excess <= rtol and residual <= rtol
    per_rank = np.concatenate([basis[n].reshape(R, M, -1).sum(axis=1).T for n in names], axis=1)
    rank_fit = _fit(per_rank, g).coefficients

    errors: dict[str, float] = {}
    coinciding: list[str] = []
    for candidate in found:
        # A candidate that coincides with the intended objective here names nothing.
        if worst_leaf_error(candidate.prediction, intended, sizes, dead) <= rtol:
            coinciding.append(candidate.name)
            continue
        error = worst_leaf_error(g, candidate.prediction, sizes, dead)
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
    finite = bool(np.isfinite(g).all())
    term_excess = {
        n: worst_unit_excess(units, slice(i * K, (i + 1) * K), allowance) if finite else np.inf
        for i, n in enumerate(names)
    }
    return ObjectiveDiagnosis(
        best_match=best,
        intended_fits=intended_fits,
        intended_error=intended_error,
        unit_excess=unit_excess,
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
        coinciding=tuple(dict.fromkeys(c for c in coinciding if c not in errors)),
        term_excess=term_excess,
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
