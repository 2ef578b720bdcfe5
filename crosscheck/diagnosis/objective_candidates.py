r"""What each bug pattern of a multi-term objective predicts, from the numpy oracle.

An objective (docs/objectives.md) is :math:`\sum_k \lambda_k L_k` with
:math:`L_k = \sum_t c^k_t l^k_t`. Its gradient is linear in the token weights, so it splits
over the terms and over the microbatches :math:`u = (r, m)` of a layout:

.. math::

    g = \sum_k \sum_u G_{k,u}, \qquad
    G_{k,u} = \sum_{t \in u} \lambda_k c^k_t \frac{\partial l^k_t}{\partial \theta}

(`unit_gradients`: the oracle's closed form restricted to one microbatch). Every pattern of
docs/bugs.md ("Multi-term objectives") changes one term k, either its weights by a factor
per unit, :math:`\sum_u \mu_u G_{k,u}`, or its form (a scope whose counts are local):
:math:`\sum_u \mu_u G'_{k,u}` with :math:`G'` the oracle's gradient of the modified term.
`candidates` lists each pattern's prediction for every term it can hit:

* ``sibling-term-scope(k)``: term k at ``rank`` or ``microbatch`` scope, more local than its
  intended one (verl#6957, verl#7200, trl#2995, SkyRL#1504, NeMo-RL#2839).
* ``shifted-aux-count(k)``: an ``mtp`` term over the main term's count,
  :math:`\mu_u = D^k_u / D^{main}_u` (Megatron-LM#2417, fixed in #3159).
* ``aux-world-size-factor(k)``: :math:`\mu = R`, the main loss's DDP factor on a term that
  was already complete on every rank.
* ``aux-global-count-local-stats(k)``: ``moe_lb`` from microbatch-local routing statistics
  over the global token count, :math:`\sum_u E \sum_e f_{ue} (\sum_{t\in u}\pi_{te}) / n`:
  the microbatch-scope term (weights :math:`E / (k n_u^2 R M)`) with
  :math:`\mu_u = n_u R M / n`.
* ``aux-coefficient-twice(k)``: :math:`\mu = \lambda_k` (the term weighs :math:`\lambda_k^2`).
* ``aux-summed-over-microbatches(k)``: :math:`\mu = R M` on a term meant per microbatch (a
  per-forward mean, as a model's own router loss is): the term rides the main loss's factor R
  and is never divided by M, so the update sums it over its R M forwards instead of averaging
  them (transformers 5.24's ``Trainer`` with a MoE model's router loss: modeling_mixtral.py:633
  adds it to the loss, trainer.py:2215 multiplies by R, trainer.py:2116-2119 skips the division
  by M under ``num_items_in_batch``; TRL 1.16.0's SFTTrainer divides it by M after the x R,
  sft_trainer.py:1624-1629).

The main term (the first, unless named) is never hit: a pattern is about an auxiliary term
that disagrees with it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from crosscheck.contract.layout import LaidOutBatch

# The oracle's per-term forward (weights c_t and logit gradients per token) is what a
# per-unit gradient needs; it is private there because the oracle's users want the total.
from crosscheck.contract.objective import HEAD, _forward, objective_loss_and_grad, with_row_fields
from crosscheck.contract.objective_terms import TRAINED_PARAMS, Term, parse_objective

PATTERNS: tuple[str, ...] = (
    "sibling-term-scope",
    "shifted-aux-count",
    "aux-world-size-factor",
    "aux-global-count-local-stats",
    "aux-coefficient-twice",
    "aux-summed-over-microbatches",
)
#: Scopes from the least to the most local.
_SCOPE_ORDER = ("update", "rank", "microbatch")


@dataclass(frozen=True)
class Candidate:
    """One pattern's prediction for one term: `name` is ``pattern(term)``."""

    pattern: str
    term: str
    #: What the term was changed to, in words (e.g. "scope microbatch").
    variant: str
    #: The predicted gradient, flat in `flat_keys` order.
    prediction: np.ndarray

    @property
    def name(self) -> str:
        return f"{self.pattern}({self.term})"


def flat_keys(params: Mapping[str, np.ndarray]) -> tuple[str, ...]:
    """The trained params present, in the oracle's order: the layout of every flat vector."""
    return tuple(k for k in TRAINED_PARAMS if k in params)


def flatten(grads: Mapping[str, Any], keys: Sequence[str]) -> np.ndarray:
    """The gradient leaves of `keys` as one float64 vector."""
    return np.concatenate([np.asarray(grads[k], np.float64).reshape(-1) for k in keys])


def unit_gradients(params: Mapping[str, np.ndarray], batch: LaidOutBatch, term: Term) -> np.ndarray:
    r""":math:`G_{k,u}` for every microbatch u = (r, m), rank-major: [R M, P].

    A head W with logit gradient :math:`g_t = \lambda c_t\, \partial l_t / \partial z_t`
    sends :math:`h_t^\top g_t` to W and :math:`W g_t` to ``embed[x_t]``; restricted to the
    tokens of u, the rows of the sum give back the oracle's gradient of the term.
    """
    batch = with_row_fields(batch)
    params = {k: np.asarray(v, np.float64) for k, v in params.items()}
    keys = flat_keys(params)
    inputs = batch.inputs.reshape(-1)
    hidden = params["embed"][inputs]
    cache: dict[str, np.ndarray] = {}

    def head_logits(head: str) -> np.ndarray:
        if head not in cache:
            cache[head] = hidden @ params[head]
        return cache[head]

    forward = _forward(term, params, batch, head_logits)
    head = HEAD[term.kind]
    weights = term.coefficient * forward.result.token_weights.reshape(-1, 1)
    logit_grads = weights * forward.logit_grads
    R, M, B, T = batch.targets.shape
    per_unit = B * T
    rows = []
    for u in range(R * M):
        part = slice(u * per_unit, (u + 1) * per_unit)
        grads = {k: np.zeros_like(params[k]) for k in keys}
        grads[head] = hidden[part].T @ logit_grads[part]
        np.add.at(grads["embed"], inputs[part], logit_grads[part] @ params[head].T)
        rows.append(flatten(grads, keys))
    return np.stack(rows)


def unit_index(scope: str, R: int, M: int) -> np.ndarray:
    """The unit of `scope` that each microbatch (rank-major) belongs to [R M]."""
    u = np.arange(R * M)
    return {"update": np.zeros_like(u), "rank": u // M, "microbatch": u}[scope]


def term_scope(term: Term) -> str:
    return term.scope if term.kind == "moe_lb" else term.spec.scope


def with_scope(term: Term, scope: str) -> Term:
    """`term` normalized at `scope` (its scheme's scope; moe_lb's own scope)."""
    data = term.to_data()
    if term.kind == "moe_lb":
        data["scope"] = scope
    else:
        data["scheme"] = {**data["scheme"], "scope": scope}
    return Term.from_data(data)


def candidates(
    params: Mapping[str, np.ndarray],
    batch: LaidOutBatch,
    terms: Sequence[Mapping[str, Any] | Term],
    main: str | None = None,
) -> tuple[np.ndarray, dict[str, np.ndarray], list[Candidate]]:
    """(intended gradient, per-term unit gradients [R M, P], every pattern's candidate)."""
    objective = parse_objective(terms)
    main_term = (
        objective[0] if main is None else next((t for t in objective if t.name == main), None)
    )
    if main_term is None:
        raise ValueError(
            f"no term {main!r} to be the main term; the terms are {[t.name for t in objective]}"
        )
    R, M = batch.targets.shape[:2]
    basis = {t.name: unit_gradients(params, batch, t) for t in objective}
    intended = sum(b.sum(axis=0) for b in basis.values())
    found: list[Candidate] = []

    def add(pattern: str, term: Term, variant: str, changed: np.ndarray) -> None:
        prediction = intended - basis[term.name].sum(axis=0) + changed
        found.append(Candidate(pattern, term.name, variant, prediction))

    oracle = objective_loss_and_grad(params, batch, objective)
    for term in objective:
        if term is main_term:
            continue
        own = basis[term.name]
        scope = term_scope(term)
        allowed = ("update", "microbatch") if term.kind == "moe_lb" else _SCOPE_ORDER
        for local in allowed[allowed.index(scope) + 1 :]:
            local_basis = unit_gradients(params, batch, with_scope(term, local))
            add("sibling-term-scope", term, f"scope {local}", local_basis.sum(axis=0))
        shifted = _shifted_count_factors(params, batch, term, main_term, oracle)
        if shifted is not None:
            add("shifted-aux-count", term, "main term's count", shifted @ own)
        add("aux-world-size-factor", term, f"x R = {R}", R * own.sum(axis=0))
        if term.kind == "moe_lb":
            local_term = with_scope(term, "microbatch")
            n_u = _real_tokens(batch)
            factors = n_u * R * M / n_u.sum()
            local_basis = unit_gradients(params, batch, local_term)
            add("aux-global-count-local-stats", term, "local f, P over n", factors @ local_basis)
        lam = term.coefficient
        add("aux-coefficient-twice", term, f"x lambda = {lam:g}", lam * own.sum(axis=0))
        if scope == "microbatch":
            add("aux-summed-over-microbatches", term, f"x R M = {R * M}", R * M * own.sum(axis=0))
    return intended, basis, found


def _real_tokens(batch: LaidOutBatch) -> np.ndarray:
    """n_u, the real (routed) tokens of every microbatch [R M]."""
    R, M = batch.segment_ids.shape[:2]
    return (batch.segment_ids > 0).reshape(R * M, -1).sum(axis=1).astype(np.float64)


def _shifted_count_factors(params, batch, term: Term, main: Term, oracle) -> np.ndarray | None:
    r""":math:`\mu_u = D^k_u / D^{main}_u` per microbatch for an ``mtp`` term over token
    counts, the main term's count taken at the mtp term's own scope; None where the pattern
    does not apply (another kind, or a denominator that is not a token count)."""
    if term.kind != "mtp" or main.kind == "moe_lb":
        return None
    if term.spec.denominator.kind != "tokens" or main.spec.denominator.kind != "tokens":
        return None
    R, M = batch.targets.shape[:2]
    scope = term_scope(term)
    main_here = with_scope(main, scope)
    own = np.asarray(oracle.term(term.name).denominators, np.float64)
    shared = np.asarray(
        objective_loss_and_grad(params, batch, [main_here]).terms[0].denominators, np.float64
    )
    index = unit_index(scope, R, M)
    # A unit with no main-term token has no mtp token either (v' <= v): its factor is moot.
    return np.where(shared[index] > 0, own[index] / np.where(shared > 0, shared, 1)[index], 0.0)
