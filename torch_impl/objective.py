r"""A multi-term objective (docs/objectives.md) under DistributedDataParallel: precount.

    total = sum_k λ_k L_k,   L_k = (1/K_k) sum over units u of (sum_{t in u} a^k_t l^k_t) / D^k_u

with K_k = 1, R or R M units for scope ``update``, ``rank`` or ``microbatch``. The model is the
bilinear family (`ObjectiveLM`): h_t = embed[x_t], and each head W (``unembed``,
``mtp_unembed``, ``router``) gives logits h_t W; ``ref_embed`` and ``ref_unembed`` are a frozen
reference that only ``ref_kl`` reads, and no gradient reaches.

One update on rank r, holding M microbatches of its rows (`objective_update`):

1. Count pre-pass, before any backward. A per-token term is its scheme spec seen through
   `torch_impl.spec_counts.SpecView`, the same reading as a single-term update, over the
   microbatches with the term's targets (y', so v'_t, for mtp): any spec, the group and
   document counts that cross microbatches and ranks included. ``moe_lb`` counts the router's
   top-k experts c_me from a forward without gradient. One float64 all-reduce carries what
   every term needs from the other ranks: each spec's per-id count vectors and its share of
   an additive D (summed), and each term's per-microbatch counts in this rank's slot (a SUM
   adds only zeros to each slot, so every rank gets every rank's counts, exactly: integers
   below 2^53). From them each term's a_t and D_u; for ``moe_lb`` D_u = k n_u^2 / E and the
   counts g_u = c_u (summed over the whole update at ``update`` scope, one
   (rank, microbatch)'s own at ``microbatch`` scope). An update-scope moe_lb built from local
   counts would be the microbatch-scope objective of another layout.
2. Each microbatch backpropagates s sum_k λ_k (sum_{t in m} a_t l_t) / (D_u K) with
   s = R: DDP averages the summed gradients over the R ranks, so s / R = 1 leaves the exact
   gradient of total. The first M - 1 backwards run under ``no_sync`` and only accumulate
   locally; the last one all-reduces. ``moe_lb``'s l_t = sum_e g_ue π_te: the counts are
   constants, so the gradient flows through P only (Switch's f · P).
3. One float64 all-reduce of every rank's per-term sums gives each L_k for the update log,
   and every rank's D_u of the terms normalized per rank or per microbatch.

Every count is an integer (exact), every weight and scale float64; only the model's
forward and backward run in its dtype. Each wait on a collective is bounded: the pre-check's
and this module's by `timeout_s`, DDP's gradient all-reduce by the process group's timeout.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.functional import softmax
from torch.nn.parallel import DistributedDataParallel

from torch_impl.batch import TokenBatch
from torch_impl.guards import PRECHECK_TIMEOUT_S, NonFiniteError, precheck
from torch_impl.objective_terms import (
    HEAD,
    ObjectiveTerm,
    parse_terms,
    term_targets,
    token_losses,
    top_k_counts,
)
from torch_impl.spec_counts import SpecView, token_mask
from torch_impl.update import plan_update, spec_view, sync_context

TRAINED_PARAMS: tuple[str, ...] = ("embed", "unembed", "mtp_unembed", "router")
FROZEN_PARAMS: tuple[str, ...] = ("ref_embed", "ref_unembed")


class ObjectiveLM(nn.Module):
    """The bilinear model family: ``forward(inputs, heads)`` -> {head: logits [B, T, out]}.

    Holds whichever of the params it was built with; ``embed`` always. The frozen reference
    is a parameter with ``requires_grad=False``: it moves with the module and loads like the
    others, and DDP leaves it out of its buckets.
    """

    def __init__(
        self, params: Mapping[str, np.ndarray], dtype: torch.dtype = torch.float64
    ) -> None:
        super().__init__()
        unknown = sorted(set(params) - {*TRAINED_PARAMS, *FROZEN_PARAMS})
        if "embed" not in params or unknown:
            raise ValueError(
                f"ObjectiveLM needs 'embed' and knows {TRAINED_PARAMS + FROZEN_PARAMS}"
                f", got {sorted(params)}"
            )
        for name in (*TRAINED_PARAMS, *FROZEN_PARAMS):
            if name in params:
                # torch.tensor copies: fixture arrays are read-only and must stay so.
                value = torch.tensor(np.asarray(params[name]), dtype=dtype)
                setattr(self, name, nn.Parameter(value, requires_grad=name in TRAINED_PARAMS))

    def forward(self, inputs: torch.Tensor, heads: Sequence[str]) -> dict[str, torch.Tensor]:
        # A plain gather, not nn.Embedding: the param keeps the oracle's name and [V, H] shape
        # and its gradient stays dense, as DDP's buckets need.
        hidden = self.embed[inputs]
        out = {head: hidden @ getattr(self, head) for head in heads if head != "ref"}
        if "ref" in heads:
            with torch.no_grad():  # q_t is a constant of the objective
                out["ref"] = self.ref_embed[inputs] @ self.ref_unembed
        return out


def heads_of(terms: Sequence[ObjectiveTerm]) -> tuple[str, ...]:
    """The heads the terms read, "ref" standing for the frozen reference's logits."""
    heads = {HEAD[t.kind] for t in terms}
    if any(t.kind == "ref_kl" for t in terms):
        heads.add("ref")
    return tuple(sorted(heads))


def wrap_ddp(
    module: ObjectiveLM, terms: Sequence[Mapping[str, Any]], group: dist.ProcessGroup | None = None
) -> DistributedDataParallel:
    """DDP around `module` for `terms`: a trained param that no term reads (a router without
    moe_lb) never gets a gradient hook call, so DDP must be told to look for unused ones."""
    read = {"embed", *heads_of(parse_terms(terms))}
    unused = [n for n, p in module.named_parameters() if p.requires_grad and n not in read]
    return DistributedDataParallel(module, process_group=group, find_unused_parameters=bool(unused))


class TermLog(NamedTuple):
    """One term of the update, as every rank sees it."""

    name: str
    kind: str
    coefficient: float
    #: L_k, before the coefficient.
    loss: float
    #: Tokens of the term's mask over the update (v, v' for mtp, real tokens for moe_lb).
    count: int
    #: D_u of every unit of the term's scope, rank-major ([1], [R] or [R M]).
    denominators: tuple[float, ...]


class ObjectiveLog(NamedTuple):
    """The update log: the total and every term."""

    loss: float
    terms: tuple[TermLog, ...]

    def term(self, name: str) -> TermLog:
        """The log of the term called `name`."""
        return next(t for t in self.terms if t.name == name)


class _Norm(NamedTuple):
    """A term's constants for the backward: a scale per local microbatch [M], a_t per
    microbatch (None for moe_lb) and moe_lb's expert counts g [M, E]; plus what is logged.

    Update scope: a_t and 1 / D. Rank or microbatch scope: a_t / D_u and 1 / K."""

    scales: list[float]
    weights: list[torch.Tensor] | None
    expert_counts: torch.Tensor | None
    count: int
    #: D_u of every unit, rank-major; for a per-token term of rank or microbatch scope only
    #: this rank's (`local_units`), gathered with the term-loss log.
    denominators: tuple[float, ...]
    local_units: bool = False


def _wait(work: Any, timeout_s: float, what: str) -> None:
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise TimeoutError(f"{what}: not every rank arrived within {timeout_s:g} s") from exc


def _all_reduce_sum(
    payload: torch.Tensor, group: dist.ProcessGroup | None, timeout_s: float, what: str
) -> torch.Tensor:
    """SUM over the ranks (the payload itself without a process group); a bounded wait."""
    if dist.is_available() and dist.is_initialized() and payload.numel():
        _wait(
            dist.all_reduce(payload, op=dist.ReduceOp.SUM, group=group, async_op=True),
            timeout_s,
            what,
        )
    return payload


def _slots(local: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """[R, len]: `local` in row `rank`, zeros elsewhere; summed over ranks, every rank's."""
    slots = torch.zeros(world_size, local.numel(), dtype=torch.float64)
    slots[rank] = local.to(torch.float64)
    return slots


def _term_view(
    term: ObjectiveTerm,
    microbatches: Sequence[TokenBatch],
    group: dist.ProcessGroup | None,
    timeout_s: float,
) -> SpecView:
    """The term's spec over the microbatches with the term's targets (its mask as ``valid``)."""
    own = [b._replace(targets=term_targets(term.kind, b)) for b in microbatches]
    return spec_view(term.spec, own, group=group, timeout_s=timeout_s)


def _local_counts(
    module: nn.Module,
    view: SpecView | None,
    term: ObjectiveTerm,
    microbatches: Sequence[TokenBatch],
) -> torch.Tensor:
    """The term's int64 counts of every microbatch: [M, 1] (the numerator mask's tokens) or,
    for moe_lb, [M, 1 + E] (real tokens n_m, expert counts c_me)."""
    if view is not None:
        mask = term.spec.weight.mask
        return torch.tensor([[int(token_mask(b, mask).sum())] for b in view.microbatches])
    rows = []
    for batch in microbatches:
        real = batch.segment_ids > 0  # padding is not routed
        with torch.no_grad():
            probs = softmax(module(batch.inputs, ("router",))["router"].double(), -1)
        rows.append(torch.cat([real.sum().reshape(1), top_k_counts(probs, real, term.top_k)]))
    return torch.stack(rows).to(torch.int64)


def _router_norm(
    term: ObjectiveTerm, counts: torch.Tensor, rank: int, context_size: int = 1
) -> _Norm:
    """moe_lb's scales from every rank's counts [R, M, 1 + E]; under context parallel (the
    R rows being R' C processes) a microbatch is its data rank's, all C shards of its rows:
    their counts are summed first."""
    if context_size > 1:
        processes, M, width = counts.shape
        counts = counts.view(processes // context_size, context_size, M, width).sum(dim=1)
        rank //= context_size
    R, M, width = counts.shape
    E = width - 1
    n, c = counts[..., 0], counts[..., 1:]
    if term.scope == "update":
        n, c = n.sum().reshape(1, 1), c.sum(dim=(0, 1), keepdim=True)
    units = [term.top_k * float(x) ** 2 / E for x in n.flatten().tolist()]
    K = len(units)
    # Unit of each (rank, microbatch) in rank-major order; a unit with D_u = 0 has no token
    # of weight and contributes 0, never 0/0.
    grid = np.broadcast_to(np.asarray(units, dtype=np.float64).reshape(n.shape), (R, M))[rank]
    scales = [0.0 if D == 0 else 1.0 / D / K for D in grid.tolist()]
    g = c.expand(R, M, E)[rank].to(torch.float64)
    return _Norm(scales, None, g, int(counts[..., 0].sum()), tuple(units))


def _spec_norm(
    term: ObjectiveTerm, view: SpecView, prepass: torch.Tensor, shares: torch.Tensor, count: int
) -> _Norm:
    """A per-token term's weights from its summed pre-pass vectors and every rank's share of
    an additive D (`torch_impl.update.plan_update`, as a single-term update)."""
    plan = plan_update(view, view.split_prepass(prepass))
    M = len(view.microbatches)
    if term.spec.scope == "update":
        D = plan.denominator(shares.tolist())
        return _Norm([0.0 if D == 0 else 1.0 / D] * M, plan.weights, None, count, (D,))
    # a_t / D_u already; K units of the scope.
    K = plan.denominator([])
    return _Norm([1.0 / K] * M, plan.weights, None, count, plan.unit_denominators, True)


def count_prepass(
    module: nn.Module,
    microbatches: Sequence[TokenBatch],
    parsed: Sequence[ObjectiveTerm],
    rank: int,
    world_size: int,
    group: dist.ProcessGroup | None,
    timeout_s: float,
) -> list[_Norm]:
    """Every term's weights and denominators, from this rank's counts and one float64
    all-reduce over the ranks (module docstring, step 1), before any backward."""
    views = [
        None if t.kind == "moe_lb" else _term_view(t, microbatches, group, timeout_s)
        for t in parsed
    ]
    counts = [_local_counts(module, v, t, microbatches) for t, v in zip(parsed, views, strict=True)]
    prepass = [
        torch.zeros(0, dtype=torch.float64) if v is None else v.local_prepass() for v in views
    ]
    shares = [
        torch.tensor([0.0 if v is None else v.update_share()], dtype=torch.float64) for v in views
    ]
    # Per term, in this rank's slot: its counts, then its share of D.
    local = torch.cat(
        [torch.cat([c.flatten().to(torch.float64), s]) for c, s in zip(counts, shares, strict=True)]
    )
    payload = torch.cat([_slots(local, rank, world_size).flatten(), *prepass])
    payload = _all_reduce_sum(payload, group, timeout_s, "the count pre-pass")
    slots = payload[: world_size * local.numel()].view(world_size, -1)
    summed = payload[world_size * local.numel() :].split([p.numel() for p in prepass])
    blocks = slots.split([c.numel() + 1 for c in counts], dim=1)
    norms = []
    for term, view, c, block, vector in zip(parsed, views, counts, blocks, summed, strict=True):
        every = block[:, :-1].round().to(torch.int64).reshape(world_size, *c.shape)
        if view is None:
            norms.append(_router_norm(term, every, rank, microbatches[0].context_size))
        else:
            norms.append(_spec_norm(term, view, vector, block[:, -1], int(every.sum())))
    return norms


def _term_sum(
    term: ObjectiveTerm, norm: _Norm, out: dict[str, torch.Tensor], batch: TokenBatch, m: int
) -> torch.Tensor:
    """sum_{t in m} a_t l_t / (D_u K) of one term, float64, differentiable."""
    if term.kind == "moe_lb":
        probs = softmax(out["router"].to(torch.float64), dim=-1)
        losses = torch.where(batch.segment_ids > 0, probs @ norm.expert_counts[m], 0.0)
        return losses.sum() * norm.scales[m]
    targets = term_targets(term.kind, batch)
    losses = token_losses(term.kind, out[HEAD[term.kind]], targets, out.get("ref"))
    return (norm.weights[m] * losses).sum() * norm.scales[m]


def trained_grads(module: nn.Module) -> dict[str, np.ndarray]:
    """Every trained param's gradient as float64 numpy; a head no term reads has no .grad,
    and its gradient is zero (the oracle's too)."""
    return {
        name: (torch.zeros_like(p) if p.grad is None else p.grad).detach().to("cpu").numpy().copy()
        for name, p in module.named_parameters()
        if p.requires_grad
    }


def objective_update(
    model: nn.Module,
    microbatches: Sequence[TokenBatch],
    terms: Sequence[Mapping[str, Any]],
    *,
    vocab_size: int,
    reduce_factor: float | None = None,
    group: dist.ProcessGroup | None = None,
    timeout_s: float = PRECHECK_TIMEOUT_S,
) -> ObjectiveLog:
    """One update of the objective `terms`; the gradient of total lands in every rank's .grad.

    `model` is `wrap_ddp`'s DDP (or a bare `ObjectiveLM` without a process group), with
    zeroed gradients. `reduce_factor` is what the wrapper divides the summed gradients by:
    DDP averages, so it defaults to the group's size (1 without one).
    """
    parsed = parse_terms(terms)
    precheck(microbatches, vocab_size, group, timeout_s)
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank(group) if distributed else 0
    world_size = dist.get_world_size(group) if distributed else 1
    s = float(world_size if reduce_factor is None else reduce_factor)
    module = model.module if isinstance(model, DistributedDataParallel) else model
    for term in parsed:
        needed = [HEAD[term.kind], *(FROZEN_PARAMS if term.kind == "ref_kl" else ())]
        missing = [p for p in needed if not hasattr(module, p)]
        if missing:
            raise ValueError(f"term {term.name!r} ({term.kind}) needs params {missing}")
    M = len(microbatches)
    norms = count_prepass(module, microbatches, parsed, rank, world_size, group, timeout_s)
    heads = heads_of(parsed)
    local = torch.zeros(len(parsed), dtype=torch.float64)
    for m, batch in enumerate(microbatches):
        with sync_context(model, m == M - 1):
            out = model(batch.inputs, heads)
            parts = [_term_sum(t, n, out, batch, m) for t, n in zip(parsed, norms, strict=True)]
            total = sum(t.coefficient * p for t, p in zip(parsed, parts, strict=True))
            value = float(total.detach())
            if not math.isfinite(value):
                # Named where it starts; the peers' next wait is bounded (module docstring).
                raise NonFiniteError(f"rank {rank}, microbatch {m}: the objective is {value}")
            (total * s).backward()
        local += torch.stack([p.detach() for p in parts])
    # The log: every rank's term sums, and its own D_u of the terms with local units, in its
    # slot (rank-major after the SUM).
    own = [torch.tensor(n.denominators, dtype=torch.float64) for n in norms if n.local_units]
    units = torch.cat(own) if own else torch.zeros(0, dtype=torch.float64)
    payload = torch.cat([local, _slots(units, rank, world_size).flatten()])
    payload = _all_reduce_sum(payload, group, timeout_s, "the term-loss log")
    gathered = iter(
        payload[len(parsed) :].view(world_size, -1).split([u.numel() for u in own], dim=1)
    )
    logs = tuple(
        TermLog(
            t.name,
            t.kind,
            t.coefficient,
            float(loss),
            n.count,
            tuple(next(gathered).flatten().tolist()) if n.local_units else n.denominators,
        )
        for t, n, loss in zip(parsed, norms, payload[: len(parsed)].tolist(), strict=True)
    )
    return ObjectiveLog(math.fsum(t.coefficient * t.loss for t in logs), logs)
