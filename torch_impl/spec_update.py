r"""One update of a spec (contract v2) under DDP or FSDP2: precount and postnorm.

The update must leave in every rank's ``.grad`` the gradient of

.. math::

    L = \frac{1}{K} \sum_u \frac{\sum_{t \in u} a_t l_t}{D_u}

(``torch_impl.spec_counts`` gives a_t and D_u). Counts of a group or document at update scope
are not known inside a rank, so before any backward a **count pre-pass** sums every rank's
per-id count vector (``SpecView.local_prepass``) in one all-reduce; a_t is then local again.

precount (scope update)
    The pre-pass vector and every rank's (share of D, valid tokens), each rank in its own
    float64 slot, travel in ONE all-reduce: D = fsum of the shares (exact, order-free), or for
    a count of global groups D is read off the summed vector. Then each microbatch
    backpropagates :math:`(\sum a_t l_t)\, s / D` with s the wrapper's reduce factor
    (s = R under DDP's or FSDP2's averaging), exactly as ``update.accumulate_precount``.
postnorm (scope update)
    The pre-pass vector is reduced first (only when the spec needs one); the unnormalized sums
    are backpropagated, the comm hook sums the gradients and carries each rank's share of D
    (``torch_impl.comm_hooks``), and the gradients are divided by D afterwards.
scope rank or microbatch
    Each unit's D_u is local (after the pre-pass, when a_t needs update-scope counts): every
    microbatch backpropagates :math:`\sum a_t l_t / D_u` (0 when D_u = 0); precount scales it
    by s / K, postnorm divides the summed gradient by K.

Every collective wait is bounded (``COUNT_TIMEOUT_S``, like the pre-check). The microbatch loop
itself, its guards and the hook are ``torch_impl.update``'s; no resume inside an update here.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torch_impl.batch import TokenBatch
from torch_impl.comm_hooks import PostnormState
from torch_impl.division import divide_all_exactly
from torch_impl.exact_carry import all_ranks_values
from torch_impl.guards import PRECHECK_TIMEOUT_S, precheck
from torch_impl.partial import starting_point
from torch_impl.schemes import (
    PerTokenLosses,
    WeightingScheme,
    bilinear_token_losses,
    global_denominator,
)
from torch_impl.spec import SchemeSpec, get_spec
from torch_impl.spec_counts import IdBounds, Position, SpecView
from torch_impl.update import backward_microbatches, over_or_zero

#: How long a pre-pass collective waits for every rank (a rank that failed or hangs).
COUNT_TIMEOUT_S = PRECHECK_TIMEOUT_S


@dataclass(frozen=True, kw_only=True, slots=True)
class SpecAccumulated:
    """One update of a spec after its backward passes, as seen from one rank."""

    spec: str
    scope: str
    #: K: units of the scope (1, R or R M).
    num_units: int
    #: D of this rank's units: scope update (D,), rank (D_r,), microbatch (D_r0, ..., D_rM-1).
    unit_denominators: tuple[float, ...]
    #: Every rank's sum over its microbatches of a_t l_t (scope update) or a_t l_t / D_u.
    rank_loss_sums: tuple[float, ...]
    rank_valid_tokens: tuple[int, ...]
    #: L = fsum(rank_loss_sums) / D (update) or / K (rank, microbatch); 0 when D = 0.
    objective: float


def _bounded(tensor: torch.Tensor, op: Any, group: Any, timeout_s: float, what: str) -> None:
    """all_reduce `tensor` in place, waiting at most `timeout_s` for every rank."""
    work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise TimeoutError(
            f"rank {dist.get_rank(group)}: not every rank reached the {what} within "
            f"{timeout_s:g} s (a rank that failed, hangs, or runs another spec)"
        ) from exc


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def spec_view(
    spec: SchemeSpec,
    microbatches: Sequence[TokenBatch],
    *,
    group: dist.ProcessGroup | None = None,
    id_bounds: IdBounds | None = None,
    timeout_s: float = COUNT_TIMEOUT_S,
) -> SpecView:
    """This rank's view; ids bounds agreed by a MAX all-reduce when needed and not given.

    The bounds are the lengths of the pre-pass vectors, so every rank must use the same; a
    caller that knows the global batch (the harness) passes them and saves the collective.
    """
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if _distributed() else (0, 1)
    position = Position(rank, world, len(microbatches))
    view = SpecView(spec, microbatches, position, id_bounds or IdBounds.of(microbatches))
    global_ids = {view.weight_group, view.den_group} & {"group", "document"}
    if id_bounds is None and _distributed() and view.global_parts() and global_ids:
        local = IdBounds.of(microbatches)
        bounds = torch.tensor([local.groups, local.documents], dtype=torch.int64)
        _bounded(bounds, dist.ReduceOp.MAX, group, timeout_s, "agreement on id bounds")
        view = SpecView(spec, microbatches, position, IdBounds(*map(int, bounds.tolist())))
    return view


@dataclass(frozen=True, slots=True)
class _Plan:
    """Per microbatch: the weights to backpropagate and d to carry; and the D to divide by."""

    weights: list[torch.Tensor]
    shares: list[float]
    #: None: D is the fsum of every rank's shares. Otherwise D itself (or K).
    fixed: float | None
    unit_denominators: tuple[float, ...]


def _plan(view: SpecView, global_parts: Mapping[str, torch.Tensor]) -> _Plan:
    """a_t (scope update) or a_t / D_u (local scopes); D_u = 0 gives weights 0, never NaN."""
    spec, M = view.spec, len(view.microbatches)
    numerators = view.numerators(global_parts)
    steps = list(range(M))
    if spec.scope == "update":
        # The rank's additive share rides on its last microbatch: d is only ever summed.
        shares = [0.0] * M
        if view.additive():
            shares[-1] = view.update_share()
            return _Plan(numerators, shares, None, ())
        D = view.unit_denominator(steps, "update", global_parts)
        return _Plan(numerators, shares, D, (D,))
    units = [steps] if spec.scope == "rank" else [[s] for s in steps]
    K = view.position.world_size * (1 if spec.scope == "rank" else M)
    weights = list(numerators)
    denominators = []
    for unit in units:
        D_u = view.unit_denominator(unit, spec.scope, global_parts)
        denominators.append(D_u)
        for s in unit:
            weights[s] = numerators[s] / D_u if D_u else torch.zeros_like(numerators[s])
    return _Plan(weights, [0.0] * M, float(K), tuple(denominators))


def _bound_scheme(name: str, microbatches: Sequence[TokenBatch], plan: _Plan) -> WeightingScheme:
    """The plan as a ``WeightingScheme`` of these very microbatch objects, for update's loop."""
    table = {id(b): (w, d) for b, w, d in zip(microbatches, plan.weights, plan.shares, strict=True)}

    def entry(batch: TokenBatch) -> tuple[torch.Tensor, float]:
        if id(batch) not in table:
            raise ValueError(f"{batch.where}: not one of the microbatches this spec was counted on")
        return table[id(batch)]

    return WeightingScheme(
        name,
        token_weights=lambda b: entry(b)[0],
        denominator=lambda b: entry(b)[1],
        fixed_denominator=plan.fixed,
    )


def accumulate_spec_precount(
    model: nn.Module,
    microbatches: Sequence[TokenBatch],
    spec: str | Mapping[str, Any] | SchemeSpec,
    *,
    vocab_size: int,
    reduce_factor: float,
    group: dist.ProcessGroup | None = None,
    id_bounds: IdBounds | None = None,
    timeout_s: float = COUNT_TIMEOUT_S,
    per_token_losses: PerTokenLosses = bilinear_token_losses,
) -> SpecAccumulated:
    """precount for a spec: one count collective (pre-pass + shares of D), then backward.

    `per_token_losses` runs the model on a microbatch (default: the bilinear model)."""
    spec = get_spec(spec)
    precheck(microbatches, vocab_size, group, timeout_s)
    view = spec_view(spec, microbatches, group=group, id_bounds=id_bounds, timeout_s=timeout_s)
    local = view.local_prepass()
    world, rank = view.position.world_size, view.position.rank
    # Rank r's (share of D, valid tokens) in slot r, zeros elsewhere: the SUM adds only zeros
    # to each slot, so every rank receives every share bit for bit, as exact_carry does.
    slots = torch.zeros(world, 2, dtype=torch.float64)
    # (A Python float list written element by element: torch.tensor([...]) would be float32.)
    slots[rank, 0], slots[rank, 1] = view.update_share(), float(view.valid_tokens())
    payload = torch.cat([local, slots.flatten()])
    if _distributed():
        _bounded(payload, dist.ReduceOp.SUM, group, timeout_s, "count pre-pass")
    global_parts = view.split_prepass(payload[: local.numel()])
    per_rank = payload[local.numel() :].view(world, 2).tolist()
    plan = _plan(view, global_parts)
    scheme = _bound_scheme(spec.name, microbatches, plan)
    D = global_denominator(scheme, [share for share, _ in per_rank])
    start = starting_point(None, "precount", len(microbatches))
    # Scope update: s / D as accumulate_precount does; local scopes: the weights already hold
    # 1 / D_u and D is K. Either way in float64, whatever the params' dtype.
    done = backward_microbatches(
        model, microbatches, scheme, vocab_size, start,
        scale=over_or_zero(reduce_factor, D), per_token_losses=per_token_losses,
    )  # fmt: skip
    if _distributed():
        loss_sums = tuple(v for (v,) in all_ranks_values([done.local_loss_sum], group=group))
    else:
        loss_sums = (done.local_loss_sum,)
    return SpecAccumulated(
        spec=spec.name,
        scope=spec.scope,
        num_units=1 if spec.scope == "update" else int(D),
        unit_denominators=plan.unit_denominators or (D,),
        rank_loss_sums=loss_sums,
        rank_valid_tokens=tuple(int(n) for _, n in per_rank),
        objective=over_or_zero(math.fsum(loss_sums), D),
    )


def accumulate_spec_postnorm(
    model: nn.Module,
    microbatches: Sequence[TokenBatch],
    spec: str | Mapping[str, Any] | SchemeSpec,
    *,
    vocab_size: int,
    hook_state: PostnormState,
    id_bounds: IdBounds | None = None,
    timeout_s: float = COUNT_TIMEOUT_S,
    per_token_losses: PerTokenLosses = bilinear_token_losses,
) -> SpecAccumulated:
    """postnorm for a spec: the pre-pass (if any) first, then the hook carries D's shares.

    `model` is a DDP model with ``sum_and_carry_hook`` registered with `hook_state`.
    """
    spec = get_spec(spec)
    group = hook_state.process_group
    precheck(microbatches, vocab_size, group, timeout_s)
    view = spec_view(spec, microbatches, group=group, id_bounds=id_bounds, timeout_s=timeout_s)
    local = view.local_prepass()
    if local.numel() and _distributed():
        # a_t needs these counts before the first backward: a collective of its own.
        _bounded(local, dist.ReduceOp.SUM, group, timeout_s, "count pre-pass")
    plan = _plan(view, view.split_prepass(local))
    scheme = _bound_scheme(spec.name, microbatches, plan)
    start = starting_point(None, "postnorm", len(microbatches))
    backward_microbatches(
        model, microbatches, scheme, vocab_size, start,
        hook_state=hook_state, per_token_losses=per_token_losses,
    )  # fmt: skip
    per_rank = hook_state.take()
    D = global_denominator(scheme, [d for d, _, _ in per_rank])
    with torch.no_grad():
        grads = (p.grad for p in model.parameters() if p.requires_grad and p.grad is not None)
        divide_all_exactly(grads, D)
    loss_sums = tuple(loss for _, loss, _ in per_rank)
    return SpecAccumulated(
        spec=spec.name,
        scope=spec.scope,
        num_units=1 if spec.scope == "update" else int(D),
        unit_denominators=plan.unit_denominators or (D,),
        rank_loss_sums=loss_sums,
        rank_valid_tokens=tuple(int(n) for _, _, n in per_rank),
        objective=over_or_zero(math.fsum(loss_sums), D),
    )


def layout_weights(
    spec: str | Mapping[str, Any] | SchemeSpec,
    batch: Mapping[str, Any],
    world_size: int,
    accum_steps: int,
) -> torch.Tensor:
    """c_t = a_t / D_u / K of a global batch [N, T] under layout (R, M), in one process.

    Every rank's view is built here and the pre-pass sums their vectors by hand: the same
    numbers the ranks of a real launch compute (each microbatch's weights, over D or K), for
    tests and for looking at a spec without starting processes.
    """
    from torch_impl.batch import rank_microbatches

    spec = get_spec(spec)
    ranks = [rank_microbatches(batch, r, world_size, accum_steps) for r in range(world_size)]
    bounds = IdBounds.of([b for mbs in ranks for b in mbs])
    views = [
        SpecView(spec, mbs, Position(r, world_size, accum_steps), bounds)
        for r, mbs in enumerate(ranks)
    ]
    summed = torch.stack([v.local_prepass() for v in views]).sum(dim=0)
    plans = [_plan(v, v.split_prepass(summed)) for v in views]
    D = plans[0].fixed
    if D is None:
        D = math.fsum(v.update_share() for v in views)
    rows = [w for plan in plans for w in plan.weights]
    return torch.cat(rows) / D if D else torch.zeros_like(torch.cat(rows))
