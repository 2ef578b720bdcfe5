r"""Schemes as data (contract v2, docs/schemes-as-data.md): JAX's own reading of a spec.

A spec states a normalization as data: the numerator weight of every token,

.. math::

    a_t = m_t \, s_t \, n_{G}(t)^{-\alpha},

(m_t the numerator mask, s_t the soft factor, n_G(t) the count of t's group G over the
tokens of m_t = 1 inside t's unit of ``count_scope``; no group factor when G = ``none``), the
kind of the denominator D_u over a unit u of the scope U, and U itself. With K units of U
(1, R or R M),

.. math::

    L = \frac{1}{K} \sum_u \frac{\sum_{t \in u} a_t l_t}{D_u},

and a unit with D_u = 0 contributes 0. The JSON form

    {"weight":      {"mask": M, "soft": S, "group": G, "alpha": α, "count_scope": C},
     "denominator": {"kind": K, "group": G', "mask": M', "alpha": α', "value": x},
     "scope": U}

has a default for every key (``{}`` is ``token_mean``); `parse_spec` reads it into the frozen
`SchemeSpec` below, refusing an unknown key or value with a ValueError that names the key
and the allowed values. `named_spec` knows the specs of docs/schemes-as-data.md's table, the
v1 schemes included (``constant:C``, ``configured_rows_mean:B``, ``length_power:α`` take
their number after the colon).

Written for JAX from the doc, independently of the numpy oracle in ``crosscheck``; what the
spec computes is in `jax_impl.spec_counts` (a_t, D and the count pre-pass) and
`jax_impl.accumulate` (the update under every front-end).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

MASKS = ("valid", "sample", "nonzero_weight")
"""m_t: v_t; v_t times the row's sample_mask; v_t times [w_t != 0] (denominator only)."""
WEIGHT_MASKS = ("valid", "sample")
SOFT_FACTORS = ("none", "token", "row")
"""s_t: 1; the token's w_t; the row's row_weights value, sign kept."""
GROUPINGS = ("none", "row", "segment", "document", "group", "microbatch", "rank")
"""G(t): no group; t's row; its (row, segment id); its document_ids value; its row's
group_ids value; its (rank, microbatch); its rank."""
ID_GROUPINGS = ("document", "group")
"""Groupings by a global id, which may span microbatches and ranks: their counts at rank or
update scope need the count pre-pass (`jax_impl.spec_counts`)."""
SCOPES = ("microbatch", "rank", "update")
"""Units, finest first: a (rank, microbatch), a rank, the whole global batch."""
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
GROUP_KINDS = ("groups", "all_groups", "power_sum")
"""Denominator kinds that count groups G' (a grouping other than none is required)."""


@dataclass(frozen=True, slots=True)
class WeightSpec:
    """The numerator a_t = m_t s_t n_G(t)^(-alpha); counts n_G at `count_scope`."""

    mask: str = "valid"
    soft: str = "none"
    group: str = "none"
    alpha: float = 1.0
    count_scope: str = "update"


@dataclass(frozen=True, slots=True)
class DenominatorSpec:
    """D_u's kind, with its grouping G', mask m', power alpha' and configured value."""

    kind: str = "tokens"
    group: str = "none"
    mask: str = "valid"
    alpha: float = 1.0
    value: float | None = None


@dataclass(frozen=True, slots=True)
class SchemeSpec:
    """A whole spec: hashable, so that a compiled step can close over it (it is static)."""

    weight: WeightSpec = field(default_factory=WeightSpec)
    denominator: DenominatorSpec = field(default_factory=DenominatorSpec)
    scope: str = "update"

    @property
    def num_units(self) -> str:
        """K in words: 1 unit (update), R (rank) or R M (microbatch)."""
        return {"update": "1", "rank": "R", "microbatch": "R M"}[self.scope]

    def to_dict(self) -> dict[str, Any]:
        """The JSON form, every key written out."""
        d = self.denominator
        return {
            "weight": {
                "mask": self.weight.mask,
                "soft": self.weight.soft,
                "group": self.weight.group,
                "alpha": self.weight.alpha,
                "count_scope": self.weight.count_scope,
            },
            "denominator": {
                "kind": d.kind,
                "group": d.group,
                "mask": d.mask,
                "alpha": d.alpha,
                "value": d.value,
            },
            "scope": self.scope,
        }


def _choice(section: Mapping[str, Any], where: str, key: str, allowed: tuple[str, ...]) -> str:
    value = section.get(key, allowed[0])  # the first allowed value is the default
    if value not in allowed:
        raise ValueError(f"spec {where}.{key} = {value!r}; allowed values: {', '.join(allowed)}")
    return value


def _number(section: Mapping[str, Any], where: str, key: str, default: float | None) -> Any:
    value = section.get(key, default)
    if value is None:
        return None
    # bool is an int: True as an exponent is a slip, not a number.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"spec {where}.{key} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"spec {where}.{key} must be finite, got {value!r}")
    return float(value)


def _section(spec: Mapping[str, Any], key: str, allowed_keys: tuple[str, ...]) -> Mapping:
    section = spec.get(key, {})
    if not isinstance(section, Mapping):
        raise ValueError(f"spec {key} must be an object (a dict), got {section!r}")
    unknown = sorted(set(section) - set(allowed_keys))
    if unknown:
        raise ValueError(
            f"spec {key} has unknown key(s) {unknown}; allowed keys: {', '.join(allowed_keys)}"
        )
    return section


def parse_spec(spec: Mapping[str, Any] | SchemeSpec | str) -> SchemeSpec:
    """A `SchemeSpec` from its JSON form (every key defaulted), a SchemeSpec, or a name.

    >>> parse_spec({"denominator": {"kind": "one"}}).denominator.kind
    'one'
    >>> parse_spec({"scope": "epoch"})
    Traceback (most recent call last):
    ...
    ValueError: spec scope = 'epoch'; allowed values: update, rank, microbatch
    """
    if isinstance(spec, SchemeSpec):
        return spec
    if isinstance(spec, str):
        return named_spec(spec)
    if not isinstance(spec, Mapping):
        raise ValueError(f"a spec is a dict, a SchemeSpec or a name, got {spec!r}")
    # "name" is a label (the exported vectors' manifest writes it), not part of the math.
    unknown = sorted(set(spec) - {"weight", "denominator", "scope", "name"})
    if unknown:
        raise ValueError(
            f"spec has unknown key(s) {unknown}; allowed keys: weight, denominator, scope, name"
        )
    w = _section(spec, "weight", ("mask", "soft", "group", "alpha", "count_scope"))
    d = _section(spec, "denominator", ("kind", "group", "mask", "alpha", "value"))
    scope = spec.get("scope", "update")
    if scope not in SCOPES:
        raise ValueError(f"spec scope = {scope!r}; allowed values: {', '.join(SCOPES[::-1])}")
    weight = WeightSpec(
        mask=_choice(w, "weight", "mask", WEIGHT_MASKS),
        soft=_choice(w, "weight", "soft", SOFT_FACTORS),
        group=_choice(w, "weight", "group", GROUPINGS),
        alpha=_number(w, "weight", "alpha", 1.0),
        count_scope=_choice(w, "weight", "count_scope", SCOPES[::-1]),
    )
    denominator = DenominatorSpec(
        kind=_choice(d, "denominator", "kind", KINDS),
        group=_choice(d, "denominator", "group", GROUPINGS),
        mask=_choice(d, "denominator", "mask", MASKS),
        alpha=_number(d, "denominator", "alpha", 1.0),
        value=_number(d, "denominator", "value", None),
    )
    if denominator.kind == "configured" and not (denominator.value or 0) > 0:
        raise ValueError(
            f"spec denominator.kind = 'configured' needs denominator.value > 0, got "
            f"{denominator.value!r}"
        )
    if denominator.kind != "configured" and denominator.value is not None:
        raise ValueError(
            f"spec denominator.value is only read by kind 'configured', got kind "
            f"{denominator.kind!r} with value {denominator.value!r}"
        )
    if denominator.kind in GROUP_KINDS and denominator.group == "none":
        allowed = ", ".join(GROUPINGS[1:])
        raise ValueError(
            f"spec denominator.kind = {denominator.kind!r} counts groups: denominator.group "
            f"must be one of {allowed}, got 'none'"
        )
    return SchemeSpec(weight, denominator, scope)


def _named(weight: dict | None = None, denominator: dict | None = None, **rest: Any) -> dict:
    return {"weight": weight or {}, "denominator": denominator or {}, **rest}


#: docs/schemes-as-data.md's table; a name with ``:x`` fills in the number (see `named_spec`).
NAMED_SPECS: dict[str, dict[str, Any]] = {
    "token_mean": _named(),
    "sequence_mean": _named({"group": "segment"}, {"kind": "groups", "group": "segment"}),
    "row_mean": _named({"group": "row"}, {"kind": "groups", "group": "row"}),
    "weighted_mean": _named({"soft": "token"}, {"kind": "weight_sum"}),
    "constant": _named(None, {"kind": "slots"}),
    "sum": _named(None, {"kind": "one"}),
    "rank_mean": _named(scope="rank"),
    "microbatch_mean": _named(scope="microbatch"),
    "all_rows_mean": _named({"group": "row"}, {"kind": "all_groups", "group": "row"}),
    "sample_rows_mean": _named(
        {"mask": "sample", "group": "row"},
        {"kind": "all_groups", "group": "row", "mask": "sample"},
    ),
    "group_token_mean": _named({"group": "group"}, {"kind": "groups", "group": "group"}),
    "document_mean": _named({"group": "document"}, {"kind": "groups", "group": "document"}),
    "nonzero_weight_mean": _named({"soft": "token"}, {"kind": "tokens", "mask": "nonzero_weight"}),
    "signed_row_weight_mean": _named(
        {"soft": "row", "group": "row"}, {"kind": "abs_row_weight_sum"}
    ),
    "zero_variance_excluded": _named(None, {"kind": "tokens", "mask": "sample"}),
}

#: Names that take a number after a colon, and where it goes.
_PARAMETRIC = {
    "constant": lambda x: _named(None, {"kind": "configured", "value": x}),
    "configured_rows_mean": lambda x: _named({"group": "row"}, {"kind": "configured", "value": x}),
    "configured_rows_sum": lambda x: _named(None, {"kind": "configured", "value": x}),
    "length_power": lambda x: _named(
        {"group": "row", "alpha": x}, {"kind": "power_sum", "group": "row", "alpha": x}
    ),
}


#: The number a parametric name takes when none is given (``length_power`` is ΔL's 0.5).
DEFAULT_PARAMETERS = {"configured_rows_mean": 8.0, "configured_rows_sum": 8.0, "length_power": 0.5}


def named_spec(name: str) -> SchemeSpec:
    """The spec of a name of docs/schemes-as-data.md's table, e.g. ``"group_token_mean"``,
    ``"constant:4096"`` or ``"length_power:0.5"`` (``"length_power"``: `DEFAULT_PARAMETERS`)."""
    if name in DEFAULT_PARAMETERS:
        name = f"{name}:{DEFAULT_PARAMETERS[name]}"
    base, sep, number = name.partition(":")
    if sep:
        if base not in _PARAMETRIC:
            raise ValueError(f"spec name {name!r}: only {sorted(_PARAMETRIC)} take ':<number>'")
        try:
            value = float(number)
        except ValueError:
            raise ValueError(f"spec name {name!r}: {number!r} is not a number") from None
        return parse_spec(_PARAMETRIC[base](value))
    if name not in NAMED_SPECS:
        known = sorted([*NAMED_SPECS, *(f"{p}:<x>" for p in _PARAMETRIC)])
        raise ValueError(f"unknown spec name {name!r}; known: {', '.join(known)}")
    return parse_spec(NAMED_SPECS[name])
