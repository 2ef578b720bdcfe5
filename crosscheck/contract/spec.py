r"""Schemes as data: the numpy interpretation of a scheme spec (docs/schemes-as-data.md).

A spec gives every token a numerator weight and every unit of a scope a denominator:

.. math::

    a_t = m_t\, s_t\, n_G(t)^{-\alpha}, \qquad
    L = \frac{1}{K} \sum_{u} \frac{\sum_{t \in u} a_t l_t}{D_u}

with :math:`m_t` the numerator mask, :math:`s_t` the soft factor, :math:`n_G(t)` the masked
count of t's group G inside t's unit of the count scope, and :math:`D_u` the denominator of
the kind the spec names over the unit u of the scope U (K units: 1, R or R M). A unit with
:math:`D_u = 0` contributes 0. The effective weight of token t is
:math:`c_t = a_t / D_{u(t)} / K`.

This is the oracle's reading; ``jax_impl.spec`` and ``torch_impl.spec`` read the same dict with
their own code (a shared helper would hide a shared bug). The named schemes and trainer modes
are data in `crosscheck.contract.spec_catalogue`; `get_spec` reads them by name.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from crosscheck.contract.layout import IGNORE_INDEX, LaidOutBatch
from crosscheck.contract.row_fields import default_row_fields
from crosscheck.contract.spec_catalogue import (
    DEFAULT_PARAMETERS,
    MODE_SPECS,
    NAMED_SPECS,
    PARAMETRIC_SPECS,
    known_spec_names,
)

WEIGHT_MASKS = ("valid", "sample")
DENOMINATOR_MASKS = ("valid", "sample", "nonzero_weight")
SOFT_FACTORS = ("none", "token", "row")
GROUPINGS = ("none", "row", "segment", "document", "group", "microbatch", "rank")
SCOPES = ("microbatch", "rank", "update")
KINDS = (
    "tokens",
    "groups",
    "all_groups",
    "weight_sum",
    "abs_row_weight_sum",
    "power_sum",
    "slots",
    "configured",
    "one",
)
#: Groupings whose members may lie in several microbatches or ranks of one update.
SPANNING_GROUPINGS = ("document", "group", "microbatch", "rank")


def _choice(where: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"scheme spec: {where} = {value!r} is not one of {', '.join(allowed)}")
    return str(value)


def _number(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"scheme spec: {where} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"scheme spec: {where} must be finite, got {value!r}")
    return float(value)


def _fields(where: str, given: Any, allowed: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(given, dict):
        raise ValueError(f"scheme spec: {where} must be a dict, got {type(given).__name__}")
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        raise ValueError(f"scheme spec: unknown key(s) {unknown} in {where}; known: {allowed}")
    return given


@dataclass(frozen=True)
class WeightSpec:
    """a_t = m_t s_t n_G(t)^(-alpha): mask, soft factor, grouping, power, count scope."""

    mask: str = "valid"
    soft: str = "none"
    group: str = "none"
    alpha: float = 1.0
    count_scope: str = "update"

    def __post_init__(self) -> None:
        _choice("weight.mask", self.mask, WEIGHT_MASKS)
        _choice("weight.soft", self.soft, SOFT_FACTORS)
        _choice("weight.group", self.group, GROUPINGS)
        _choice("weight.count_scope", self.count_scope, SCOPES)
        object.__setattr__(self, "alpha", _number("weight.alpha", self.alpha))


@dataclass(frozen=True)
class DenominatorSpec:
    """D_u: what is counted or summed (kind), over which grouping and mask; `value` if fixed."""

    kind: str = "tokens"
    group: str = "none"
    mask: str = "valid"
    alpha: float = 1.0
    value: float | None = None

    def __post_init__(self) -> None:
        _choice("denominator.kind", self.kind, KINDS)
        _choice("denominator.group", self.group, GROUPINGS)
        _choice("denominator.mask", self.mask, DENOMINATOR_MASKS)
        object.__setattr__(self, "alpha", _number("denominator.alpha", self.alpha))
        if self.kind in ("groups", "all_groups", "power_sum") and self.group == "none":
            raise ValueError(f"scheme spec: denominator.kind {self.kind!r} needs a group")
        if self.kind == "configured":
            if self.value is None or not _number("denominator.value", self.value) > 0:
                raise ValueError("scheme spec: a configured denominator needs a value > 0")
            object.__setattr__(self, "value", float(self.value))
        elif self.value is not None:
            raise ValueError(f"scheme spec: denominator.kind {self.kind!r} takes no value")


@dataclass(frozen=True)
class SchemeSpec:
    """A weighting scheme as data; `name` is only a label (it takes no part in the math)."""

    weight: WeightSpec = field(default_factory=WeightSpec)
    denominator: DenominatorSpec = field(default_factory=DenominatorSpec)
    scope: str = "update"
    name: str = "custom"

    def __post_init__(self) -> None:
        _choice("scope", self.scope, SCOPES)

    @classmethod
    def from_dict(cls, spec: dict[str, Any], name: str = "custom") -> SchemeSpec:
        """Read the JSON form of docs/schemes-as-data.md; every key has a default."""
        spec = _fields("the spec", spec, ("weight", "denominator", "scope", "name"))
        weight = _fields("weight", spec.get("weight", {}), tuple(WeightSpec.__dataclass_fields__))
        denominator = _fields(
            "denominator", spec.get("denominator", {}), tuple(DenominatorSpec.__dataclass_fields__)
        )
        return cls(
            WeightSpec(**weight),
            DenominatorSpec(**denominator),
            spec.get("scope", "update"),
            spec.get("name", name),
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON form, every key written out (what the JAX and torch references read)."""
        return {
            "name": self.name,
            "weight": asdict(self.weight),
            "denominator": asdict(self.denominator),
            "scope": self.scope,
        }

    @property
    def layout_invariant(self) -> bool:
        """True when the objective is the same for every layout (R, M) of one global batch:
        D over the whole update, and no count of a spanning group taken more locally."""
        local_count = self.weight.group in SPANNING_GROUPINGS and (
            self.weight.count_scope != "update" or self.weight.group in ("microbatch", "rank")
        )
        d = self.denominator
        counted = d.kind in ("groups", "all_groups", "power_sum")
        # D counting microbatches or ranks counts the layout itself; a power sum of spanning
        # groups counted more locally than the update sums pieces that the layout cuts.
        local_denominator = counted and (
            d.group in ("microbatch", "rank")
            or (
                d.kind == "power_sum"
                and d.group in SPANNING_GROUPINGS
                and self.weight.count_scope != "update"
            )
        )
        return self.scope == "update" and not local_count and not local_denominator

    @property
    def intended(self) -> bool:
        """An intended scheme: its objective does not depend on the layout (R, M) of the batch
        (`layout_invariant`). rank_mean, microbatch_mean and every local scope are not."""
        return self.layout_invariant

    def global_denominator(self, batch: LaidOutBatch) -> float:
        """The denominator a step would log: D of an update-scope spec; for a local scope the
        number of units K (R, or R M), as each unit divides by its own D_u."""
        denominators = self.unit_denominators(batch)
        return denominators[0] if self.scope == "update" else float(len(denominators))

    def effective_weights(self, batch: LaidOutBatch) -> np.ndarray:
        """c_t = a_t / D_u(t) / K for every token, [R, M, B, T] float64 (0 where D_u = 0)."""
        # One view of the batch for a_t and every D_u (its per-token arrays are most of the
        # cost of an oracle step on these small batches).
        view = _BatchView(batch)
        a = self._token_weights(view)
        units = view.unit(self.scope)
        out = np.zeros(a.shape, dtype=np.float64)
        denominators = self._unit_denominators(view)
        for u, D in enumerate(denominators):
            if D != 0:
                inside = units == u
                out[inside] = a[inside] / D / len(denominators)
        return out

    def unit_denominators(self, batch: LaidOutBatch) -> list[float]:
        """D_u of every unit of the scope: [D] for update, one per rank or per (rank, m)."""
        return self._unit_denominators(_BatchView(batch))

    def _unit_denominators(self, view: _BatchView) -> list[float]:
        units = view.unit(self.scope)
        count = {"update": 1, "rank": view.R, "microbatch": view.R * view.M}[self.scope]
        return [self._unit_denominator(view, units == u) for u in range(count)]

    def token_weights(self, batch: LaidOutBatch) -> np.ndarray:
        """a_t for every token, [R, M, B, T] float64."""
        return self._token_weights(_BatchView(batch))

    def _token_weights(self, view: _BatchView) -> np.ndarray:
        w = self.weight
        mask = view.mask(w.mask)
        a = mask.astype(np.float64)
        if w.soft == "token":
            a = a * view.weights
        elif w.soft == "row":
            a = a * view.row_weights
        if w.group != "none":
            counts = view.counts(w.group, w.count_scope, mask)
            safe = np.where(counts > 0, counts, 1.0)
            factor = 1.0 / safe if w.alpha == 1.0 else safe ** (-w.alpha)
            a = a * factor
        return np.where(mask, a, 0.0)

    def _unit_denominator(self, view: _BatchView, inside: np.ndarray) -> float:
        """D_u over the tokens `inside` the unit ([R, M, B, T] bool)."""
        d = self.denominator
        mask = view.mask(d.mask)
        if d.kind == "one":
            return 1.0
        if d.kind == "configured":
            return float(d.value)
        if d.kind == "tokens":
            return float(np.count_nonzero(mask & inside))
        if d.kind == "slots":
            return float(np.count_nonzero(inside))
        if d.kind == "weight_sum":
            return math.fsum(view.weights[mask & inside].tolist())
        keys = view.keys(d.group)
        if d.kind == "groups":
            return float(np.unique(keys[mask & inside]).size)
        if d.kind == "power_sum":
            # One term per group and unit of the count scope: a group counted in two
            # microbatches is two pieces in a_t, and so in D.
            counts = view.counts(d.group, self.weight.count_scope, mask)
            chosen = mask & inside
            pieces = np.stack([view.unit(self.weight.count_scope)[chosen], keys[chosen]], axis=1)
            _, first = np.unique(pieces, axis=0, return_index=True)
            return math.fsum((counts[chosen][first] ** (-d.alpha)).tolist())
        # The rows of the unit: whole rows, or under context parallel every row with a
        # position in it (each context rank holds a part of every row of its microbatch).
        rows = inside.any(axis=-1)
        if d.kind == "abs_row_weight_sum":
            return math.fsum(np.abs(view.row_weights[..., 0][rows]).tolist())
        if d.mask == "sample":
            rows = rows & (view.sample_mask[..., 0] != 0)
        # all_groups: every group present in the unit, empty ones included: a row-level group
        # by any position of a kept row, a segment or document by a nonzero segment id.
        present = inside & rows[..., None]
        if d.group not in ("row", "group", "microbatch", "rank"):
            present = present & (view.segment_ids > 0)
        return float(np.unique(keys[present]).size)


class _BatchView:
    """Per-token arrays of a laid-out batch: masks, group keys, unit ids, counts."""

    def __init__(self, batch: LaidOutBatch) -> None:
        R, self.M, self.B, self.T = batch.targets.shape
        C = batch.layout.context_size
        #: Processes: data-parallel rank r and context rank c are process r C + c.
        self.R = R * C
        shape = batch.targets.shape
        # A field the batch was laid out without takes the contract's default (a batch of v1's
        # arrays alone: every row its own group and sampled, weight 1, documents per segment).
        defaults = default_row_fields(batch.segment_ids.reshape(-1, self.T))
        fields = {
            key: defaults[key].reshape(shape[: defaults[key].ndim + 2])
            if getattr(batch, key) is None
            else getattr(batch, key)
            for key in defaults
        }
        self.valid = batch.targets != IGNORE_INDEX
        self.segment_ids = batch.segment_ids
        self.weights = batch.weights.astype(np.float64)
        row_weights = fields["row_weights"][..., None]
        self.row_weights = np.broadcast_to(row_weights, shape).astype(np.float64)
        self.sample_mask = np.broadcast_to(fields["sample_mask"][..., None], shape)
        self.document_ids = fields["document_ids"]
        self.group_ids = np.broadcast_to(fields["group_ids"][..., None], shape)
        r, m, b, _ = np.indices(shape)
        self.row = (r * self.M + m) * self.B + b
        # The process holding each position; a microbatch is one process's share of one
        # accumulation step (a part of each of its rows under context parallel).
        self.rank = r * C + batch.layout.context_ranks(self.T)
        self.microbatch = self.rank * self.M + m

    def mask(self, name: str) -> np.ndarray:
        if name == "sample":
            return self.valid & (self.sample_mask != 0)
        if name == "nonzero_weight":
            return self.valid & (self.weights != 0)
        return self.valid

    def unit(self, scope: str) -> np.ndarray:
        return {"microbatch": self.microbatch, "rank": self.rank}.get(
            scope, np.zeros_like(self.rank)
        )

    def keys(self, group: str) -> np.ndarray:
        """An integer per token naming its group (distinct groups, distinct keys)."""
        if group == "segment":
            width = int(self.segment_ids.max(initial=0)) + 1
            return self.row * width + self.segment_ids
        return {
            "none": np.zeros_like(self.row),
            "row": self.row,
            "document": self.document_ids,
            "group": self.group_ids,
            "microbatch": self.microbatch,
            "rank": self.rank,
        }[group]

    def counts(self, group: str, scope: str, mask: np.ndarray) -> np.ndarray:
        """n_G(t): masked tokens sharing t's group inside t's unit of `scope`, float64."""
        pairs = np.stack([self.unit(scope).ravel(), self.keys(group).ravel()], axis=1)
        _, inverse = np.unique(pairs, axis=0, return_inverse=True)
        inverse = inverse.ravel()
        counts = np.bincount(inverse, weights=mask.ravel().astype(np.float64))
        return counts[inverse].reshape(mask.shape)


def get_spec(scheme: str | dict[str, Any] | SchemeSpec) -> SchemeSpec:
    """A `SchemeSpec` from a name (``length_power:0.5``, ``constant:4096``), a dict or a spec."""
    if isinstance(scheme, SchemeSpec):
        return scheme
    if isinstance(scheme, dict):
        return SchemeSpec.from_dict(scheme)
    name, sep, argument = str(scheme).partition(":")
    if name in NAMED_SPECS and not sep:
        return SchemeSpec.from_dict(NAMED_SPECS[name], name)
    if name in MODE_SPECS and not sep:
        return SchemeSpec.from_dict(MODE_SPECS[name], name)
    if name == "constant" and sep:
        return SchemeSpec.from_dict(
            {"denominator": {"kind": "configured", "value": _parameter(scheme, argument)}},
            str(scheme),
        )
    if name in PARAMETRIC_SPECS:
        _, make = PARAMETRIC_SPECS[name]
        value = _parameter(scheme, argument) if sep else DEFAULT_PARAMETERS[name]
        return SchemeSpec.from_dict(make(value), f"{name}:{value:g}")
    raise ValueError(
        f"unknown scheme {scheme!r}; known: {', '.join(known_spec_names())} "
        "(constant:C, configured_rows_mean:B, configured_rows_sum:B, length_power:alpha take "
        "a number)"
    )


def _parameter(scheme: str, argument: str) -> float:
    try:
        value = float(argument)
    except ValueError:
        raise ValueError(f"{scheme!r}: the part after ':' must be a number") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{scheme!r}: the number after ':' must be finite and > 0")
    return value
