r"""Schemes as data (contract v2): the spec dict, read into torch's own frozen dataclasses.

A spec (docs/schemes-as-data.md) states how an update weights its tokens:

.. math::

    L = \frac{1}{K} \sum_{u} \frac{\sum_{t \in u} a_t\, l_t}{D_u}, \qquad
    a_t = m_t\, s_t\, n_{G}(t)^{-\alpha}

with the numerator mask :math:`m_t`, the soft factor :math:`s_t`, the count :math:`n_G(t)`
of t's group G inside t's unit of ``count_scope``, and one denominator :math:`D_u` per unit u
of the scope U (K = 1, R or R M units). Its JSON form, every key defaulted (``{}`` is
``token_mean``)::

    {"weight":      {"mask": M, "soft": S, "group": G, "alpha": a, "count_scope": C},
     "denominator": {"kind": K, "group": G', "mask": M', "alpha": a', "value": x},
     "scope": U}

This module only reads and checks it: ``torch_impl.spec_counts`` computes a_t and D_u, and
``torch_impl.update`` runs an update with them. Written for torch from the doc, not from
the numpy oracle: the implementations are checked against each other.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

#: Numerator masks: ``valid`` m_t = v_t; ``sample`` v_t * sample_mask(row).
WEIGHT_MASKS = ("valid", "sample")
#: Denominator masks add ``nonzero_weight``: v_t * [w_t != 0].
DENOMINATOR_MASKS = ("valid", "sample", "nonzero_weight")
SOFT_FACTORS = ("none", "token", "row")
GROUPINGS = ("none", "row", "segment", "document", "group", "microbatch", "rank")
#: Units of a count or of the denominator, innermost first (the order is used: a count scope
#: that contains the denominator's unit, or lies inside it).
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


def _choice(section: str, key: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"spec {section}.{key} must be one of {', '.join(allowed)}; got {value!r}")
    return value


def _real(section: str, key: str, value: Any) -> float:
    # bool is an int: {"alpha": true} is a slip, not 1.
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"spec {section}.{key} must be a finite number; got {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class WeightSpec:
    """The numerator a_t = m_t s_t n_G(t)^(-alpha) (no group factor when group is none)."""

    mask: str = "valid"
    soft: str = "none"
    group: str = "none"
    alpha: float = 1.0
    count_scope: str = "update"

    def __post_init__(self) -> None:
        _choice("weight", "mask", self.mask, WEIGHT_MASKS)
        _choice("weight", "soft", self.soft, SOFT_FACTORS)
        _choice("weight", "group", self.group, GROUPINGS)
        _choice("weight", "count_scope", self.count_scope, SCOPES)
        object.__setattr__(self, "alpha", _real("weight", "alpha", self.alpha))


@dataclass(frozen=True, slots=True)
class DenominatorSpec:
    """D_u of one unit: its kind, grouping G', mask m', power alpha' and configured value."""

    kind: str = "tokens"
    group: str = "none"
    mask: str = "valid"
    alpha: float = 1.0
    value: float | None = None

    def __post_init__(self) -> None:
        _choice("denominator", "kind", self.kind, KINDS)
        _choice("denominator", "group", self.group, GROUPINGS)
        _choice("denominator", "mask", self.mask, DENOMINATOR_MASKS)
        object.__setattr__(self, "alpha", _real("denominator", "alpha", self.alpha))
        if self.kind in ("groups", "all_groups", "power_sum") and self.group == "none":
            raise ValueError(
                f"spec denominator.kind {self.kind!r} counts groups: denominator.group must be "
                f"one of {', '.join(GROUPINGS[1:])}"
            )
        if self.kind == "configured":
            if self.value is None:
                raise ValueError("spec denominator.value is required by kind 'configured'")
            value = _real("denominator", "value", self.value)
            if not value > 0:
                raise ValueError(f"spec denominator.value must be > 0; got {self.value!r}")
            object.__setattr__(self, "value", value)
        elif self.value is not None:
            raise ValueError(
                f"spec denominator.value is only read by kind 'configured', not {self.kind!r}"
            )


@dataclass(frozen=True, slots=True)
class SchemeSpec:
    """A whole spec: numerator, denominator and the scope U of D (update, rank, microbatch)."""

    weight: WeightSpec = field(default_factory=WeightSpec)
    denominator: DenominatorSpec = field(default_factory=DenominatorSpec)
    scope: str = "update"
    #: For messages and metrics only; two specs with different names can be the same math.
    name: str = "custom"

    def __post_init__(self) -> None:
        _choice("", "scope", self.scope, SCOPES)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (every key written out, the name too), which `parse_spec` reads back."""
        out = asdict(self)
        if out["denominator"]["value"] is None:
            out["denominator"].pop("value")
        return out


TOP_KEYS = ("weight", "denominator", "scope", "name")
_SECTIONS: dict[str, tuple[type, tuple[str, ...]]] = {
    "weight": (WeightSpec, ("mask", "soft", "group", "alpha", "count_scope")),
    "denominator": (DenominatorSpec, ("kind", "group", "mask", "alpha", "value")),
}


def parse_spec(spec: Mapping[str, Any], name: str = "custom") -> SchemeSpec:
    """Read the JSON form; ValueError names the bad key and what it allows.

    A ``name`` key (a label only: it takes no part in the math) overrides `name`.
    """
    if not isinstance(spec, Mapping):
        raise ValueError(f"a spec is a dict with keys {', '.join(TOP_KEYS)}; got {spec!r}")
    unknown = sorted(set(spec) - set(TOP_KEYS))
    if unknown:
        raise ValueError(f"spec has unknown key(s) {unknown}; allowed: {', '.join(TOP_KEYS)}")
    name = spec.get("name", name)
    if not isinstance(name, str):
        raise ValueError(f"spec name must be a string; got {name!r}")
    parts = {}
    for section, (cls, keys) in _SECTIONS.items():
        given = spec.get(section, {})
        if not isinstance(given, Mapping):
            raise ValueError(f"spec {section} must be a dict with keys {', '.join(keys)}")
        extra = sorted(set(given) - set(keys))
        if extra:
            raise ValueError(
                f"spec {section} has unknown key(s) {extra}; allowed: {', '.join(keys)}"
            )
        parts[section] = cls(**given)
    return SchemeSpec(scope=spec.get("scope", "update"), name=name, **parts)


def _rows_mean(kind: str = "groups", **denominator: Any) -> dict[str, Any]:
    return {
        "weight": {"group": "row"},
        "denominator": {"kind": kind, "group": "row", **denominator},
    }


#: The named specs of the doc's table; a name with ``:x`` takes the number x.
NAMED_SPECS: dict[str, dict[str, Any]] = {
    "token_mean": {},
    "sequence_mean": {
        "weight": {"group": "segment"},
        "denominator": {"kind": "groups", "group": "segment"},
    },
    "row_mean": _rows_mean(),
    "weighted_mean": {"weight": {"soft": "token"}, "denominator": {"kind": "weight_sum"}},
    "constant": {"denominator": {"kind": "slots"}},
    "sum": {"denominator": {"kind": "one"}},
    "rank_mean": {"scope": "rank"},
    "microbatch_mean": {"scope": "microbatch"},
    "all_rows_mean": _rows_mean("all_groups"),
    "sample_rows_mean": {
        "weight": {"mask": "sample", "group": "row"},
        "denominator": {"kind": "all_groups", "group": "row", "mask": "sample"},
    },
    "group_token_mean": {
        "weight": {"group": "group"},
        "denominator": {"kind": "groups", "group": "group"},
    },
    "document_mean": {
        "weight": {"group": "document"},
        "denominator": {"kind": "groups", "group": "document"},
    },
    "nonzero_weight_mean": {
        "weight": {"soft": "token"},
        "denominator": {"kind": "tokens", "mask": "nonzero_weight"},
    },
    "signed_row_weight_mean": {
        "weight": {"soft": "row", "group": "row"},
        "denominator": {"kind": "abs_row_weight_sum"},
    },
    "zero_variance_excluded": {"denominator": {"kind": "tokens", "mask": "sample"}},
}


def _parametrized(base: str, x: float) -> dict[str, Any]:
    if base == "constant":
        return {"denominator": {"kind": "configured", "value": x}}
    if base == "configured_rows_mean":
        return {"weight": {"group": "row"}, "denominator": {"kind": "configured", "value": x}}
    if base == "configured_rows_sum":
        return {"denominator": {"kind": "configured", "value": x}}
    if base == "length_power":
        return {
            "weight": {"group": "row", "alpha": x},
            "denominator": {"kind": "power_sum", "group": "row", "alpha": x},
        }
    raise KeyError(base)


PARAMETRIZED = ("constant", "configured_rows_mean", "configured_rows_sum", "length_power")
#: The number a parametrized name without ``:x`` takes (``constant`` alone is T5X's slots).
DEFAULT_PARAMETERS = {"configured_rows_mean": 8.0, "configured_rows_sum": 8.0, "length_power": 0.5}


def get_spec(spec: str | Mapping[str, Any] | SchemeSpec) -> SchemeSpec:
    """A spec from its dict, its name (``constant:4096``, ``length_power:0.5``), or itself."""
    if isinstance(spec, SchemeSpec):
        return spec
    if not isinstance(spec, str):
        return parse_spec(spec)
    base, colon, number = spec.partition(":")
    if not colon and spec in NAMED_SPECS:
        return parse_spec(NAMED_SPECS[spec], name=spec)
    if not colon and spec in DEFAULT_PARAMETERS:
        x = DEFAULT_PARAMETERS[spec]
        return parse_spec(_parametrized(base, x), name=f"{base}:{x:g}")
    if base not in PARAMETRIZED:
        raise ValueError(
            f"unknown spec {spec!r}; named specs: {', '.join(NAMED_SPECS)}; with ':x': "
            f"{', '.join(PARAMETRIZED)}"
        )
    try:
        x = float(number)
    except ValueError:
        raise ValueError(f"spec {spec!r}: {number!r} after ':' is not a number") from None
    if not (math.isfinite(x) and x > 0):
        raise ValueError(f"spec {spec!r}: the number after ':' must be finite and > 0")
    return parse_spec(_parametrized(base, x), name=spec)
