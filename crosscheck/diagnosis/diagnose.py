r"""Diagnosis: the effective weighting of any gradient, and the name of what produced it.

Given a gradient G that some code produced on a fixture laid out as (R, M), and the scheme the
user intended (a `crosscheck.contract.spec.SchemeSpec`, with its parameters, or a name), the
diagnosis

1. **recovers the weights and measures the numerics** (``crosscheck.diagnosis.verdict``): least
   squares of G on the per-group token gradients gives each group's weight, and the residual says
   at which precision the step computes (float64-exact, float32-level, bf16-level). The weight
   ratio is the largest over the smallest ratio of a token's recovered weight to the intended
   scheme's (1 for a correct step, whatever the scheme). Above `CONDITION_LIMIT` the group
   weights are declared not identifiable.
2. **judges at that precision** (``crosscheck.diagnosis.judgement``): every candidate of
   `crosscheck.diagnosis.candidates` (the intended scheme, each bug pattern of the catalogue, every
   other scheme) and every reweighting family of `crosscheck.diagnosis.families` predicts a
   gradient, and fits when G passes the precision-aware test against it: worst-leaf error within the
   level's tolerance and every rank's, microbatch's and group's weight within that tolerance plus
   the measured noise. Starting at the level the noise allows, a coarser allowed level is tried
   only while nothing but a family fits. The step is correct when the intended scheme fits.
3. **names it** (``crosscheck.diagnosis.naming``): a logged denominator, when given, breaks ties
   among the patterns that fit; of what is left, the minimal explanation is named, or several are
   (ambiguous), or none (unknown).

The scale is the least-squares factor of G on the intended gradient,
:math:`\langle G, g_I \rangle / \langle g_I, g_I \rangle`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from crosscheck.contract.fixture import Fixture
from crosscheck.contract.layout import LaidOutBatch, Layout
from crosscheck.contract.oracle import Params, token_jacobian
from crosscheck.contract.schemes import resolve_scheme
from crosscheck.contract.spec import SchemeSpec
from crosscheck.diagnosis.candidates import (
    Candidate,
    clip_candidates,
    context_candidates,
    float32_count_candidate,
    local_mean_candidates,
    pipeline_candidates,
    scale_candidates,
    scheme_candidates,
)
from crosscheck.diagnosis.explain import explain
from crosscheck.diagnosis.families import family_candidates
from crosscheck.diagnosis.group_basis import (
    GroupBasis,
    GroupKey,
    basis_grad_of,
    group_mass,
    predictable,
    token_groups,
    token_units,
)
from crosscheck.diagnosis.judgement import judge_levels, noise_level, per_group_weights
from crosscheck.diagnosis.naming import AMBIGUOUS, UNKNOWN, minimal, name_of
from crosscheck.diagnosis.result import Diagnosis, GroupWeight
from crosscheck.diagnosis.verdict import (
    PRECISIONS,
    WeightCheck,
    auto_levels,
    check_weights,
    detectable_skew,
    fit_group_basis,
    jacobian_group_basis,
)
from crosscheck.diagnosis.zero_count import ZERO_COUNT_NAN, zero_count_note
from crosscheck.judge.compare import tree_rel_err

#: A gradient entry beyond this magnitude is no weighting of the fixtures' gradients (their
#: entries are below 1), and the fit's sums of squares would overflow float64 on it: such a
#: gradient is reported like a non-finite one, by where it is (`unusable_entries`).
MAX_GRADIENT_MAGNITUDE = 1e100

#: Above this condition number of the normalized group basis, two groups' weights can trade
#: off against each other within float64 rounding of a 1e-12-accurate gradient
#: (1e-12 * 1e4 = 1e-8 relative error in a weight), so the recovered weights are not reported
#: as reliable. The built-in fixtures stay below 10.
CONDITION_LIMIT = 1e4

__all__ = [
    "AMBIGUOUS",
    "CONDITION_LIMIT",
    "UNKNOWN",
    "Diagnosis",
    "GroupBasis",
    "GroupWeight",
    "diagnose",
    "token_groups",
    "unusable_entries",
    "with_explanation",
]


def _flat(tree: Mapping[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([np.asarray(tree[k], dtype=np.float64).ravel() for k in sorted(tree)])


def _first(mask: Mapping[str, np.ndarray]) -> tuple[str, tuple[int, ...], int]:
    """The first (name, index) where `mask` holds, in sorted name order, and how many do."""
    total = sum(int(np.count_nonzero(m)) for m in mask.values())
    name = next(k for k in sorted(mask) if mask[k].any())
    index = tuple(int(i) for i in np.argwhere(mask[name])[0])
    return name, index, total


def _where(name: str, index: tuple[int, ...]) -> str:
    return f"{name}[{', '.join(map(str, index))}]" if index else name


def unusable_entries(grads: Mapping[str, np.ndarray]) -> str:
    """Where `grads` holds NaN or inf, or else an entry beyond MAX_GRADIENT_MAGNITUDE, as
    "inf in embed[3, 4] (and 12 more NaN or inf entries)"; "" when it holds neither."""
    arrays = {k: np.asarray(v, dtype=np.float64) for k, v in grads.items()}
    bad = {k: ~np.isfinite(v) for k, v in arrays.items()}
    if any(m.any() for m in bad.values()):
        name, index, total = _first(bad)
        value = float(arrays[name][index])
        what = "NaN" if math.isnan(value) else ("inf" if value > 0 else "-inf")
        more = f"and {total - 1} more NaN or inf entries" if total > 1 else "no other NaN or inf"
        return f"{what} in {_where(name, index)} ({more})"
    huge = {k: np.abs(v) > MAX_GRADIENT_MAGNITUDE for k, v in arrays.items()}
    if any(m.any() for m in huge.values()):
        name, index, total = _first(huge)
        more = f"and {total - 1} more" if total > 1 else "the only entry"
        return (
            f"{float(arrays[name][index]):.3g} in {_where(name, index)} ({more} beyond "
            f"{MAX_GRADIENT_MAGNITUDE:.0e}, too large for the fit's float64 arithmetic)"
        )
    return ""


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
    intended: str | SchemeSpec,
    *,
    dtype: str = "float64",
    precision: str = "auto",
    logged_denominator: float | None = None,
    previous_denominators: Sequence[float] = (),
    max_grad_norm: float | None = None,
    params: Params | None = None,
    basis: GroupBasis | None = None,
    intended_grads: Params | None = None,
    framework: str | None = None,
    context_size: int = 1,
    context_order: str = "contiguous",
    pipeline_stages: Sequence[Sequence[str]] = (),
) -> Diagnosis:
    """Diagnose `grads`, produced at layout (world_size, accum_steps) of `fixture`, every row
    split over `context_size` context-parallel ranks in `context_order` (1: none), and run
    through `pipeline_stages` (each stage's parameter names, in pipeline order; none: no
    pipeline).

    `dtype` is the dtype of the params the step was given; `precision` is "auto" (the finest
    level the gradient's own noise allows: float64 or float32, and bfloat16 when `dtype` is)
    or a level to judge at ("float64" is the strict judgement). `logged_denominator` is what
    the step logged as D for this update (it separates patterns with the same gradient, e.g.
    missing-world-size from double-reduce-count); `previous_denominators` are the intended D
    of earlier windows since the counter was last known to be reset (enables stale-count);
    `max_grad_norm` enables clip-per-microbatch. `params` default to the fixture's own: the
    gradient must be taken there.

    Any model: `basis` (a `GroupBasis` of this fixture under the intended scheme's units,
    computed by the model the gradient is of; ``crosscheck.verification.model_basis``) replaces
    the analytic model's Jacobian, and `intended_grads` is the intended gradient that model
    gives (default: the basis's c B, equal to it up to rounding). Hypotheses whose weights vary
    inside a group cannot be predicted from a basis: they are left out, with a note.
    `framework` ("torch" or "jax") says the fix in that framework's terms and points to its
    docs (default: both).

    The steps: the intended weights and the groups of the fixture; the model's gradient of any
    weighting (`_gradient_model`); the fit of G on the groups; every candidate's prediction
    (`_candidates`); the judgement at the precision the noise allows; the names.
    """
    scheme = resolve_scheme(intended)
    if not scheme.intended:
        raise ValueError(f"intended must be an intended scheme, got accidental {scheme.name!r}")
    allowed = _allowed_levels(precision, dtype)
    grads = {k: np.asarray(v, dtype=np.float64) for k, v in grads.items()}
    layout = Layout(world_size, accum_steps, context_size, context_order)
    batch = fixture.layout(world_size, accum_steps, context_size, context_order)
    weights = batch.to_global(scheme.effective_weights(batch))
    units = token_units(fixture, scheme)
    group_of, keys = token_groups(fixture, world_size, accum_steps, units, layout)
    model = _gradient_model(fixture, grads, params, basis, group_of, units, keys)

    if intended_grads is None:
        intended_grads = model.grad_of(weights)
    intended_grads = {k: np.asarray(v, dtype=np.float64) for k, v in intended_grads.items()}
    intended_error = tree_rel_err(model.live(grads), model.live(intended_grads)).max_rel_err
    g, gi = _flat(grads), _flat(intended_grads)
    unusable = unusable_entries(grads)
    if unusable:
        # The fit's arithmetic overflows on huge entries (and raises under the CLI's
        # errstate); as NaN the gradient takes the non-finite path every step below handles:
        # nothing fits, and the explanation says where the gradient went wrong.
        g = np.full_like(g, np.nan)
    scale = float(g @ gi / (gi @ gi)) if gi @ gi > 0 and np.isfinite(g).all() else math.nan

    fit = fit_group_basis(
        model.basis_matrix,
        g,
        model.mass,
        np.array([k[0] for k in keys], dtype=np.int64),
        np.array([k[1] for k in keys], dtype=np.int64),
    )
    labels = [key.label for key in keys]
    intended_c = per_group_weights(weights, group_of, units)
    if intended_c is None:  # a_t / u_t is constant per group by construction of the groups
        raise AssertionError(f"{scheme.name}: intended weights vary inside a group")

    candidates = _candidates(
        scheme, fixture, batch, weights, model, g, scale, previous_denominators, max_grad_norm
    )
    candidates += pipeline_candidates(scheme, batch, weights, pipeline_stages)
    per_group = [
        None if c.leaf_scales else per_group_weights(c.weights, group_of, units) for c in candidates
    ]
    # A basis predicts only the weightings that are constant per group.
    candidates, per_group, basis_note = predictable(candidates, per_group, basis)
    errors_by_candidate = [
        tree_rel_err(model.live(grads), model.live(model.predict(c))).max_rel_err
        for c in candidates
    ]
    level = noise_level(fit, g, candidates, per_group, model.predict_flat, allowed)
    judged_at, judged, log_note = judge_levels(
        fit, candidates, per_group, errors_by_candidate, level, allowed, labels, logged_denominator
    )

    fitting = [j.candidate for j in judged if j.fits]
    explanations = minimal((c.name for c in fitting if not c.degenerate), scheme.name)
    best = name_of(explanations)
    # A non-finite gradient fits nothing; on a layout with a unit the intended scheme counts
    # nothing in, a local 0/0 is what made it (crosscheck.diagnosis.zero_count).
    zero_note = zero_count_note(scheme, batch, unusable) if unusable else ""
    if zero_note:
        explanations, best = [ZERO_COUNT_NAN], ZERO_COUNT_NAN
    errors: dict[str, float] = {}
    for j in judged:
        errors[j.candidate.name] = min(j.error, errors.get(j.candidate.name, math.inf))
    notes = {c.name: c.note for c in fitting if c.note}
    for key, note in (
        ("logged denominator", log_note),
        (ZERO_COUNT_NAN, zero_note),
        ("group basis", basis_note),
    ):
        if note:
            notes[key] = note

    with np.errstate(divide="ignore", invalid="ignore"):
        relative = np.where(intended_c != 0, fit.weights / intended_c, np.nan)
    relative = relative[intended_c != 0] if relative.size else relative
    diagnosis = Diagnosis(
        fixture=fixture.name,
        world_size=world_size,
        accum_steps=accum_steps,
        context_size=context_size,
        context_order=context_order,
        scheme=scheme,
        dtype=dtype,
        precision=judged_at,
        beyond_precision=level is None,
        intended_error=intended_error,
        detected=scheme.name not in {c.name for c in fitting if c.kind == "intended"},
        best_match=best,
        matches=tuple(explanations),
        fits=tuple(dict.fromkeys(c.name for c in fitting)),
        scale=scale,
        weight_ratio=_ratio(relative),
        intended_weight_ratio=_ratio(weights[group_of >= 0]),
        residual=fit.residual,
        condition_number=fit.condition,
        well_posed=bool(fit.condition <= CONDITION_LIMIT),
        # The coarsest level the verdict could have moved to is what it guarantees: under
        # "auto" a float64 step's 2e-12 skew would agree at float32-level.
        detectable_skew=detectable_skew(fit, intended_c, allowed[-1], labels),
        skew_level=allowed[-1],
        strict_skew=detectable_skew(fit, intended_c, "float64", labels),
        worst_unit=_worst_unit_text(check_weights(fit, intended_c, judged_at, labels)),
        explanation="",
        groups=_group_weights(keys, group_of, fit.weights, intended_c),
        candidate_errors=errors,
        notes=notes,
        unusable=unusable,
        framework=framework,
    )
    return with_explanation(diagnosis)


def _allowed_levels(precision: str, dtype: str) -> tuple[str, ...]:
    """The precision levels the verdict may judge at, finest first."""
    if precision == "auto":
        return auto_levels(dtype)
    if precision in PRECISIONS:
        auto_levels(dtype)  # validates dtype
        return (precision,)
    raise ValueError(f"precision must be auto or one of {', '.join(PRECISIONS)}")


@dataclass(frozen=True)
class _GradientModel:
    """The gradient of any token weighting, as the diagnosed model gives it: the group basis
    B [K, P] with each group's mass, the flat gradient of [N, T] weights, the same as a
    dict of named leaves, and which entries a comparison reads (`live`)."""

    shapes: dict[str, tuple[int, ...]]
    basis_matrix: np.ndarray
    mass: np.ndarray
    flat_grad_of: Callable[[np.ndarray], np.ndarray]
    live: Callable[[Params], Params]

    def grad_of(self, token_weights: np.ndarray) -> Params:
        flat, out, start = self.flat_grad_of(token_weights), {}, 0
        for key, shape in self.shapes.items():
            size = int(np.prod(shape))
            out[key] = flat[start : start + size].reshape(shape)
            start += size
        return out

    def predict(self, candidate: Candidate) -> Params:
        """A candidate's gradient: its weights', with its leaf scales where it has them."""
        grads = self.grad_of(candidate.weights)
        for leaf, factor in (candidate.leaf_scales or {}).items():
            grads[leaf] = grads[leaf] * factor
        return grads

    def predict_flat(self, candidate: Candidate) -> np.ndarray:
        if not candidate.leaf_scales:
            return self.flat_grad_of(candidate.weights)
        return _flat(self.predict(candidate))


def _gradient_model(
    fixture: Fixture,
    grads: Params,
    params: Params | None,
    basis: GroupBasis | None,
    group_of: np.ndarray,
    units: np.ndarray,
    keys: list[GroupKey],
) -> _GradientModel:
    """The analytic bilinear model's per-token Jacobian at `params`, or a model's own `basis`
    (checked against the fixture, its groups and the gradient's leaves)."""
    if basis is not None:  # any model: its own group basis (crosscheck.diagnosis.group_basis)
        basis.check(fixture, keys, grads)
        return _GradientModel(
            dict(basis.shapes),
            basis.matrix,
            group_mass(group_of, units, len(keys)),
            basis_grad_of(basis, group_of, units),
            basis.live,
        )
    params = fixture.params() if params is None else params
    valid = fixture.valid
    jacobian = token_jacobian(params, fixture.inputs, fixture.targets)
    matrix, mass = jacobian_group_basis(jacobian, group_of[valid], units[valid], len(keys))
    return _GradientModel(
        {k: np.shape(params[k]) for k in sorted(params)},
        matrix,
        mass,
        lambda token_weights: token_weights[valid] @ jacobian,
        dict,
    )


def _candidates(
    scheme: SchemeSpec,
    fixture: Fixture,
    batch: LaidOutBatch,
    weights: np.ndarray,
    model: _GradientModel,
    g: np.ndarray,
    scale: float,
    previous_denominators: Sequence[float],
    max_grad_norm: float | None,
) -> list[Candidate]:
    """The intended scheme first, then every pattern, scheme and family that may explain G.

    Under context parallel the patterns of data-parallel ranks and microbatches are those of
    the batch without the context split (a rank's rows are the same rows), and the
    context-parallel patterns come on top (`context_candidates`)."""
    candidates = [Candidate(scheme.name, "intended", weights, scheme.global_denominator(batch))]
    if batch.layout.context_size > 1:
        candidates += context_candidates(scheme, batch)
        batch = fixture.layout(batch.layout.world_size, batch.layout.accum_steps)
    candidates += local_mean_candidates(scheme, batch)
    candidates += scale_candidates(scheme, fixture, batch, weights, tuple(previous_denominators))
    if max_grad_norm is not None:
        candidates += clip_candidates(model.grad_of, batch, weights, max_grad_norm)
    candidates += float32_count_candidate(scheme, batch, weights, scale)
    candidates += scheme_candidates(scheme, batch)
    candidates += family_candidates(g, weights, batch, model.flat_grad_of)
    return candidates


def _group_weights(
    keys: list[GroupKey],
    group_of: np.ndarray,
    found: np.ndarray,
    intended: np.ndarray,
) -> tuple[GroupWeight, ...]:
    """Each (row, segment) group's recovered weight beside the intended one."""
    return tuple(
        GroupWeight(
            rank=key.rank,
            microbatch=key.microbatch,
            row=key.row,
            segment=key.segment,
            tokens=int(np.count_nonzero(group_of == index)),
            weight=float(found[index]),
            intended=float(intended[index]),
        )
        for index, key in enumerate(keys)
    )


def _worst_unit_text(check: WeightCheck) -> str:
    if not math.isfinite(check.ratio):
        return "not finite"
    return f"{check.unit}: {check.deviation:+.2e} (bound {check.bound:.2e})"


def with_explanation(diagnosis: Diagnosis) -> Diagnosis:
    """The diagnosis with its explanation and fix filled in (see `crosscheck.diagnosis.explain`)."""
    text, fix = explain(diagnosis)
    return replace(diagnosis, explanation=text, fix=fix)
