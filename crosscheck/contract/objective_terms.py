r"""The terms of a multi-term objective: a term as data, and each kind's closed form.

A term (docs/objectives.md) is a dict

    {"kind": ce | z_loss | entropy | ref_kl | mtp | moe_lb, "coefficient": λ,
     "scheme": scheme spec (per-token kinds; {} = token_mean), "scope": update | microbatch
     (moe_lb), "top_k": k (moe_lb), "name": str (defaults to the kind)}

parsed into a frozen `Term`. With z_t = h_t U, p_t = softmax(z_t), lse_t = logsumexp(z_t)
and e_t = p_t - onehot(y_t), each per-token kind has a loss l_t and a logit gradient dl_t/dz_t:

    ce        l_t = lse_t - z_t[y_t]                         e_t
    z_loss    l_t = lse_t^2                                  2 lse_t p_t
    entropy   l_t = H_t = -sum_v p_tv log p_tv               -p_t (log p_t + H_t)
    ref_kl    l_t = KL_t = sum_v p_tv (log p_tv - log q_tv)  p_t (log p_t - log q_t - KL_t)

and ``mtp`` is ``ce`` of its own head on the targets shifted once more (`mtp_targets`). The
router term ``moe_lb`` is `router_term`. Everything is numpy float64; no autodiff.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from crosscheck.contract.layout import IGNORE_INDEX
from crosscheck.contract.spec import SchemeSpec, get_spec

PER_TOKEN_KINDS: tuple[str, ...] = ("ce", "z_loss", "entropy", "ref_kl", "mtp")
KINDS: tuple[str, ...] = (*PER_TOKEN_KINDS, "moe_lb")
MOE_SCOPES: tuple[str, ...] = ("update", "microbatch")

#: Params that get a gradient, and the frozen reference that never does.
TRAINED_PARAMS: tuple[str, ...] = ("embed", "unembed", "mtp_unembed", "router")
FROZEN_PARAMS: tuple[str, ...] = ("ref_embed", "ref_unembed")

#: The params each kind reads (a missing one is an error naming the term).
PARAMS_USED: dict[str, tuple[str, ...]] = {
    "ce": ("embed", "unembed"),
    "z_loss": ("embed", "unembed"),
    "entropy": ("embed", "unembed"),
    "ref_kl": ("embed", "unembed", "ref_embed", "ref_unembed"),
    "mtp": ("embed", "mtp_unembed"),
    "moe_lb": ("embed", "router"),
}

_KEYS = frozenset({"kind", "coefficient", "scheme", "scope", "top_k", "name"})


@dataclass(frozen=True)
class Term:
    """One term λ L of an objective; see the module docstring for the fields' meaning."""

    kind: str
    coefficient: float = 1.0
    #: The scheme spec of a per-token term as its dict (docs/schemes-as-data.md; a
    #: `SchemeSpec` is stored as its dict, a dict as a copy: the caller's may change later).
    scheme: Mapping[str, Any] = field(default_factory=dict, hash=False)
    scope: str = "update"
    top_k: int | None = None
    name: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"term kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        label = f"term {self.name or self.kind!r}"
        if not self.name:
            object.__setattr__(self, "name", self.kind)
        elif not isinstance(self.name, str):
            raise ValueError(f"{label}: name must be a string, got {self.name!r}")
        # bool is an int and would silently read as λ = 1 or 0: a slip, as for layouts.
        value = self.coefficient
        if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
            raise ValueError(f"{label}: coefficient must be a real number, got {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"{label}: coefficient must be finite, got {value!r}")
        object.__setattr__(self, "coefficient", float(value))
        if isinstance(self.scheme, SchemeSpec):
            object.__setattr__(self, "scheme", self.scheme.to_dict())
        if not isinstance(self.scheme, Mapping):
            raise ValueError(f"{label}: scheme must be a scheme-spec dict, got {self.scheme!r}")
        object.__setattr__(self, "scheme", _copy_spec(self.scheme))
        if self.kind == "moe_lb":
            self._check_router_fields(label)
        else:
            try:  # a bad spec fails here, naming the term, not at the first evaluation
                self.spec  # noqa: B018
            except ValueError as error:
                raise ValueError(f"{label}: {error}") from None
            # A per-token term's scope is its scheme's own "scope" key: two places to say it
            # would be two places to disagree.
            if self.scope != "update":
                raise ValueError(f"{label}: a {self.kind} term's scope is its scheme's 'scope'")
            if self.top_k is not None:
                raise ValueError(f"{label}: top_k is for moe_lb terms only")

    def _check_router_fields(self, label: str) -> None:
        if self.scheme:
            raise ValueError(f"{label}: moe_lb has its own form and takes no scheme")
        if self.scope not in MOE_SCOPES:
            raise ValueError(f"{label}: scope must be update or microbatch, got {self.scope!r}")
        k = self.top_k
        if k is None:
            raise ValueError(f"{label}: moe_lb needs top_k, the experts each token picks")
        if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
            raise ValueError(f"{label}: top_k must be a positive integer, got {k!r}")
        object.__setattr__(self, "top_k", int(k))

    @property
    def spec(self) -> SchemeSpec:
        """The parsed scheme spec of a per-token term."""
        return get_spec(dict(self.scheme))

    @classmethod
    def from_data(cls, data: Mapping[str, Any] | Term) -> Term:
        """A `Term` from its dict (a `Term` is returned as is)."""
        if isinstance(data, Term):
            return data
        if not isinstance(data, Mapping):
            raise ValueError(f"a term must be a dict or a Term, got {data!r}")
        unknown = sorted(set(data) - _KEYS)
        if unknown:
            raise ValueError(f"term {data.get('kind')!r}: unknown keys {unknown}")
        if "kind" not in data:
            raise ValueError(f"a term needs a 'kind' ({', '.join(KINDS)}), got {dict(data)!r}")
        return cls(**data)

    def to_data(self) -> dict[str, Any]:
        """The term's dict, every key explicit (`from_data` reads it back)."""
        data: dict[str, Any] = {"kind": self.kind, "coefficient": self.coefficient}
        data["name"] = self.name
        if self.kind == "moe_lb":
            data |= {"scope": self.scope, "top_k": self.top_k}
        else:
            data["scheme"] = _copy_spec(self.scheme)
        return data


def _copy_spec(spec: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _copy_spec(v) if isinstance(v, Mapping) else v for k, v in spec.items()}


def parse_objective(terms: Iterable[Mapping[str, Any] | Term]) -> tuple[Term, ...]:
    """An objective: its terms in order, each parsed by `Term.from_data`, names unique."""
    if isinstance(terms, Mapping | str) or not hasattr(terms, "__iter__"):
        raise ValueError(f"an objective is a list of terms, got {terms!r}")
    parsed = tuple(Term.from_data(t) for t in terms)
    if not parsed:
        raise ValueError("an objective needs at least one term")
    names = [t.name for t in parsed]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"term names must be unique (set 'name'), repeated: {repeated}")
    return parsed


def mtp_targets(targets: np.ndarray, segment_ids: np.ndarray) -> np.ndarray:
    """y'_t = y_{t+1} when t + 1 < T and segment_ids[t+1] = segment_ids[t], else ignored.

    Works on any [..., T] arrays (a row never crosses a microbatch, so the shift is the same
    on [N, T] and [R, M, B, T]).
    """
    shifted = np.full_like(targets, IGNORE_INDEX)
    same = segment_ids[..., 1:] == segment_ids[..., :-1]
    shifted[..., :-1] = np.where(same, targets[..., 1:], IGNORE_INDEX)
    return shifted


class LogitTerm(NamedTuple):
    """Per-token loss l_t [n] and its logit gradient dl_t/dz_t [n, V]; 0 where masked."""

    losses: np.ndarray
    logit_grads: np.ndarray


def _log_softmax(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(lse_t [n], log p_t [n, V]), shifted by the row's max so that exp never overflows."""
    peak = logits.max(axis=-1, keepdims=True)
    shifted = logits - peak
    log_norm = np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    return (peak + log_norm)[..., 0], shifted - log_norm


def logit_term(
    kind: str,
    logits: np.ndarray,
    targets: np.ndarray,
    ref_logits: np.ndarray | None = None,
) -> LogitTerm:
    """l_t and dl_t/dz_t of a per-token kind on flat tokens (logits [n, V], targets [n]).

    `mtp` is `ce` here: the caller passes its own head's logits and the shifted targets.
    Masked tokens (target ignored) get 0 for both, so that no weight multiplies a value that
    was never meant to count.
    """
    valid = targets != IGNORE_INDEX
    lse, log_p = _log_softmax(logits)
    p = np.exp(log_p)
    if kind in ("ce", "mtp"):
        safe = np.where(valid, targets, 0)
        rows = np.arange(targets.size)
        losses = -log_p[rows, safe]
        grads = p.copy()
        grads[rows, safe] -= 1.0
    elif kind == "z_loss":
        losses = lse * lse
        grads = 2.0 * lse[:, None] * p
    elif kind == "entropy":
        losses = -(p * log_p).sum(axis=-1)
        grads = -p * (log_p + losses[:, None])
    elif kind == "ref_kl":
        if ref_logits is None:
            raise ValueError("ref_kl needs the reference logits")
        log_ratio = log_p - _log_softmax(ref_logits)[1]
        losses = (p * log_ratio).sum(axis=-1)
        grads = p * (log_ratio - losses[:, None])
    else:
        raise ValueError(f"{kind!r} is not a per-token kind ({', '.join(PER_TOKEN_KINDS)})")
    return LogitTerm(np.where(valid, losses, 0.0), np.where(valid[:, None], grads, 0.0))


class RouterTerm(NamedTuple):
    """The moe_lb term over its units (K = 1 at update scope, R M at microbatch scope)."""

    #: l_t = sum_e c_ue pi_te [R, M, B, T], 0 on padding.
    losses: np.ndarray
    #: dl_t/dr_t = pi_t (g_t - pi_t · g_t) with g_te = c_ue [R, M, B, T, E].
    logit_grads: np.ndarray
    #: c_t = a_t / D_u / K [R, M, B, T]: 1 / (k n_u^2 / E) / K on real tokens.
    weights: np.ndarray
    #: c_ue, tokens of unit u that picked expert e [K, E] (integers).
    expert_counts: np.ndarray
    #: n_u, real tokens of unit u [K].
    token_counts: np.ndarray
    #: D_u = k n_u^2 / E [K].
    denominators: np.ndarray


def top_k_picks(probs: np.ndarray, k: int) -> np.ndarray:
    """The k largest probabilities of every token as a bool mask [..., E].

    A stable sort of -pi keeps the lower expert index first on a tie (the contract's rule).
    """
    order = np.argsort(-probs, axis=-1, kind="stable")[..., :k]
    picked = np.zeros(probs.shape, dtype=bool)
    np.put_along_axis(picked, order, True, axis=-1)
    return picked


def top_k_margin(router_logits: np.ndarray, real: np.ndarray, k: int) -> float:
    """min over real tokens of pi_(k) - pi_(k+1): how far every top-k pick is from a tie.

    The closed form holds where the picks, hence the counts, are constant; a finite
    difference, or an implementation's rounding, crosses a tie only within this margin.
    """
    probs = np.exp(_log_softmax(router_logits)[1])[real]
    if k >= probs.shape[-1] or probs.shape[0] == 0:
        return math.inf
    ranked = -np.sort(-probs, axis=-1)
    return float((ranked[:, k - 1] - ranked[:, k]).min())


def router_term(router_logits: np.ndarray, real: np.ndarray, top_k: int, scope: str) -> RouterTerm:
    r"""Switch-style load balancing over `real` tokens (segment id > 0), in scheme form.

    With :math:`\pi_t = \operatorname{softmax}(r_t)`, :math:`c_{ue}` the count of real tokens of
    unit u whose top-k includes e, and :math:`n_u` the unit's real tokens,

    .. math::

        \mathrm{LB}_u = E \sum_e \frac{c_{ue}}{k n_u} \frac{1}{n_u}\sum_{t \in u} \pi_{te}
        = \frac{\sum_{t \in u} l_t}{D_u}, \quad l_t = \sum_e c_{ue} \pi_{te},
        \quad D_u = k n_u^2 / E,

    and :math:`L = \frac{1}{K} \sum_u \mathrm{LB}_u`. The counts are counts: no gradient flows
    through them, only through P, so :math:`\partial l_t/\partial r_t = \pi_t (c_u - \pi_t
    \cdot c_u)`. A unit without real tokens contributes 0. `router_logits` is [R, M, B, T, E]
    and `real` [R, M, B, T].
    """
    R, M = real.shape[:2]
    E = router_logits.shape[-1]
    if not 1 <= top_k <= E:
        raise ValueError(f"moe_lb: top_k = {top_k} must be between 1 and E = {E}")
    if scope not in MOE_SCOPES:
        raise ValueError(f"moe_lb: scope must be update or microbatch, got {scope!r}")
    K = 1 if scope == "update" else R * M
    # [R, M, B, T] is rank-major, so a reshape to [K, tokens] puts each unit in one row.
    probs = np.exp(_log_softmax(router_logits.reshape(K, -1, E))[1])
    unit_real = real.reshape(K, -1)
    picked = top_k_picks(probs, top_k) & unit_real[..., None]
    expert_counts = picked.sum(axis=1)
    token_counts = unit_real.sum(axis=1)
    denominators = top_k * token_counts.astype(np.float64) ** 2 / E
    g = expert_counts[:, None, :].astype(np.float64)
    losses = np.where(unit_real, (probs * g).sum(axis=-1), 0.0)
    grads = probs * (g - (probs * g).sum(axis=-1, keepdims=True))
    grads = np.where(unit_real[..., None], grads, 0.0)
    safe = np.where(token_counts > 0, denominators, 1.0)
    weights = np.where(unit_real, (1.0 / safe / K)[:, None], 0.0)
    return RouterTerm(
        losses=losses.reshape(real.shape),
        logit_grads=grads.reshape(router_logits.shape),
        weights=weights.reshape(real.shape),
        expert_counts=expert_counts,
        token_counts=token_counts,
        denominators=denominators,
    )
