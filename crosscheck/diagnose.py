r"""Diagnosis: the effective weighting of any gradient, and the name of what produced it.

Given a gradient G that some code produced on a fixture laid out as (R, M), and the scheme the
user intended, the diagnosis

1. **recovers the weights.** Valid tokens fall into groups, one per (rank, microbatch, row,
   segment). Each group has a basis gradient :math:`b_g = \sum_{t \in g} u_t \nabla l_t`
   (:math:`u_t` = the soft weight for ``weighted_mean``, else 1), and least squares solves
   :math:`G \approx \sum_g c_g b_g`. Token t of group g then weighs :math:`c_g u_t`; the
   weight ratio is the largest over the smallest of those among tokens that carry weight.
   The columns are normalized and the system's condition number is reported: the fixtures
   give full column rank (960 parameters, at most a few hundred groups, no two groups with
   the same tokens), and above `CONDITION_LIMIT` the recovered weights are declared unreliable.
2. **names it.** Every candidate of `crosscheck.candidates` (the intended scheme, each bug
   pattern of shared/BUGS.md that can occur at this layout, every other scheme) predicts a
   gradient; a candidate matches when G is within the dtype's tolerance of its prediction
   (the same test verification applies to the intended scheme). The intended scheme wins
   outright; among the rest, a logged denominator, when given, rules out candidates that
   would have logged another; bug patterns come before plain schemes (they explain more).
   If candidates of different names still match, the diagnosis refuses to choose and says
   which; if none matches, it says so and still reports the recovered weights.

The scale is the least-squares factor of G on the intended gradient,
:math:`\langle G, g_I \rangle / \langle g_I, g_I \rangle`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from crosscheck.candidates import (
    Candidate,
    clip_candidates,
    float32_count_candidate,
    local_mean_candidates,
    scale_candidates,
    scheme_candidates,
)
from crosscheck.compare import RTOL_BY_DTYPE, finite_or_none, tree_rel_err
from crosscheck.explain import explain
from crosscheck.fixtures import Fixture
from crosscheck.oracle import Params, token_jacobian
from crosscheck.schemes import WeightedMean, get_scheme

#: Above this condition number of the normalized group basis, two groups' weights can trade
#: off against each other within float64 rounding of a 1e-12-accurate gradient
#: (1e-12 * 1e4 = 1e-8 relative error in a weight), so the recovered weights are not reported
#: as reliable. The built-in fixtures stay below 10.
CONDITION_LIMIT = 1e4

UNKNOWN = "unknown"
AMBIGUOUS = "ambiguous"


@dataclass(frozen=True, slots=True)
class GroupWeight:
    """The recovered per-token weight of one group of valid tokens."""

    rank: int
    microbatch: int
    row: int  # global row index
    segment: int
    tokens: int
    weight: float  # c_g: per-token weight (times u_t for weighted_mean)
    intended: float  # the intended scheme's c_g


@dataclass(frozen=True, kw_only=True, slots=True)
class Diagnosis:
    """What a gradient's weighting is, against what was intended."""

    fixture: str
    world_size: int
    accum_steps: int
    intended: str
    dtype: str
    #: Worst-leaf relative error against the intended scheme's gradient.
    intended_error: float
    #: Verification failed: intended_error above the dtype's tolerance (or not finite).
    detected: bool
    #: A candidate's name, "unknown" (nothing fits) or "ambiguous" (see `matches`).
    best_match: str
    #: Every candidate name that matched within tolerance (after logged-denominator filtering).
    matches: tuple[str, ...]
    scale: float
    weight_ratio: float
    intended_weight_ratio: float
    #: Relative residual of the group least-squares fit, |G - sum c_g b_g| / |G|.
    residual: float
    condition_number: float
    well_posed: bool
    explanation: str
    groups: tuple[GroupWeight, ...] = ()
    #: name -> smallest relative error of that name's predictions.
    candidate_errors: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "fixture": self.fixture,
            "world_size": self.world_size,
            "accum_steps": self.accum_steps,
            "intended": self.intended,
            "dtype": self.dtype,
            "intended_error": finite_or_none(self.intended_error),
            "detected": self.detected,
            "best_match": self.best_match,
            "matches": list(self.matches),
            "scale": finite_or_none(self.scale),
            "weight_ratio": finite_or_none(self.weight_ratio),
            "intended_weight_ratio": finite_or_none(self.intended_weight_ratio),
            "residual": finite_or_none(self.residual),
            "condition_number": finite_or_none(self.condition_number),
            "well_posed": self.well_posed,
            "explanation": self.explanation,
            "candidate_errors": {k: finite_or_none(v) for k, v in self.candidate_errors.items()},
        }


def _flat(tree: Mapping[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([np.asarray(tree[k], dtype=np.float64).ravel() for k in sorted(tree)])


def token_groups(fixture: Fixture, world_size: int, accum_steps: int, units: np.ndarray):
    """Group id per token of the global [N, T] batch (-1: no weight), and each group's key."""
    batch = fixture.layout(world_size, accum_steps)
    _, M, B, _ = batch.targets.shape
    width = int(fixture.segment_ids.max(initial=0)) + 1
    key = np.arange(fixture.num_rows)[:, None] * width + fixture.segment_ids
    carries = fixture.valid & (units > 0)
    keys, inverse = np.unique(key[carries], return_inverse=True)
    group_of = np.full(key.shape, -1, dtype=np.int64)
    group_of[carries] = inverse
    described = []
    for k in keys:
        row, segment = divmod(int(k), width)
        rank, microbatch = divmod(row // B, M)
        described.append((rank, microbatch, row, segment))
    return group_of, described


def recover_weights(
    jacobian: np.ndarray, target: np.ndarray, group_of: np.ndarray, units: np.ndarray
) -> tuple[np.ndarray, float, float]:
    """Least-squares c_g of G = sum_g c_g b_g; returns (c, residual, condition number).

    `jacobian` holds the valid tokens' gradients (rows), `group_of` and `units` are per valid
    token. b_g = sum over the group of u_t times the token's row.
    """
    num_groups = int(group_of.max(initial=-1)) + 1
    if num_groups == 0:
        return np.zeros(0), float(np.linalg.norm(target) > 0), 1.0
    if not np.isfinite(target).all():  # NaN or inf: no weights to recover, nothing fits
        return np.full(num_groups, np.nan), math.inf, math.nan
    carries = group_of >= 0
    basis_rows = np.zeros((num_groups, jacobian.shape[1]))
    np.add.at(basis_rows, group_of[carries], units[carries, None] * jacobian[carries])
    basis = basis_rows.T
    norms = np.linalg.norm(basis, axis=0)
    norms = np.where(norms > 0, norms, 1.0)
    scaled = basis / norms
    singular = np.linalg.svd(scaled, compute_uv=False)
    condition = float(singular[0] / singular[-1]) if singular[-1] > 0 else math.inf
    solution, *_ = np.linalg.lstsq(scaled, target, rcond=None)
    c = solution / norms
    residual = float(np.linalg.norm(target - basis @ c) / max(np.linalg.norm(target), 1e-300))
    return c, residual, condition


def _ratio(values: np.ndarray) -> float:
    if values.size == 0:
        return 1.0
    if not np.isfinite(values).all():
        return math.inf
    magnitude = np.abs(values)
    if magnitude.min() == 0 or np.any(values < 0):
        return math.inf
    return float(magnitude.max() / magnitude.min())


def diagnose(
    fixture: Fixture,
    world_size: int,
    accum_steps: int,
    grads: Params,
    intended: str,
    *,
    dtype: str = "float64",
    logged_denominator: float | None = None,
    previous_denominators: Sequence[float] = (),
    max_grad_norm: float | None = None,
    params: Params | None = None,
) -> Diagnosis:
    """Diagnose `grads`, produced at layout (world_size, accum_steps) of `fixture`.

    `logged_denominator` is what the step logged as D for this update (it separates patterns
    with the same gradient, e.g. missing-world-size from double-reduce-count);
    `previous_denominators` are the intended D of earlier windows since the counter was last
    known to be reset (enables stale-count); `max_grad_norm` enables clip-per-microbatch.
    `params` default to the fixture's own: the gradient must be taken there.
    """
    scheme = get_scheme(intended)
    if not scheme.intended:
        raise ValueError(f"intended must be an intended scheme, got accidental {scheme.name!r}")
    if dtype not in RTOL_BY_DTYPE:
        raise ValueError(f"dtype must be one of {', '.join(RTOL_BY_DTYPE)}, got {dtype!r}")
    params = fixture.params() if params is None else params
    grads = {k: np.asarray(v, dtype=np.float64) for k, v in grads.items()}
    tolerance = RTOL_BY_DTYPE[dtype]
    batch = fixture.layout(world_size, accum_steps)
    weights = batch.to_global(scheme.effective_weights(batch))
    valid = fixture.valid
    units = (
        np.where(valid, fixture.weights, 0.0)
        if isinstance(scheme, WeightedMean)
        else valid.astype(np.float64)
    )
    jacobian = token_jacobian(params, fixture.inputs, fixture.targets)
    shapes = {k: np.shape(params[k]) for k in sorted(params)}

    def grad_of(token_weights: np.ndarray) -> Params:
        flat, out, start = token_weights[valid] @ jacobian, {}, 0
        for key, shape in shapes.items():
            size = int(np.prod(shape))
            out[key] = flat[start : start + size].reshape(shape)
            start += size
        return out

    intended_grads = grad_of(weights)
    intended_error = tree_rel_err(grads, intended_grads).max_rel_err
    g, gi = _flat(grads), _flat(intended_grads)
    scale = float(g @ gi / (gi @ gi)) if gi @ gi > 0 else math.nan

    group_of, keys = token_groups(fixture, world_size, accum_steps, units)
    c, residual, condition = recover_weights(jacobian, g, group_of[valid], units[valid])
    carries = group_of >= 0
    recovered = c[group_of[carries]] * units[carries] if c.size else np.zeros(0)
    intended_c = np.zeros(len(keys))
    if keys:
        intended_c[group_of[carries]] = weights[carries] / units[carries]

    candidates = [Candidate(scheme.name, "intended", weights, scheme.global_denominator(batch))]
    candidates += local_mean_candidates(scheme, batch)
    candidates += scale_candidates(scheme, fixture, batch, weights, tuple(previous_denominators))
    if max_grad_norm is not None:
        candidates += clip_candidates(grad_of, batch, weights, max_grad_norm)
    candidates += float32_count_candidate(scheme, batch, weights, scale)
    candidates += scheme_candidates(scheme, batch)

    errors: dict[str, float] = {}
    matched: list[Candidate] = []
    for candidate in candidates:
        err = tree_rel_err(grads, grad_of(candidate.weights)).max_rel_err
        errors[candidate.name] = min(err, errors.get(candidate.name, math.inf))
        if err <= tolerance:
            matched.append(candidate)
    best, names = _choose(matched, logged_denominator)

    groups = tuple(
        GroupWeight(
            rank=rank,
            microbatch=microbatch,
            row=row,
            segment=segment,
            tokens=int(np.count_nonzero(group_of == index)),
            weight=float(c[index]),
            intended=float(intended_c[index]),
        )
        for index, (rank, microbatch, row, segment) in enumerate(keys)
    )
    diagnosis = Diagnosis(
        fixture=fixture.name,
        world_size=world_size,
        accum_steps=accum_steps,
        intended=scheme.name,
        dtype=dtype,
        intended_error=intended_error,
        detected=not intended_error <= tolerance,
        best_match=best,
        matches=names,
        scale=scale,
        weight_ratio=_ratio(recovered),
        intended_weight_ratio=_ratio(weights[carries]),
        residual=residual,
        condition_number=condition,
        well_posed=bool(condition <= CONDITION_LIMIT),
        explanation="",
        groups=groups,
        candidate_errors=errors,
    )
    note = next((m.note for m in matched if m.name == best and m.note), "")
    return _with_explanation(diagnosis, note)


def _choose(matched: list[Candidate], logged: float | None) -> tuple[str, tuple[str, ...]]:
    """The best match's name and every name left in the running (see the module docstring)."""
    if any(m.kind == "intended" for m in matched):
        return matched[0].name, tuple(dict.fromkeys(m.name for m in matched))
    if logged is not None:
        agree = [
            m
            for m in matched
            if m.logged_denominator is None
            or math.isclose(m.logged_denominator, logged, rel_tol=1e-9)
        ]
        matched = agree or matched
    patterns = [m for m in matched if m.kind == "pattern"]
    names = tuple(dict.fromkeys(m.name for m in (patterns or matched)))
    if not names:
        return UNKNOWN, ()
    if len(names) > 1:
        return AMBIGUOUS, names
    return names[0], names


def _with_explanation(diagnosis: Diagnosis, note: str) -> Diagnosis:
    from dataclasses import replace

    return replace(diagnosis, explanation=explain(diagnosis, note))
