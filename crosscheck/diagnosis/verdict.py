r"""Precision-aware verdicts: weighting and numerics told apart.

A step's gradient :math:`G` is compared with what a hypothesis (the intended scheme, a bug
pattern, another scheme) predicts. A float32 or bf16 step cannot match any prediction to float64
rounding, yet its *weighting* can be exactly right. The verdict therefore looks at the gradient
in two parts.

**The fit.** Valid tokens fall into groups g (one per rank, microbatch, row and segment), each
with the basis gradient :math:`b_g = \sum_{t \in g} u_t \nabla l_t` (:math:`u_t` = the soft
weight for weighted_mean, else 1). Least squares gives the per-group weights

.. math::  \hat c = \arg\min_c \lVert G - B c \rVert, \qquad r = G - B \hat c .

A reweighting of tokens, right or wrong, lies in the span of B; rounding noise mostly does
not. With P parameters and K groups (P = 960 and K <= 121 on the built-in fixtures),

* the **residual** :math:`\rho = \lVert r \rVert / \lVert G \rVert` measures the numerics.
  Its size says at which precision the step computes: about 1e-15 for float64 arithmetic,
  5e-8 for float32 (Hugging Face's ``logits.float()``), 3e-3 for bf16. The *level* of a
  gradient is the finest precision whose tolerance (``crosscheck.judge.compare.RTOL_BY_DTYPE``:
  1e-12, 1e-5, 2e-2) admits :math:`\rho`;
* the per-component noise is :math:`\hat\sigma = \lVert r \rVert / \sqrt{P - \operatorname{rank}
  B}`, and the recovered weights carry the covariance :math:`\hat\sigma^2 (B^\top B)^{-1}` (the
  classical least-squares result for noise that is independent across components). With no
  dimension left over (rank B = P) the noise cannot be measured: the worst-leaf test alone
  decides, and the level is the finest at which some hypothesis explains G.

**The weight test.** A hypothesis H with per-group weights :math:`c^H` fits at level p when
its worst-leaf relative error is within the level's tolerance (docs/contract.md's test) *and* every
unit u of the layout (the whole update, each rank, each rank's microbatch, each group) has

.. math::

    |\lambda_u| \le \tau_p + z\, \mathrm{se}(\lambda_u), \qquad
    \lambda_u = \frac{\sum_{g \in u} U_g (\hat c_g - c^H_g)}{\sum_{g \in u} U_g |c^H_g|},

:math:`U_g = \sum_{t \in g} u_t`: :math:`\lambda_u` is the relative excess of weight on u.
:math:`\tau_p` (the level's tolerance) admits the rounding that is *not* noise-like: a few
roundings of a scalar such as 1/D or a float sum of soft weights scale a whole microbatch at
once and lie in the span of B (measured: 6e-8 on a float32 step, 2e-3 on a bf16 one, each
below its tolerance). :math:`z\,\mathrm{se}` admits what the measured noise can move a
recovered weight by; :math:`z` = `Z_SCORE`.

**Sensitivity.** Scaling rank r's weights by s gives :math:`\lambda_r = s - 1` plus noise, so a
skew of any one rank is flagged for sure from
:math:`s = 1 + \tau_p + 2 z \max_r \mathrm{se}(\lambda_r)` (per microbatch when R = 1): it
follows from the step's own measured noise.

**The level.** Automatic verdicts start at the finest level the noise allows and move to a
coarser allowed level only while nothing but a family fits: a float64 step whose 1/D was
rounded to float32 agrees at float32-level, a float32 step never at float64.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from crosscheck.judge.compare import RTOL_BY_DTYPE

#: The levels a verdict is given at, finest first.
PRECISIONS: tuple[str, ...] = ("float64", "float32", "bfloat16")
#: How a level is named in reports.
LEVEL_NAMES: dict[str, str] = {
    "float64": "float64-exact",
    "float32": "float32-level",
    "bfloat16": "bf16-level",
}
#: A recovered weight may sit this many standard errors from the hypothesis. The recovered
#: weights of correct float32 and bf16 steps on the built-in fixtures sit at most 6.5 standard
#: errors away at the group level (121 groups, rounding noise heavier-tailed than Gaussian),
#: and the tolerance term covers the rest; 6 keeps a bf16 group-level test from false alarms
#: without widening the aggregate (rank) tests, whose standard errors are 100x smaller.
Z_SCORE = 6.0


def tolerance(level: str) -> float:
    """τ_p: the worst-leaf tolerance of the contract at this level, also the weight tolerance."""
    return RTOL_BY_DTYPE[level]


def auto_levels(dtype: str) -> tuple[str, ...]:
    """The levels an automatic verdict may choose for a step given params of `dtype`.

    bf16 only when the step's params are bf16: a float32 step whose gradient is 1e-3 off is
    not explained by its own rounding, and reading it as bf16 noise would wave it through.
    """
    if dtype not in RTOL_BY_DTYPE:
        raise ValueError(f"dtype must be one of {', '.join(RTOL_BY_DTYPE)}, got {dtype!r}")
    return ("float64", "float32", "bfloat16") if dtype == "bfloat16" else ("float64", "float32")


#: The level a gradient of each floating dtype is judged at: float16's 11 significant bits lie
#: between bf16's 8 and float32's 24, and are judged at bf16-level (the coarser: a float16
#: step's rounding is never taken for a weighting error).
LEVEL_OF_DTYPE = {
    "float64": "float64",
    "float32": "float32",
    "bfloat16": "bfloat16",
    "float16": "bfloat16",
}


def level_of_dtypes(dtypes: Iterable[str]) -> str | None:
    """The coarsest level of the floating dtypes a step's gradient came back in (their names:
    "float32", "bfloat16", ...; others are ignored), or None when there is none."""
    return coarsest_level(LEVEL_OF_DTYPE.get(name) for name in dtypes)


def coarsest_level(levels: Iterable[str | None]) -> str | None:
    """The coarsest of `levels` (None where none is known)."""
    known = [level for level in levels if level is not None]
    return max(known, key=PRECISIONS.index) if known else None


def level_of(noise: float, allowed: Sequence[str]) -> str | None:
    """The finest of `allowed` whose tolerance admits the relative residual `noise`."""
    return next((level for level in allowed if noise <= tolerance(level)), None)


@dataclass(frozen=True, slots=True)
class GroupFit:
    """Least-squares group weights of one gradient, with the noise its residual shows."""

    #: ĉ_g: per-unit weight of each group (times u_t gives a token's weight).
    weights: np.ndarray
    #: U_g = sum of u_t over the group.
    mass: np.ndarray
    #: Rank and microbatch of each group.
    rank: np.ndarray
    microbatch: np.ndarray
    #: ρ = |G - B ĉ| / |G| (inf when G is not finite).
    residual: float
    #: σ̂: estimated noise per gradient component (nan when no dimension is left to see it).
    sigma: float
    #: Condition number of the column-normalized basis (inf when its rank is below K).
    condition: float
    #: (Bᵀ B)⁻¹ [K, K], so that Cov(ĉ) = σ̂² (Bᵀ B)⁻¹; a direction the basis cannot see has a
    #: huge variance (its weight is unknown), never zero.
    inverse_gram: np.ndarray
    #: P - rank(B): the dimensions only noise can reach; 0 means the noise cannot be measured.
    dof: int

    @property
    def finite(self) -> bool:
        return math.isfinite(self.residual)

    @property
    def noise_measurable(self) -> bool:
        return self.finite and self.dof > 0


def jacobian_group_basis(
    jacobian: np.ndarray, group_of: np.ndarray, units: np.ndarray, num_groups: int
) -> tuple[np.ndarray, np.ndarray]:
    """(B [K, P], U [K]): b_g = sum_{t in g} u_t grad l_t from the per-token Jacobian
    [valid tokens, P], and U_g = sum_{t in g} u_t; `group_of`, `units` per valid token (group
    -1: carries no weight)."""
    carries = group_of >= 0
    basis = np.zeros((num_groups, jacobian.shape[1]))
    np.add.at(basis, group_of[carries], units[carries, None] * jacobian[carries])
    mass = np.bincount(group_of[carries], weights=units[carries], minlength=num_groups)
    return basis, mass


def fit_groups(
    jacobian: np.ndarray,
    gradient: np.ndarray,
    group_of: np.ndarray,
    units: np.ndarray,
    rank: np.ndarray,
    microbatch: np.ndarray,
) -> GroupFit:
    """Fit G = sum_g c_g b_g. `jacobian` [valid tokens, P]; `group_of`, `units` per valid token
    (group -1: carries no weight); `rank`, `microbatch` per group."""
    basis, mass = jacobian_group_basis(jacobian, group_of, units, len(rank))
    return fit_group_basis(basis, gradient, mass, rank, microbatch)


def fit_group_basis(
    basis: np.ndarray,
    gradient: np.ndarray,
    mass: np.ndarray,
    rank: np.ndarray,
    microbatch: np.ndarray,
) -> GroupFit:
    """Fit G = sum_g c_g b_g on the group basis `basis` [K, P] (row g: b_g), with U_g = `mass`
    [K] and each group's `rank` and `microbatch` [K]."""
    K = len(rank)
    P = gradient.size
    if basis.shape != (K, P):
        raise ValueError(f"the group basis has shape {basis.shape}, expected ({K}, {P})")
    if not np.isfinite(gradient).all():
        nan = np.full(K, np.nan)
        return GroupFit(
            nan, nan, rank, microbatch, math.inf, math.nan, math.nan, np.full((K, K), np.nan), 0
        )
    norm_g = float(np.linalg.norm(gradient))
    if K == 0:
        residual = 0.0 if norm_g == 0 else 1.0
        empty = np.zeros(0)
        return GroupFit(
            empty, empty, rank, microbatch, residual, norm_g / math.sqrt(P), 1.0, np.eye(0), P
        )
    mass = np.asarray(mass, dtype=np.float64)
    basis = np.asarray(basis, dtype=np.float64).T
    norms = np.linalg.norm(basis, axis=0)
    norms = np.where(norms > 0, norms, 1.0)
    # Full right singular vectors: with more groups than parameters (K > P) the K - P
    # directions the basis cannot see must be in the covariance too, with a huge variance.
    # Only then: full matrices also build the P x P left factor, 80 GB at a model's P = 1e5.
    left, singular, right_t = np.linalg.svd(basis / norms, full_matrices=K > P)
    values = np.concatenate([singular, np.zeros(K - singular.size)])
    floor = values[0] * 1e-15
    seen = values > floor
    rank_of_basis = int(np.count_nonzero(seen))
    condition = float(values[0] / values[-1]) if rank_of_basis == K else math.inf
    # Least squares through the directions the basis sees (the minimum-norm solution).
    projected = left[:, : singular.size].T @ gradient
    scaled_coefficients = right_t[seen].T @ (projected[seen[: singular.size]] / values[seen])
    coefficients = scaled_coefficients / norms
    residual_norm = float(np.linalg.norm(gradient - basis @ coefficients))
    dof = P - rank_of_basis
    sigma = residual_norm / math.sqrt(dof) if dof > 0 else math.nan
    scaled = right_t.T / np.maximum(values, floor)
    inverse_gram = (scaled @ scaled.T) / np.outer(norms, norms)
    return GroupFit(
        weights=coefficients,
        mass=mass,
        rank=rank,
        microbatch=microbatch,
        residual=residual_norm / max(norm_g, 1e-300),
        sigma=sigma,
        condition=condition,
        inverse_gram=inverse_gram,
        dof=dof,
    )


@dataclass(frozen=True, slots=True)
class WeightCheck:
    """The worst unit of the weight test against one hypothesis."""

    #: max over units of |λ_u| / (τ + z se_u): at most 1 passes.
    ratio: float
    #: The worst unit, in words ("rank 1", "rank 0 microbatch 1", "the whole update", ...).
    unit: str
    #: λ_u and its bound τ + z se_u there.
    deviation: float
    bound: float

    @property
    def ok(self) -> bool:
        return self.ratio <= 1.0


@dataclass(frozen=True, slots=True)
class WeightUnit:
    """A set of groups whose weight the weight test measures: the update, a rank, one rank's
    microbatch, or a single (row, segment) group; `name` says it in words."""

    kind: str  # "update", "rank", "microbatch" or "group"
    name: str


def _units(fit: GroupFit, labels: Sequence[str]) -> tuple[np.ndarray, list[WeightUnit]]:
    """Membership [units, groups] of every unit of the weight test, and the units."""
    K = len(fit.rank)
    rows, units = [np.ones(K, dtype=bool)], [WeightUnit("update", "the whole update")]
    for r in np.unique(fit.rank):
        rows.append(fit.rank == r)
        units.append(WeightUnit("rank", f"rank {int(r)}"))
        for m in np.unique(fit.microbatch[fit.rank == r]):
            rows.append((fit.rank == r) & (fit.microbatch == m))
            units.append(WeightUnit("microbatch", f"rank {int(r)} microbatch {int(m)}"))
    rows += list(np.eye(K, dtype=bool))
    units += [WeightUnit("group", label) for label in labels]
    return np.array(rows), units


def unit_deviations(
    fit: GroupFit, hypothesis: np.ndarray, labels: Sequence[str]
) -> tuple[np.ndarray, np.ndarray, list[WeightUnit]]:
    """λ_u and se(λ_u) of every unit against per-group weights `hypothesis`."""
    member, units = _units(fit, labels)
    weighted = member * fit.mass  # a_u: U_g on the unit's groups
    mass = weighted @ np.abs(hypothesis)
    # A unit the hypothesis gives no weight at all is measured against the update's mean
    # weight, so that any weight found there counts as a relative excess.
    mean = (fit.mass @ np.abs(hypothesis)) / max(float(fit.mass.sum()), 1e-300)
    mass = np.where(mass > 0, mass, weighted.sum(axis=1) * mean)
    mass = np.where(mass > 0, mass, 1e-300)
    deviation = weighted @ (fit.weights - hypothesis) / mass
    variance = np.einsum("uk,kl,ul->u", weighted, fit.inverse_gram, weighted)
    se = fit.sigma * np.sqrt(np.maximum(variance, 0.0)) / mass
    return deviation, se, units


def check_weights(
    fit: GroupFit, hypothesis: np.ndarray, level: str, labels: Sequence[str]
) -> WeightCheck:
    """The weight test of the module docstring at `level`."""
    if not fit.finite or not np.isfinite(hypothesis).all():
        return WeightCheck(math.inf, "the whole update", math.nan, 0.0)
    if len(hypothesis) == 0 or not fit.noise_measurable:
        # Nothing to test, or no dimension left to measure the noise in: the worst-leaf test
        # alone decides (see `crosscheck.diagnosis.diagnose`).
        return WeightCheck(0.0, "the whole update", 0.0, tolerance(level))
    deviation, se, units = unit_deviations(fit, hypothesis, labels)
    bound = tolerance(level) + Z_SCORE * se
    ratios = np.abs(deviation) / bound
    worst = int(np.argmax(ratios))
    return WeightCheck(
        float(ratios[worst]), units[worst].name, float(deviation[worst]), float(bound[worst])
    )


def detectable_skew(
    fit: GroupFit, intended: np.ndarray, level: str, labels: Sequence[str]
) -> tuple[str, float] | None:
    """("rank" or "microbatch", s - 1): a skew of *any one* rank's (at R = 1, microbatch's)
    weights that the weight test flags at `level` whatever the noise does; None at R = M = 1.

    A skew s gives λ = s - 1 exactly plus noise of standard error se, and is flagged when
    |λ| > τ + z se; it is flagged for sure (the noise pulling λ down by up to z se too) from
    s - 1 = τ + 2 z se, and for every rank from the largest se over the ranks.
    """
    if not fit.noise_measurable or len(intended) == 0:
        return None
    _, se, units = unit_deviations(fit, intended, labels)
    for kind in ("rank", "microbatch"):
        picked = [i for i, unit in enumerate(units) if unit.kind == kind]
        if len(picked) > 1:
            worst = max(float(se[i]) for i in picked)
            return kind, float(tolerance(level) + 2 * Z_SCORE * worst)
    return None
