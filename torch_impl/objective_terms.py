r"""The terms of a multi-term objective in torch: parsing, token weights, per-token losses.

A term is a dict (docs/objectives.md)

    {"kind": ce | z_loss | entropy | ref_kl | mtp | moe_lb, "coefficient": λ,
     "scheme": scheme spec (per-token kinds; {} = token_mean), "scope": update | microbatch
     (moe_lb only), "top_k": k (moe_lb only), "name": str (defaults to the kind)}

`parse_terms` reads it into an `ObjectiveTerm`, refusing with a ValueError what this module
does not compute rather than computing it wrongly. Of the scheme specs
(docs/schemes-as-data.md) it computes the ones whose counts never cross a microbatch:

    a_t = m_t / n_G(t),   d_m = sum_{t in m} m_t (G = none)  or  non-empty groups of m (G = row,
    segment),

m_t the term's mask (v_t, or v'_t for mtp), at scope ``update``, ``rank`` or ``microbatch``:
token_mean, row_mean, sequence_mean and their local siblings. A row and a (row, segment) pair
never cross a microbatch, so n_G is local and only D_u = sum of d_m over the unit needs the
other ranks. With z_t = h_t W, p_t = softmax(z_t), the per-token losses are

    ce, mtp   l_t = logsumexp(z_t) - z_t[y_t]         (mtp on its own head and y'_t)
    z_loss    l_t = logsumexp(z_t)^2
    entropy   l_t = -sum_v p_tv log p_tv
    ref_kl    l_t = sum_v p_tv (log p_tv - log q_tv),  q_t from the frozen reference

and autograd differentiates them. Written for torch on its own: the numpy oracle and JAX are
checked against it, and shared code would hide a shared bug.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.functional import log_softmax

from torch_impl.batch import IGNORE_INDEX

PER_TOKEN_KINDS: tuple[str, ...] = ("ce", "z_loss", "entropy", "ref_kl", "mtp")
KINDS: tuple[str, ...] = (*PER_TOKEN_KINDS, "moe_lb")
SCOPES: tuple[str, ...] = ("update", "rank", "microbatch")
#: The head whose logits each kind reads.
HEAD: dict[str, str] = {
    "ce": "unembed",
    "z_loss": "unembed",
    "entropy": "unembed",
    "ref_kl": "unembed",
    "mtp": "mtp_unembed",
    "moe_lb": "router",
}
_TERM_KEYS = frozenset({"kind", "coefficient", "scheme", "scope", "top_k", "name"})
#: Spec keys that must hold their default value here (a full dict form writes them out).
#: count_scope is allowed and ignored: it only matters for a grouping that crosses microbatches.
_ALLOWED = {
    "weight": {"mask", "soft", "alpha", "group", "count_scope"},
    "denominator": {"mask", "alpha", "value", "kind", "group"},
}
_FIXED = {
    "weight": {"mask": "valid", "soft": "none", "alpha": 1.0},
    "denominator": {"mask": "valid", "alpha": 1.0, "value": None},
}

#: (weight.group, denominator.kind, denominator.group) computed: token, row and segment means.
_COMPUTED = {("none", "tokens", "none"), ("row", "groups", "row"), ("segment", "groups", "segment")}


@dataclass(frozen=True, slots=True)
class ObjectiveTerm:
    """One term λ L_k: `group` is the spec's grouping (none, row, segment), `scope` its unit."""

    name: str
    kind: str
    coefficient: float
    scope: str = "update"
    group: str = "none"
    top_k: int = 0


def _spec_group_and_scope(label: str, scheme: Any) -> tuple[str, str]:
    """(G, U) of a scheme spec this module computes; anything else is a ValueError."""
    if not isinstance(scheme, Mapping):
        raise ValueError(f"{label}: scheme must be a scheme-spec dict, got {scheme!r}")
    unknown = sorted(set(scheme) - {"weight", "denominator", "scope", "name"})
    if unknown:
        raise ValueError(f"{label}: unknown scheme keys {unknown}")
    weight = dict(scheme.get("weight") or {})
    denominator = dict(scheme.get("denominator") or {})
    for part, given in (("weight", weight), ("denominator", denominator)):
        stray = sorted(set(given) - _ALLOWED[part])
        if stray:
            raise ValueError(f"{label}: unknown scheme spec keys {part}.{stray}")
        for key, value in given.items():
            if key in _FIXED[part] and value != _FIXED[part][key]:
                raise ValueError(
                    f"{label}: torch_impl.objective computes mask valid, soft none, alpha 1; "
                    f"{part}.{key} = {value!r} is not one of them"
                )
    group = weight.pop("group", "none")
    kind = denominator.pop("kind", "tokens")
    groups = denominator.pop("group", "none")
    if (group, kind, groups) not in _COMPUTED:
        raise ValueError(
            f"{label}: torch_impl.objective computes token, row and segment means (weight.group "
            f"none/row/segment over the matching count), got weight.group {group!r}, "
            f"denominator {kind!r} over {groups!r}"
        )
    scope = scheme.get("scope", "update")
    if scope not in SCOPES:
        raise ValueError(f"{label}: scheme scope must be one of {', '.join(SCOPES)}, got {scope!r}")
    return group, scope


def parse_term(data: Mapping[str, Any]) -> ObjectiveTerm:
    """One term from its dict (module docstring), every field checked."""
    if not isinstance(data, Mapping):
        raise ValueError(f"a term must be a dict, got {data!r}")
    kind = data.get("kind")
    if kind not in KINDS:
        raise ValueError(f"term kind must be one of {', '.join(KINDS)}, got {kind!r}")
    name = data.get("name") or kind
    label = f"term {name!r}"
    if not isinstance(name, str):
        raise ValueError(f"{label}: name must be a string")
    unknown = sorted(set(data) - _TERM_KEYS)
    if unknown:
        raise ValueError(f"{label}: unknown keys {unknown}")
    coefficient = data.get("coefficient", 1.0)
    # bool is an int: True would read as λ = 1, a slip rather than a coefficient.
    if isinstance(coefficient, bool) or not isinstance(coefficient, int | float):
        raise ValueError(f"{label}: coefficient must be a real number, got {coefficient!r}")
    if not math.isfinite(coefficient):
        raise ValueError(f"{label}: coefficient must be finite, got {coefficient!r}")
    if kind == "moe_lb":
        scope, top_k = data.get("scope", "update"), data.get("top_k")
        if data.get("scheme"):
            raise ValueError(f"{label}: moe_lb has its own form and takes no scheme")
        if scope not in ("update", "microbatch"):
            raise ValueError(f"{label}: moe_lb scope must be update or microbatch, got {scope!r}")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"{label}: moe_lb needs top_k, a positive integer, got {top_k!r}")
        return ObjectiveTerm(name, kind, float(coefficient), scope, "none", top_k)
    if "scope" in data or "top_k" in data:
        # The scheme's own "scope" says it: two places to say it could disagree.
        raise ValueError(
            f"{label}: scope and top_k are moe_lb's; a {kind} term's scope is its scheme's 'scope'"
        )
    group, scope = _spec_group_and_scope(label, data.get("scheme") or {})
    return ObjectiveTerm(name, kind, float(coefficient), scope, group)


def parse_terms(terms: Sequence[Mapping[str, Any]]) -> tuple[ObjectiveTerm, ...]:
    """An objective: its terms in order, names unique."""
    if isinstance(terms, Mapping | str) or not isinstance(terms, Sequence):
        raise ValueError(f"an objective is a list of terms, got {terms!r}")
    parsed = tuple(parse_term(t) for t in terms)
    if not parsed:
        raise ValueError("an objective needs at least one term")
    names = [t.name for t in parsed]
    if len(set(names)) != len(names):
        raise ValueError(f"term names must be unique (set 'name'), got {names}")
    return parsed


def mtp_targets(targets: torch.Tensor, segment_ids: torch.Tensor) -> torch.Tensor:
    """y'_t = y_{t+1} where t + 1 < T and segment t + 1 is segment t, else IGNORE_INDEX."""
    same = segment_ids[:, 1:] == segment_ids[:, :-1]
    shifted = torch.full_like(targets, IGNORE_INDEX)
    shifted[:, :-1] = torch.where(same, targets[:, 1:], IGNORE_INDEX)
    return shifted


def term_targets(kind: str, targets: torch.Tensor, segment_ids: torch.Tensor) -> torch.Tensor:
    """The targets whose != IGNORE_INDEX is the term's mask m_t (y' for mtp, y otherwise)."""
    return mtp_targets(targets, segment_ids) if kind == "mtp" else targets


def token_weights(
    group: str, mask: torch.Tensor, segment_ids: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """(a_t float64 [B, T], d_m) of one microbatch for grouping `group` (module docstring).

    Counts are exact integers; a group without a masked-in token has no weight, never 0/0.
    """
    if group == "none":
        return mask.to(torch.float64), int(mask.sum())
    B, T = mask.shape
    if group == "row":
        ids = torch.arange(B).unsqueeze(1).expand(B, T)
    else:  # segment: one id per (row, segment id) pair
        width = int(segment_ids.max()) + 1
        ids = torch.arange(B).unsqueeze(1) * width + segment_ids
    counts = torch.bincount(ids.flatten(), weights=mask.flatten().to(torch.float64))
    per_token = counts[ids]
    weights = torch.where(mask, 1.0 / per_token.clamp(min=1.0), 0.0)
    return weights, int((counts > 0).sum())


def token_losses(
    kind: str,
    logits: torch.Tensor,
    targets: torch.Tensor,
    ref_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """l_t [B, T] of a per-token kind in float64, exactly 0 where the target is ignored.

    `logits` is the kind's head [B, T, V] (``mtp_unembed`` for mtp, with y' as `targets`);
    `ref_logits` the frozen reference's, for ref_kl.
    """
    z = logits.to(torch.float64)
    valid = targets != IGNORE_INDEX
    log_p = log_softmax(z, dim=-1)
    if kind in ("ce", "mtp"):
        safe = torch.where(valid, targets, 0)
        losses = -log_p.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    elif kind == "z_loss":
        losses = torch.logsumexp(z, dim=-1).square()
    elif kind == "entropy":
        losses = -(log_p.exp() * log_p).sum(dim=-1)
    elif kind == "ref_kl":
        if ref_logits is None:
            raise ValueError("ref_kl needs the frozen reference's logits")
        log_q = log_softmax(ref_logits.to(torch.float64), dim=-1)
        losses = (log_p.exp() * (log_p - log_q)).sum(dim=-1)
    else:
        raise ValueError(f"{kind!r} is not a per-token kind ({', '.join(PER_TOKEN_KINDS)})")
    return torch.where(valid, losses, 0.0)


def top_k_counts(probs: torch.Tensor, real: torch.Tensor, top_k: int) -> torch.Tensor:
    """c_e: real tokens whose k largest router probabilities include expert e, int64 [E].

    A stable sort of -π keeps the lower expert on a tie (the contract's rule; torch.topk
    promises no order among equal values).
    """
    E = probs.shape[-1]
    if not 1 <= top_k <= E:
        raise ValueError(f"moe_lb: top_k = {top_k} must be between 1 and E = {E}")
    picks = torch.sort(-probs, dim=-1, stable=True).indices[..., :top_k]
    picked = torch.zeros(probs.shape, dtype=torch.int64).scatter_(-1, picks, 1)
    return (picked * real.unsqueeze(-1)).sum(dim=tuple(range(picked.dim() - 1)))
