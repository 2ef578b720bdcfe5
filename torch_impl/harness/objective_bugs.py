r"""Multi-term objectives with one auxiliary term weighted wrongly, as buggy torch DDP steps.

Each step is `torch_impl.objective.objective_update` (count pre-pass before any backward,
``no_sync`` on all but the last microbatch, DDP averaging the summed gradients over the R
ranks) with exactly one term `target` written the way a real training loop got it wrong;
every other term keeps its correct weights. DDP averages, so every correct term's
microbatch loss is multiplied by the world-size factor R before its backward. With λ_k the
coefficients, n the update's count of the term's mask, n_u a microbatch's, M microbatches:

* ``sibling-term-scope``: the target's loss function returns its own microbatch mean,
  ``sum(l_t) / n_u``, and the accumulation loop divides it by M, with no factor R (a
  per-microbatch criterion does not know the world size). After DDP's average its gradient is
  :math:`\frac{1}{R M}\sum_u \frac{\lambda_k}{n_u}\sum_{t\in u}\nabla l^k_t`.
* ``shifted-aux-count``: the ``mtp`` term sums its losses over the rolled mask v' (fewer
  tokens) but divides by the main term's ``num_tokens`` n instead of its own n': scale n'/n.
* ``aux-world-size-factor``: the target is complete on every rank (each rank all-gathers the
  step's token ids and evaluates the whole update's term, as a replicated global-batch
  load-balancing loss is), and the whole loss, main plus aux, is multiplied by R for DDP's
  average: the aux, already complete, weighs R λ_k.
* ``aux-global-count-local-stats``: ``moe_lb`` from this microbatch's routing statistics,
  f_ue = c_ue / (k n_u) and :math:`\sum_{t\in u}\pi_{te}`, divided by the global token count n
  as the main loss is: :math:`\sum_u E\sum_e f_{ue}\sum_{t\in u}\pi_{te} / n`.
* ``aux-coefficient-twice``: the loss function returns λ_k L_k and the trainer multiplies by
  λ_k again: λ_k² L_k.
* ``aux-summed-over-microbatches``: a ``moe_lb`` term of ``microbatch`` scope, meant as the
  mean over the update's R M forwards of each forward's router loss
  :math:`E\sum_e f_{ue} P_{ue}` (:math:`P_{ue} = \sum_{t\in u}\pi_{te} / n_u`), is the model's
  own: each microbatch's loss gets it at full λ_k, multiplied by R with the main loss and never
  divided by M (transformers' ``Trainer`` under ``num_items_in_batch``). After DDP's average
  the update sums it over its R M forwards: R M times the intended term.

`objective_bug_update` runs one such update; `run_objective_bug_cases` is a
``torch_impl.harness.launcher.launch`` target running a list of them (and the correct
``objective_update`` for pattern ``intended``). torch_impl never imports crosscheck: the
diagnosis that names these lives in `crosscheck.diagnosis.objective_diagnosis`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.functional import softmax
from torch.nn.parallel import DistributedDataParallel

from torch_impl.batch import IGNORE_INDEX, TokenBatch, rank_microbatches
from torch_impl.guards import PRECHECK_TIMEOUT_S, precheck

# The correct objective's pieces: the bugs differ from it only in the target's weights.
from torch_impl.objective import (
    ObjectiveLM,
    _Norm,
    _term_sum,
    _wait,
    count_prepass,
    heads_of,
    objective_update,
    trained_grads,
    wrap_ddp,
)
from torch_impl.objective_terms import (
    HEAD,
    ObjectiveTerm,
    parse_terms,
    term_targets,
    token_losses,
    top_k_counts,
)
from torch_impl.spec import parse_spec
from torch_impl.update import sync_context

PATTERNS: tuple[str, ...] = (
    "sibling-term-scope",
    "shifted-aux-count",
    "aux-world-size-factor",
    "aux-global-count-local-stats",
    "aux-coefficient-twice",
    "aux-summed-over-microbatches",
)
#: The correct step, run by the same launch target for comparison.
INTENDED = "intended"


def check_target(pattern: str, target: ObjectiveTerm, main: ObjectiveTerm) -> None:
    """ValueError unless `pattern` can hit `target` (what each bug is written for)."""
    if pattern not in PATTERNS:
        raise ValueError(f"unknown pattern {pattern!r}; one of {', '.join(PATTERNS)}")
    if target is main:
        raise ValueError("the target must be an auxiliary term, not the main (first) term")
    needs = {
        "shifted-aux-count": "mtp",
        "aux-global-count-local-stats": "moe_lb",
        "aux-summed-over-microbatches": "moe_lb",
    }
    if pattern in needs and target.kind != needs[pattern]:
        raise ValueError(f"{pattern} hits a {needs[pattern]} term, not {target.kind}")
    # Every key at its default is the token mean over the update (the name is only a label).
    token_mean = target.spec is not None and target.spec == parse_spec({}, target.spec.name)
    if pattern == "sibling-term-scope" and not token_mean:
        raise ValueError("sibling-term-scope localizes a token-mean term of update scope")
    if pattern in ("shifted-aux-count", "aux-world-size-factor") and target.scope != "update":
        raise ValueError(f"{pattern} is written for a target of update scope")
    if pattern == "aux-summed-over-microbatches" and target.scope != "microbatch":
        # Summing per-forward means is a bug only of a term meant as their mean.
        raise ValueError(f"{pattern} is written for a target of microbatch scope")


def _rows_of_every_rank(
    x: torch.Tensor, group: dist.ProcessGroup | None, timeout_s: float
) -> torch.Tensor:
    """Every rank's `x` [B, ...], concatenated rank-major along the rows."""
    if not (dist.is_available() and dist.is_initialized()):
        return x
    out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    _wait(dist.all_gather(out, x, group=group, async_op=True), timeout_s, "the aux gather")
    return torch.cat(out)


def _gathered(
    batch: TokenBatch,
    weights: torch.Tensor | None,
    group: dist.ProcessGroup | None,
    timeout_s: float,
) -> tuple[TokenBatch, torch.Tensor | None]:
    """Every rank's rows of this accumulation step, rank-major: the whole update's step m,
    with the target's a_t there (None for moe_lb).

    Token ids and weights only (no gradient crosses ranks): each rank then evaluates the
    complete term with its own replica of the params, as a replicated global-batch loss does.
    """
    inputs, targets, segment_ids = (
        _rows_of_every_rank(x, group, timeout_s)
        for x in (batch.inputs, batch.targets, batch.segment_ids)
    )
    whole = batch._replace(inputs=inputs, targets=targets, segment_ids=segment_ids)
    return whole, None if weights is None else _rows_of_every_rank(weights, group, timeout_s)


def _local_balance(
    term: ObjectiveTerm, out: dict[str, torch.Tensor], batch: TokenBatch
) -> tuple[torch.Tensor, int]:
    """(E sum_e f_ue sum_{t in u} pi_te, n_u) from this microbatch's routing alone, as a
    model's forward computes it: f_ue = c_ue / (k n_u) from its top-k picks (no gradient)."""
    real = batch.segment_ids > 0
    probs = softmax(out["router"].to(torch.float64), dim=-1)
    counts = top_k_counts(probs.detach(), real, term.top_k).to(torch.float64)
    n_local = max(int(real.sum()), 1)
    f = counts / (term.top_k * n_local)  # this microbatch's f_ue
    mass = torch.where(real.unsqueeze(-1), probs, 0.0).sum(dim=(0, 1))  # sum_t pi_te
    return probs.shape[-1] * (f * mass).sum(), n_local


def _buggy_part(
    pattern: str,
    term: ObjectiveTerm,
    norm: _Norm,
    main: _Norm,
    module: nn.Module,
    out: dict[str, torch.Tensor],
    batch: TokenBatch,
    m: int,
    M: int,
    gathered: tuple[TokenBatch, torch.Tensor | None] | None,
) -> torch.Tensor:
    """The target's λ-free loss of microbatch m as the buggy loop writes it, float64."""
    if pattern in ("sibling-term-scope", "shifted-aux-count"):
        targets = term_targets(term.kind, batch)
        losses = token_losses(term.kind, out[HEAD[term.kind]], targets, out.get("ref"))
        if pattern == "shifted-aux-count":
            # One num_tokens for every term: the main term's n, not the rolled mask's n'.
            return losses.sum() / main.count
        # The criterion's own mean over this microbatch, then the loop's 1 / M.
        n_local = int((targets != IGNORE_INDEX).sum())
        return losses.sum() / max(n_local, 1) / M
    if pattern == "aux-world-size-factor":
        # The whole update's step m on this rank: the correct weights over all its tokens.
        heads = (HEAD[term.kind], *(("ref",) if term.kind == "ref_kl" else ()))
        whole, weights = gathered
        if weights is not None:  # a per-token term: a_t of the gathered rows
            norm = norm._replace(weights={m: weights})
        return _term_sum(term, norm, module(whole.inputs, heads), whole, m)
    if pattern == "aux-global-count-local-stats":
        # Divided like the main loss: by the update's token count n.
        return _local_balance(term, out, batch)[0] / norm.count
    if pattern == "aux-summed-over-microbatches":
        # The forward's own router loss, E sum_e f_ue P_ue: its mean over its n_u tokens.
        balance, n_local = _local_balance(term, out, batch)
        return balance / n_local
    if pattern == "aux-coefficient-twice":
        # The loss function already returned λ L; the caller multiplies by λ again.
        return term.coefficient * _term_sum(term, norm, out, batch, m)
    raise ValueError(f"unknown pattern {pattern!r}; one of {', '.join(PATTERNS)}")


def objective_bug_update(
    model: nn.Module,
    microbatches: Sequence[TokenBatch],
    terms: Sequence[Mapping[str, Any]],
    target: str,
    pattern: str,
    *,
    vocab_size: int,
    group: dist.ProcessGroup | None = None,
    timeout_s: float = PRECHECK_TIMEOUT_S,
) -> None:
    """One update of `terms` with `target` weighted as `pattern` does; the buggy gradient
    lands in every rank's .grad. `model` is `wrap_ddp`'s DDP with zeroed gradients."""
    parsed = parse_terms(terms)
    hit = next((t for t in parsed if t.name == target), None)
    if hit is None:
        raise ValueError(f"no term {target!r} in {[t.name for t in parsed]}")
    check_target(pattern, hit, parsed[0])
    precheck(microbatches, vocab_size, group, timeout_s)
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank(group) if distributed else 0
    world_size = dist.get_world_size(group) if distributed else 1
    module = model.module if isinstance(model, DistributedDataParallel) else model
    M = len(microbatches)
    # The same exact count pre-pass as the correct step: only the target's use of it differs.
    norms = count_prepass(module, microbatches, parsed, rank, world_size, group, timeout_s)
    heads = heads_of(parsed)
    for m, batch in enumerate(microbatches):
        # Collectives before the step's forward: every rank reaches them in the same order.
        whole = None
        if pattern == "aux-world-size-factor":
            weights = norms[parsed.index(hit)].weights
            whole = _gathered(batch, None if weights is None else weights[m], group, timeout_s)
        with sync_context(model, m == M - 1):
            out = model(batch.inputs, heads)
            total = torch.zeros((), dtype=torch.float64)
            for term, norm in zip(parsed, norms, strict=True):
                if term is hit:
                    part = _buggy_part(
                        pattern, term, norm, norms[0], module, out, batch, m, M, whole
                    )
                    # A per-microbatch criterion knows no world size: no factor R; the others
                    # are multiplied by R with the rest of the loss.
                    factor = 1 if pattern == "sibling-term-scope" else world_size
                else:
                    part, factor = _term_sum(term, norm, out, batch, m), world_size
                total = total + factor * term.coefficient * part
            total.backward()


@dataclass(frozen=True, kw_only=True, slots=True)
class ObjectiveBugCase:
    """One step at one layout: `pattern` (or ``intended``) hitting `target` of `terms`."""

    label: str
    pattern: str
    target: str | None
    batch: Mapping[str, np.ndarray]
    params: Mapping[str, np.ndarray]
    terms: Sequence[Mapping[str, Any]]
    accum_steps: int
    vocab_size: int


@dataclass(frozen=True, slots=True)
class ObjectiveBugOutput:
    label: str
    grads: dict[str, np.ndarray]


def run_objective_bug_cases(
    rank: int, world_size: int, cases: Sequence[ObjectiveBugCase]
) -> list[ObjectiveBugOutput]:
    """On each rank: every case on a fresh DDP model, in order (a ``launch`` target)."""
    out = []
    for case in cases:
        module = ObjectiveLM(dict(case.params), dtype=torch.float64)
        ddp = wrap_ddp(module, case.terms)
        microbatches = rank_microbatches(dict(case.batch), rank, world_size, case.accum_steps)
        if case.pattern == INTENDED:
            objective_update(ddp, microbatches, case.terms, vocab_size=case.vocab_size)
        else:
            objective_bug_update(
                ddp,
                microbatches,
                case.terms,
                case.target,
                case.pattern,
                vocab_size=case.vocab_size,
            )
        out.append(ObjectiveBugOutput(case.label, trained_grads(module)))
    return out
