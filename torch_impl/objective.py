r"""A multi-term objective (docs/objectives.md) under DistributedDataParallel: precount.

    total = sum_k λ_k L_k,   L_k = (1/K_k) sum over units u of (sum_{t in u} a^k_t l^k_t) / D^k_u

with K_k = 1, R or R M units for scope ``update``, ``rank`` or ``microbatch``. The model is the
bilinear family (`ObjectiveLM`): h_t = embed[x_t], and each head W (``unembed``,
``mtp_unembed``, ``router``) gives logits h_t W; ``ref_embed`` and ``ref_unembed`` are a frozen
reference that only ``ref_kl`` reads, and no gradient reaches.

One update on rank r, holding M microbatches of its rows (`objective_update`):

1. Count pre-pass, before any backward: for every term and microbatch m the mask count and
   d_m (`objective_terms.token_weights`), and for ``moe_lb`` the router's top-k expert counts
   c_me from a forward without gradient. One all-reduce of an int64 vector with one slot per
   rank hands every rank every rank's counts, exactly (a SUM adds only zeros to each slot).
   From them each term's D_u: the sum of d over the unit; for ``moe_lb`` D_u = k n_u^2 / E
   and the counts g_u = c_u (summed over the whole update at ``update`` scope, one
   (rank, microbatch)'s own at ``microbatch`` scope). An update-scope moe_lb built from local
   counts would be the microbatch-scope objective of another layout.
2. Each microbatch backpropagates s sum_k λ_k (sum_{t in m} a_t l_t) / (D_u K) with
   s = R: DDP averages the summed gradients over the R ranks, so s / R = 1 leaves the exact
   gradient of total. The first M - 1 backwards run under ``no_sync`` and only accumulate
   locally; the last one all-reduces. ``moe_lb``'s l_t = sum_e g_ue π_te: the counts are
   constants, so the gradient flows through P only (Switch's f · P).
3. One float64 all-reduce of every rank's per-term sums gives each L_k for the update log.

Every count is an integer (int64, exact), every scale 1 / (D_u K) float64; only the model's
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

from torch_impl.batch import IGNORE_INDEX, TokenBatch
from torch_impl.guards import PRECHECK_TIMEOUT_S, NonFiniteError, precheck
from torch_impl.objective_terms import (
    HEAD,
    ObjectiveTerm,
    parse_terms,
    term_targets,
    token_losses,
    token_weights,
    top_k_counts,
)
from torch_impl.update import sync_context

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
    """A term's constants for the backward: 1 / (D_u K) per local microbatch [M], a_t per
    microbatch (None for moe_lb) and moe_lb's expert counts g [M, E]; plus what is logged."""

    scales: list[float]
    weights: list[torch.Tensor] | None
    expert_counts: torch.Tensor | None
    count: int
    denominators: tuple[float, ...]


def _wait(work: Any, timeout_s: float, what: str) -> None:
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise TimeoutError(f"{what}: not every rank arrived within {timeout_s:g} s") from exc


def _gather_int64(
    local: torch.Tensor, group: dist.ProcessGroup | None, timeout_s: float
) -> torch.Tensor:
    """Every rank's int64 vector `local`, [R, len]: one SUM all-reduce of one slot per rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return local.unsqueeze(0)
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    slots = torch.zeros(world_size, local.numel(), dtype=torch.int64)
    slots[rank] = local
    work = dist.all_reduce(slots, op=dist.ReduceOp.SUM, group=group, async_op=True)
    _wait(work, timeout_s, "the count pre-pass")
    return slots


def _local_counts(
    module: nn.Module, microbatches: Sequence[TokenBatch], terms: Sequence[ObjectiveTerm]
) -> tuple[list[list[torch.Tensor] | None], list[torch.Tensor]]:
    """Per term: a_t per microbatch (per-token kinds), and the int64 counts of every
    microbatch, flattened: [M, 2] (mask count, d_m) or, for moe_lb, [M, 1 + E] (n_m, c_me)."""
    weights, counts = [], []
    for term in terms:
        rows = []
        if term.kind == "moe_lb":
            term_weights = None
            for batch in microbatches:
                real = batch.segment_ids > 0  # padding is not routed
                with torch.no_grad():
                    probs = softmax(module(batch.inputs, ("router",))["router"].double(), -1)
                expert = top_k_counts(probs, real, term.top_k)
                rows.append(torch.cat([real.sum().reshape(1), expert]))
        else:
            term_weights = []
            for batch in microbatches:
                mask = term_targets(term.kind, batch.targets, batch.segment_ids) != IGNORE_INDEX
                a, d = token_weights(term.group, mask, batch.segment_ids)
                term_weights.append(a)
                rows.append(torch.tensor([int(mask.sum()), d]))
        weights.append(term_weights)
        counts.append(torch.stack(rows).to(torch.int64))
    return weights, counts


def _norm(
    term: ObjectiveTerm, weights: list[torch.Tensor] | None, counts: torch.Tensor, rank: int
) -> _Norm:
    """A term's scales from every rank's counts `counts` [R, M, width]."""
    R, M = counts.shape[:2]
    if term.kind == "moe_lb":
        E = counts.shape[-1] - 1
        n, c = counts[..., 0], counts[..., 1:]
        if term.scope == "update":
            n, c = n.sum().reshape(1, 1), c.sum(dim=(0, 1), keepdim=True)
        units = [term.top_k * float(x) ** 2 / E for x in n.flatten().tolist()]
        g = c.expand(R, M, E)[rank].to(torch.float64)
    else:
        d = counts[..., 1]
        g = None
        by_scope = {
            "update": d.sum().reshape(1, 1),
            "rank": d.sum(dim=1, keepdim=True),
            "microbatch": d,
        }
        n = by_scope[term.scope]
        units = [float(x) for x in n.flatten().tolist()]
    K = len(units)
    # Unit of each (rank, microbatch) in rank-major order; a unit with D_u = 0 has no token
    # of weight and contributes 0, never 0/0.
    grid = np.asarray(units, dtype=np.float64).reshape(n.shape)
    grid = np.broadcast_to(grid, (R, M))[rank]
    scales = [0.0 if D == 0 else 1.0 / D / K for D in grid.tolist()]
    return _Norm(scales, weights, g, int(counts[..., 0].sum()), tuple(units))


def _term_sum(
    term: ObjectiveTerm, norm: _Norm, out: dict[str, torch.Tensor], batch: TokenBatch, m: int
) -> torch.Tensor:
    """sum_{t in m} a_t l_t / (D_u K) of one term, float64, differentiable."""
    if term.kind == "moe_lb":
        probs = softmax(out["router"].to(torch.float64), dim=-1)
        losses = torch.where(batch.segment_ids > 0, probs @ norm.expert_counts[m], 0.0)
        return losses.sum() * norm.scales[m]
    targets = term_targets(term.kind, batch.targets, batch.segment_ids)
    losses = token_losses(term.kind, out[HEAD[term.kind]], targets, out.get("ref"))
    return (norm.weights[m] * losses).sum() * norm.scales[m]


def count_prepass(
    module: nn.Module,
    microbatches: Sequence[TokenBatch],
    parsed: Sequence[ObjectiveTerm],
    rank: int,
    world_size: int,
    group: dist.ProcessGroup | None,
    timeout_s: float,
) -> list[_Norm]:
    """Every term's weights and denominators, from this rank's counts and one int64
    collective of every term's counts over the ranks (each term's block then [R, M, width]),
    before any backward."""
    weights, counts = _local_counts(module, microbatches, parsed)
    gathered = _gather_int64(torch.cat([c.flatten() for c in counts]), group, timeout_s)
    blocks = gathered.split([c.numel() for c in counts], dim=1)
    gathered = [b.reshape(world_size, *c.shape) for b, c in zip(blocks, counts, strict=True)]
    return [_norm(t, w, c, rank) for t, w, c in zip(parsed, weights, gathered, strict=True)]


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
    if distributed:
        work = dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group, async_op=True)
        _wait(work, timeout_s, "the term-loss log")
    logs = tuple(
        TermLog(t.name, t.kind, t.coefficient, float(loss), n.count, n.denominators)
        for t, n, loss in zip(parsed, norms, local.tolist(), strict=True)
    )
    return ObjectiveLog(math.fsum(t.coefficient * t.loss for t in logs), logs)
