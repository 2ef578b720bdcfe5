r"""The terms of a multi-term objective in torch: parsing, token weights, per-token losses.

A term is a dict (docs/objectives.md)

    {"kind": ce | z_loss | entropy | ref_kl | mtp | moe_lb, "coefficient": λ,
     "scheme": scheme spec (per-token kinds; {} = token_mean), "scope": update | microbatch
     (moe_lb only), "top_k": k (moe_lb only), "name": str (defaults to the kind)}

`parse_terms` reads it into an `ObjectiveTerm`, refusing with a ValueError what is not a term.
A per-token term's scheme is any spec of docs/schemes-as-data.md, read by
`torch_impl.spec.parse_spec`; `torch_impl.objective` computes its a_t and D_u with the same
`torch_impl.spec_counts.SpecView` as a single-term update, the term's mask (v_t, or v'_t for
mtp) standing for the spec's ``valid`` mask. With z_t = h_t W, p_t = softmax(z_t), the
per-token losses are

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

from torch_impl.batch import IGNORE_INDEX, TokenBatch, shifted_targets
from torch_impl.spec import SchemeSpec, parse_spec

PER_TOKEN_KINDS: tuple[str, ...] = ("ce", "z_loss", "entropy", "ref_kl", "mtp")
KINDS: tuple[str, ...] = (*PER_TOKEN_KINDS, "moe_lb")
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


@dataclass(frozen=True, slots=True)
class ObjectiveTerm:
    """One term λ L_k: a per-token kind with its scheme `spec` (its `scope` is the spec's), or
    moe_lb with its scope and top_k."""

    name: str
    kind: str
    coefficient: float
    scope: str = "update"
    top_k: int = 0
    spec: SchemeSpec | None = None


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
        return ObjectiveTerm(name, kind, float(coefficient), scope, top_k)
    if "scope" in data or "top_k" in data:
        # The scheme's own "scope" says it: two places to say it could disagree.
        raise ValueError(
            f"{label}: scope and top_k are moe_lb's; a {kind} term's scope is its scheme's 'scope'"
        )
    scheme = data.get("scheme") or {}
    if not isinstance(scheme, Mapping):
        raise ValueError(f"{label}: scheme must be a scheme-spec dict, got {scheme!r}")
    try:
        spec = parse_spec(scheme, name=f"{name} scheme")
    except ValueError as exc:
        raise ValueError(f"{label}: {exc}") from None
    return ObjectiveTerm(name, kind, float(coefficient), spec.scope, spec=spec)


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


def term_targets(kind: str, batch: TokenBatch) -> torch.Tensor:
    """The targets whose != IGNORE_INDEX is the term's mask m_t (y' for mtp, y otherwise).

    y' is the batch's own ``mtp_targets`` when it carries them (a context-parallel shard,
    whose rows were shifted whole before the split), else the shift of its whole rows."""
    if kind != "mtp":
        return batch.targets
    if batch.mtp_targets is not None:
        return batch.mtp_targets
    return shifted_targets(batch.targets, batch.segment_ids)


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
