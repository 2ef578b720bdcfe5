r"""The float64 oracle of a multi-term objective, in closed form (docs/objectives.md).

An objective is an ordered list of terms (`crosscheck.contract.objective_terms.Term`), each
with its own per-token loss, mask, scheme and scope:

.. math::

    \text{total} = \sum_k \lambda_k L_k, \qquad
    L_k = \sum_t c^k_t\, l^k_t, \qquad c^k_t = a^k_t / D^k_{u(t)} / K_k

with :math:`a^k`, :math:`D^k_u` and the :math:`K_k` units of the term's scope given by its
scheme spec (`crosscheck.contract.spec`; ``moe_lb`` has its own form,
`objective_terms.router_term`). Every head W (``unembed``, ``mtp_unembed``, ``router``) reads
:math:`h_t = \mathrm{embed}[x_t]`; summing the terms' logit gradients per head,

.. math::

    G^W_t = \sum_{k \text{ on } W} \lambda_k c^k_t \frac{\partial l^k_t}{\partial (h_t W)},
    \qquad \frac{\partial\, \text{total}}{\partial W} = \sum_t h_t^\top G^W_t, \qquad
    \frac{\partial\, \text{total}}{\partial\, \mathrm{embed}[x]} =
    \sum_W \sum_{t:\, x_t = x} W G^W_t.

The frozen reference (``ref_embed``, ``ref_unembed``) only enters ``ref_kl``'s q_t and gets no
gradient. No autodiff: tests/test_objective_oracle.py checks all of it against central finite
differences of the loss.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from crosscheck.contract.layout import LaidOutBatch
from crosscheck.contract.objective_terms import (
    PARAMS_USED,
    TRAINED_PARAMS,
    Term,
    logit_term,
    mtp_targets,
    parse_objective,
    router_term,
)
from crosscheck.contract.row_fields import default_row_fields
from crosscheck.contract.spec import SchemeSpec

Params = dict[str, np.ndarray]

#: The head each kind's logits come from.
HEAD: dict[str, str] = {
    "ce": "unembed",
    "z_loss": "unembed",
    "entropy": "unembed",
    "ref_kl": "unembed",
    "mtp": "mtp_unembed",
    "moe_lb": "router",
}


class TermResult(NamedTuple):
    """One term of the objective as the oracle computed it."""

    name: str
    kind: str
    coefficient: float
    #: L_k, before the coefficient.
    loss: float
    #: Tokens of the term's numerator mask over the update: v_t (v'_t for mtp, times the
    #: row's sample_mask under a `sample` mask), real tokens for moe_lb.
    count: int
    #: D_u of every unit of the term's scope, [K] (K = 1 at update scope).
    denominators: np.ndarray
    #: c_t = a_t / D_u / K, before the coefficient, [R, M, B, T].
    token_weights: np.ndarray


class ObjectiveResult(NamedTuple):
    """total = sum_k λ_k L_k, its gradient for every trained param present, and each term."""

    loss: float
    grads: Params
    terms: tuple[TermResult, ...]

    def term(self, name: str) -> TermResult:
        """The result of the term called `name`."""
        for term in self.terms:
            if term.name == name:
                return term
        raise KeyError(f"no term {name!r}; the terms are {[t.name for t in self.terms]}")


class _TermForward(NamedTuple):
    """What one term contributes: weights c_t, losses l_t and logit gradients, flat."""

    result: TermResult
    losses: np.ndarray  # [n]
    logit_grads: np.ndarray  # [n, out of the term's head]


def scheme_weights(spec: SchemeSpec, batch: LaidOutBatch) -> tuple[np.ndarray, np.ndarray]:
    """(c_t = a_t / D_u / K [R, M, B, T], D_u [K]) of a per-token term's spec on `batch`."""
    return spec.effective_weights(batch), np.asarray(spec.unit_denominators(batch), np.float64)


def mask_count(spec: SchemeSpec, batch: LaidOutBatch) -> int:
    """Tokens of the spec's numerator mask m_t over the update (v_t, or v_t times the row's
    sample_mask)."""
    mask = batch.valid
    if spec.weight.mask == "sample":
        mask = mask & (batch.sample_mask[..., None] != 0)
    return int(np.count_nonzero(mask))


def objective_loss_and_grad(
    params: Mapping[str, np.ndarray],
    batch: LaidOutBatch,
    terms: Sequence[Mapping[str, Any] | Term],
) -> ObjectiveResult:
    """The objective of `terms` on the laid-out `batch` ([R, M, B, T]), and its gradient.

    `params` holds ``embed`` and whatever heads and references the terms read (a missing one
    is a ValueError naming the term); grads come back for every trained param present, zero
    for one that no term reads.
    """
    objective = parse_objective(terms)
    batch = with_row_fields(batch)
    params = {k: np.asarray(v, dtype=np.float64) for k, v in params.items()}
    for term in objective:
        missing = [p for p in PARAMS_USED[term.kind] if p not in params]
        if missing:
            raise ValueError(f"term {term.name!r} ({term.kind}) needs params {missing}")
    inputs = batch.inputs.reshape(-1)
    hidden = params["embed"][inputs]  # h_t [n, H]
    logits: dict[str, np.ndarray] = {}

    def head_logits(head: str) -> np.ndarray:
        if head not in logits:
            logits[head] = hidden @ params[head]
        return logits[head]

    forwards = [_forward(term, params, batch, head_logits) for term in objective]
    # G^W_t = sum over the terms on head W of λ c_t dl_t/dz_t.
    head_grads: dict[str, np.ndarray] = {}
    for term, forward in zip(objective, forwards, strict=True):
        scaled = term.coefficient * forward.result.token_weights.reshape(-1, 1)
        contribution = scaled * forward.logit_grads
        head = HEAD[term.kind]
        head_grads[head] = head_grads[head] + contribution if head in head_grads else contribution
    grads = {p: np.zeros_like(params[p]) for p in TRAINED_PARAMS if p in params}
    for head, g in head_grads.items():
        grads[head] = hidden.T @ g
        np.add.at(grads["embed"], inputs, g @ params[head].T)
    total = math.fsum(
        t.coefficient * f.result.loss for t, f in zip(objective, forwards, strict=True)
    )
    return ObjectiveResult(total, grads, tuple(f.result for f in forwards))


def with_row_fields(batch: LaidOutBatch) -> LaidOutBatch:
    """`batch` with contract v2's row fields at their defaults where it has none (a batch
    laid out by hand with `lay_out`): the specs read them, and a v1 batch means the defaults."""
    R, M, B = batch.targets.shape[:3]
    defaults = default_row_fields(batch.to_global(batch.segment_ids))
    missing = {
        key: value.reshape((R, M, B, *value.shape[1:]))
        for key, value in defaults.items()
        if getattr(batch, key) is None
    }
    return batch._replace(**missing) if missing else batch


def objective_loss(
    params: Mapping[str, np.ndarray],
    batch: LaidOutBatch,
    terms: Sequence[Mapping[str, Any] | Term],
) -> float:
    """The total alone (used by the finite-difference tests)."""
    return objective_loss_and_grad(params, batch, terms).loss


def _forward(term: Term, params: Params, batch: LaidOutBatch, head_logits) -> _TermForward:
    """One term's weights, losses and logit gradients on the flat tokens of `batch`."""
    z = head_logits(HEAD[term.kind])
    if term.kind == "moe_lb":
        real = batch.segment_ids > 0  # padding is not routed
        routed = router_term(z.reshape(*real.shape, -1), real, term.top_k, term.scope)
        weights, denominators = routed.weights, routed.denominators
        count = int(routed.token_counts.sum())
        losses, logit_grads = routed.losses.reshape(-1), routed.logit_grads.reshape(z.shape)
    else:
        if term.kind == "mtp":
            # The same batch with y' as its targets: the spec's valid mask is then v'.
            batch = batch._replace(targets=mtp_targets(batch.targets, batch.segment_ids))
        ref_logits = None
        if term.kind == "ref_kl":
            ref_logits = params["ref_embed"][batch.inputs.reshape(-1)] @ params["ref_unembed"]
        losses, logit_grads = logit_term(term.kind, z, batch.targets.reshape(-1), ref_logits)
        spec = term.spec
        weights, denominators = scheme_weights(spec, batch)
        count = mask_count(spec, batch)
    loss = math.fsum((weights.reshape(-1) * losses).tolist())
    result = TermResult(term.name, term.kind, term.coefficient, loss, count, denominators, weights)
    return _TermForward(result, losses, logit_grads)
