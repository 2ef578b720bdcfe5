r"""One optimizer update of a scheme spec under data parallelism: precount and postnorm.

One update sees R ranks x M microbatches and a scheme spec (contract v2, docs/schemes-as-data.md;
``torch_impl.spec``): the update must leave in every rank's ``.grad`` the gradient of

.. math::

    L = \frac{1}{K} \sum_u \frac{\sum_{t \in u} a_t l_t}{D_u}

with one unit u of the spec's scope (the update: K = 1, D = D_u; each rank: K = R; each
microbatch: K = R M). ``torch_impl.spec_counts`` gives a_t and D_u. Counts of a group or
document at update scope are not known inside a rank, so before any backward a **count
pre-pass** sums every rank's per-id count vector (``SpecView.local_prepass``) in one
all-reduce; a_t is then local again. The plan of an update (``UpdatePlan``) is, per
microbatch, the weights to backpropagate and the share of D it carries.

The gradient all-reduce runs once, in the backward pass of the last microbatch; the others run
under ``no_sync()`` (DDP) or ``set_requires_gradient_sync(False)`` (FSDP2) and only accumulate
locally. Two strategies get there:

precount
    D first: the pre-pass vector and every rank's (share of D, valid tokens), each rank in its
    own float64 slot, travel in ONE all-reduce: D = fsum of the shares (exact, order-free), or
    D read off the summed counts when it is not additive. Each microbatch then backpropagates
    :math:`(\sum_t a_t l_t)\, s / D`. The wrapper divides the summed gradient by its reduce
    factor f, so the result is :math:`\frac{s}{f D} \sum \nabla(\ldots)`: right exactly when
    s = f. DDP averages, so s = R; s comes from ``torch_impl.probe`` rather than being assumed.
postnorm
    The pre-pass is reduced first (only when the spec needs one); the unnormalized sums are
    backpropagated, a comm hook sums the buckets (no division) and carries every rank's share
    of D in the same all-reduce (``torch_impl.comm_hooks``); divide by D afterwards.
scope rank or microbatch
    Each unit's D_u is local (after the pre-pass, when a_t needs update-scope counts): every
    microbatch backpropagates :math:`\sum a_t l_t / D_u` (0 when D_u = 0); precount scales it
    by s / K, postnorm divides the summed gradient by K.

Then clipping by the global norm of the fully accumulated, fully reduced gradient, never per
microbatch, the optimizer step and the update's record (``torch_impl.optimizer_step``).

Whatever the params' dtype (float64, float32, bf16), the numbers that make D never take it:
counts are ints, d, D and the loss sums float64 (``losses.accumulation_dtype``), carried
exactly across ranks (float64 slots, or limbs in the bucket dtype), and the division by D is
done in float64 before the result is cast: precount's seed s / D, postnorm's G / D. Only the
gradients themselves, and what the optimizer does with them, live in the params' dtype.

An update can also stop inside its accumulation window (``accumulate_partial``) and continue
later, in fresh processes, from a ``PartialAccumulation`` plus the restored local ``.grad``
(``resume=``): the checkpoint resume of ``torch_impl.checkpoint``. The plan is recomputed from
the labels (precount refuses a batch whose counts changed), and both paths run the same
microbatch loop in the same order, so a resumed update is the uninterrupted one, bit for bit.

Before anything else, every update runs a pre-check, and inside the loop every loss sum and
gradient is checked for NaN and inf (``torch_impl.guards``): bad input, ranks holding different
numbers of microbatches and the first non-finite value are each named where they are, on
every rank, instead of one rank stopping while the others wait in a collective for it. Every
collective wait of the counts is bounded (``COUNT_TIMEOUT_S``, like the pre-check).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from torch_impl.batch import TokenBatch
from torch_impl.comm_hooks import PostnormState
from torch_impl.division import divide_all_exactly
from torch_impl.exact_carry import all_ranks_values
from torch_impl.guards import (
    PRECHECK_TIMEOUT_S,
    NonFiniteError,
    bounded_all_reduce,
    non_finite_grad,
    params_hint,
    precheck,
    rank_of,
)
from torch_impl.guards import RankMismatchError as RankMismatchError
from torch_impl.losses import PerTokenLosses, bilinear_token_losses, validated_microbatch_loss
from torch_impl.partial import PartialAccumulation, ResumeMismatchError, Strategy, starting_point
from torch_impl.spec import SchemeSpec, get_spec
from torch_impl.spec_counts import IdBounds, Position, SpecView

#: How long a count collective waits for every rank (a rank that failed or hangs).
COUNT_TIMEOUT_S = PRECHECK_TIMEOUT_S

#: What names a scheme: a SchemeSpec, its JSON dict, or a catalogue name
#: (``token_mean``, ``constant:4096``, ... : ``torch_impl.spec.get_spec``).
SpecLike = str | Mapping[str, Any] | SchemeSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class Accumulated:
    """One update after its backward passes, before clipping, as seen from one rank."""

    spec: str
    scope: str
    #: K: units of the scope (1, R or R M).
    num_units: int
    #: D of this rank's units: scope update (D,), rank (D_r,), microbatch (D_r0, ..., D_rM-1).
    unit_denominators: tuple[float, ...]
    #: Valid targets of every rank over its M microbatches, [R].
    rank_valid_tokens: tuple[int, ...]
    #: Every rank's sum over its microbatches of a_t l_t (scope update) or a_t l_t / D_u, [R].
    rank_loss_sums: tuple[float, ...]
    #: Every rank's share of D (scope update, D additive over ranks); 0 otherwise, [R].
    rank_denominators: tuple[float, ...]
    #: What the summed gradient is divided by: D (scope update) or K (local scopes).
    global_denominator: float
    #: L = fsum(rank_loss_sums) / global_denominator; 0 when that is 0.
    objective: float


def sync_context(model: nn.Module, is_last: bool) -> contextlib.AbstractContextManager:
    """Accumulate locally unless this is the last microbatch (DDP and FSDP2 alike)."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(is_last)
        return contextlib.nullcontext()
    if is_last or not hasattr(model, "no_sync"):
        return contextlib.nullcontext()
    return model.no_sync()


def _parameters(model: nn.Module) -> Iterator[torch.Tensor]:
    return (p for p in model.parameters() if p.requires_grad)


def over_or_zero(numerator: float, denominator: float) -> float:
    """numerator / D in float64 (one rounding); 0 when D = 0.

    D = 0 only when no token of the update carries weight; then every a_t = 0, the objective
    is the empty sum and its gradient is zero: scale by 0, never divide 0/0.
    """
    return 0.0 if denominator == 0 else numerator / denominator


def _bounded(tensor: torch.Tensor, op: Any, group: Any, timeout_s: float, what: str) -> None:
    """all_reduce `tensor` in place, waiting at most `timeout_s` for every rank."""
    late = (
        f"not every rank reached the {what} within {timeout_s:g} s (a rank that failed, hangs, "
        "or runs another spec)"
    )
    bounded_all_reduce(tensor, op, group, timeout_s, late)


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
    id_groupings = {"group", "document", *({"row", "segment"} - set(view.local_groupings))}
    global_ids = {view.weight_group, view.den_group} & id_groupings
    if id_bounds is None and _distributed() and view.global_parts() and global_ids:
        bounds = torch.tensor(IdBounds.of(microbatches).as_list(), dtype=torch.int64)
        _bounded(bounds, dist.ReduceOp.MAX, group, timeout_s, "agreement on id bounds")
        view = SpecView(spec, microbatches, position, IdBounds(*map(int, bounds.tolist())))
    return view


@dataclass(frozen=True, slots=True)
class UpdatePlan:
    """Per microbatch: the weights to backpropagate and the share of D it carries; and the D
    to divide by when it is not the sum of the shares."""

    weights: list[torch.Tensor]
    shares: list[float]
    #: None: D is the fsum of every rank's shares. Otherwise D itself (or K).
    fixed: float | None
    unit_denominators: tuple[float, ...]

    def denominator(self, rank_shares: Sequence[float]) -> float:
        """D (or K) of the update from every rank's summed shares."""
        if self.fixed is not None:
            return self.fixed
        # math.fsum is order-independent, so every rank (and both strategies) get the same D.
        return math.fsum(rank_shares)


def plan_update(view: SpecView, global_parts: Mapping[str, torch.Tensor]) -> UpdatePlan:
    """a_t (scope update) or a_t / D_u (local scopes); D_u = 0 gives weights 0, never NaN."""
    spec, M = view.spec, len(view.microbatches)
    numerators = view.numerators(global_parts)
    steps = list(range(M))
    if spec.scope == "update":
        # The rank's additive share rides on its last microbatch: d is only ever summed.
        shares = [0.0] * M
        if view.additive():
            shares[-1] = view.update_share()
            return UpdatePlan(numerators, shares, None, ())
        D = view.unit_denominator(steps, "update", global_parts)
        return UpdatePlan(numerators, shares, D, (D,))
    units = [steps] if spec.scope == "rank" else [[s] for s in steps]
    K = view.position.world_size * (1 if spec.scope == "rank" else M)
    weights = list(numerators)
    denominators = []
    for unit in units:
        D_u = view.unit_denominator(unit, spec.scope, global_parts)
        denominators.append(D_u)
        for s in unit:
            weights[s] = numerators[s] / D_u if D_u else torch.zeros_like(numerators[s])
    return UpdatePlan(weights, [0.0] * M, float(K), tuple(denominators))


def _accumulated(
    spec: SchemeSpec,
    plan: UpdatePlan,
    D: float,
    rank_counts: Sequence[tuple[float, float]],
    loss_sums: Sequence[float],
) -> Accumulated:
    return Accumulated(
        spec=spec.name,
        scope=spec.scope,
        num_units=1 if spec.scope == "update" else int(D),
        unit_denominators=plan.unit_denominators or (D,),
        rank_valid_tokens=tuple(int(n) for _, n in rank_counts),
        rank_loss_sums=tuple(loss_sums),
        rank_denominators=tuple(d for d, _ in rank_counts),
        global_denominator=D,
        objective=over_or_zero(math.fsum(loss_sums), D),
    )


def _precount_plan(
    spec: SchemeSpec,
    microbatches: Sequence[TokenBatch],
    start: PartialAccumulation,
    *,
    group: dist.ProcessGroup | None,
    id_bounds: IdBounds | None,
    timeout_s: float,
) -> tuple[UpdatePlan, PartialAccumulation, float]:
    """The count collective of precount: the pre-pass and every rank's (share of D, valid
    targets) in one all-reduce; the plan and D.

    Labels only, never the model: shares and counts are float64 here and cross ranks in
    float64 slots, whatever the params' dtype, so a bf16 or float32 model cannot round D
    (counts are exact to 2^53, weight sums to float64's rounding). A resumed update refuses a
    batch whose counts differ from the interrupted one's.
    """
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
    shares = payload[local.numel() :].view(world, 2).tolist()
    counts = tuple((float(d), float(n)) for d, n in shares)
    if start.rank_counts and start.rank_counts != counts:
        raise ResumeMismatchError(
            f"rank {rank}: the interrupted update counted (d, valid tokens) per rank "
            f"{list(start.rank_counts)}, its batch now gives {list(counts)}: "
            "the resumed update does not see the batch it started on"
        )
    plan = plan_update(view, view.split_prepass(payload[: local.numel()]))
    D = plan.denominator([d for d, _ in counts])
    return plan, dataclasses.replace(start, rank_counts=counts), D


def count_update(
    spec: SpecLike,
    microbatches: Sequence[TokenBatch],
    *,
    group: dist.ProcessGroup | None = None,
    timeout_s: float = PRECHECK_TIMEOUT_S,
) -> tuple[UpdatePlan, float]:
    """The labels-only part of an update: precount's count collective over `group`, giving
    every microbatch's a_t (a_t / D_u for a local scope) and D (K for a local scope), the
    same on every rank of the group. A loop that runs the backward its own way (a pipeline
    stage, `torch_impl.pipeline`) scales by 1 / D itself."""
    spec = get_spec(spec)
    start = starting_point(None, "precount", len(microbatches))
    plan, _, D = _precount_plan(
        spec, microbatches, start, group=group, id_bounds=None, timeout_s=timeout_s
    )
    return plan, D


def _postnorm_plan(
    spec: SchemeSpec,
    microbatches: Sequence[TokenBatch],
    *,
    group: dist.ProcessGroup | None,
    id_bounds: IdBounds | None,
    timeout_s: float,
) -> UpdatePlan:
    """postnorm's plan: the pre-pass, when a_t needs update-scope counts, in a collective of
    its own before the first backward; the shares of D ride in the hook's all-reduce."""
    view = spec_view(spec, microbatches, group=group, id_bounds=id_bounds, timeout_s=timeout_s)
    local = view.local_prepass()
    if local.numel() and _distributed():
        _bounded(local, dist.ReduceOp.SUM, group, timeout_s, "count pre-pass")
    return plan_update(view, view.split_prepass(local))


def backward_microbatches(
    model: nn.Module,
    microbatches: Sequence[TokenBatch],
    plan: UpdatePlan,
    start: PartialAccumulation,
    *,
    stop: int | None = None,
    scale: float | None = None,
    hook_state: PostnormState | None = None,
    per_token_losses: PerTokenLosses = bilinear_token_losses,
) -> PartialAccumulation:
    """Forward and backward microbatches [start.microbatches_done, stop) and add their sums
    (`stop` None: through the update's last microbatch).

    Only microbatch M - 1, the update's last, synchronizes gradients. `scale` multiplies each
    weighted sum (precount's s / D; None: unnormalized, postnorm). For postnorm the hook is
    armed with this rank's totals over all M microbatches just before that last backward.
    `per_token_losses` runs the model on a microbatch (``torch_impl.losses.PerTokenLosses``).
    Every microbatch was validated by the caller's pre-check (`precheck`, which each
    ``accumulate_*`` runs first), so none is validated again here.
    """
    # Python floats (float64) and ints: the running sums of d and of the loss never take the
    # params' dtype; postnorm's hook then carries them exactly in any bucket dtype.
    d, loss, valid = start.local_denominator, start.local_loss_sum, start.local_valid_tokens
    last = len(microbatches) - 1
    stop = len(microbatches) if stop is None else stop
    for step in range(start.microbatches_done, stop):
        where = f"rank {rank_of(microbatches, step)}, microbatch {step}"
        with sync_context(model, step == last):
            out = validated_microbatch_loss(
                model, microbatches[step], plan.weights[step], per_token_losses
            )
            loss_value = float(out.weighted_sum.detach())
            if not math.isfinite(loss_value):
                # Before the backward and before postnorm's hook is armed: a NaN must not
                # reach the gradient, the carried d or another rank.
                raise NonFiniteError(
                    f"{where}: the loss sum (sum of a_t l_t) is {loss_value!r}; "
                    f"{params_hint(model)}"
                )
            d += plan.shares[step]
            loss += loss_value
            valid += out.valid_tokens
            if hook_state is not None and step == last:
                # Known before the last backward: the hook reads them while reducing.
                hook_state.arm(d, loss, valid)
            # weighted_sum is float64 (accumulation_dtype) and so is scale = s / D: the product
            # is rounded to the params' dtype once, token by token, in the backward pass.
            (out.weighted_sum if scale is None else out.weighted_sum * scale).backward()
        bad = non_finite_grad(model)
        if bad is not None:
            if step == last:
                # This backward all-reduced the gradient: the NaN may be another rank's.
                origin = (
                    "which all-reduced it across ranks; this rank's loss sums and its "
                    "gradient before this microbatch were finite, so the NaN or inf came from "
                    "this microbatch's backward here or on another rank"
                )
            else:
                origin = f"local, not yet reduced, though its loss sum {loss_value!r} is finite"
            raise NonFiniteError(
                f"{where}: the gradient of {bad} holds NaN or inf after this microbatch's "
                f"backward ({origin}); {params_hint(model)}"
            )
    return dataclasses.replace(
        start,
        microbatches_done=stop,
        local_denominator=d,
        local_loss_sum=loss,
        local_valid_tokens=valid,
    )


def accumulate_precount(
    model: nn.Module,
    microbatches: Sequence[TokenBatch],
    spec: SpecLike,
    *,
    vocab_size: int,
    reduce_factor: float,
    group: dist.ProcessGroup | None = None,
    resume: PartialAccumulation | None = None,
    id_bounds: IdBounds | None = None,
    precheck_timeout_s: float = PRECHECK_TIMEOUT_S,
    per_token_losses: PerTokenLosses = bilinear_token_losses,
) -> Accumulated:
    """precount: the counts first (one collective), then backpropagate (sum a_t l_t) * s / D,
    s = reduce_factor.

    Scope update: s / D as the module docstring says; local scopes: the weights already hold
    1 / D_u and D is K. Either way in float64, whatever the params' dtype. With `resume`, the
    update continues where ``accumulate_partial`` stopped; the caller has restored that run's
    local ``.grad``. Bad input, unequal microbatch counts and a rank that does not arrive fail
    in the pre-check (module docstring); a NaN or inf loss sum or gradient raises
    NonFiniteError naming the rank and microbatch. `id_bounds`: the pre-pass vectors' lengths
    when the caller knows the global batch (else the ranks agree on them in a collective).
    `per_token_losses` runs the model on a microbatch (default: the bilinear model).
    """
    spec = get_spec(spec)
    precheck(microbatches, vocab_size, group, precheck_timeout_s)
    start = starting_point(resume, "precount", len(microbatches))
    plan, start, D = _precount_plan(
        spec, microbatches, start, group=group, id_bounds=id_bounds, timeout_s=precheck_timeout_s
    )
    done = backward_microbatches(
        model, microbatches, plan, start,
        scale=over_or_zero(reduce_factor, D), per_token_losses=per_token_losses,
    )  # fmt: skip
    # Metrics only (the objective's value); a loop that does not log it can skip this.
    if _distributed():
        loss_sums = [v for (v,) in all_ranks_values([done.local_loss_sum], group=group)]
    else:
        loss_sums = [done.local_loss_sum]
    return _accumulated(spec, plan, D, done.rank_counts, loss_sums)


def accumulate_postnorm(
    model: nn.Module,
    microbatches: Sequence[TokenBatch],
    spec: SpecLike,
    *,
    vocab_size: int,
    hook_state: PostnormState,
    resume: PartialAccumulation | None = None,
    id_bounds: IdBounds | None = None,
    precheck_timeout_s: float = PRECHECK_TIMEOUT_S,
    per_token_losses: PerTokenLosses = bilinear_token_losses,
) -> Accumulated:
    """postnorm: backpropagate sum a_t l_t; the hook sums and carries d; divide by D after.

    `model` must be a DDP model with ``sum_and_carry_hook`` registered with `hook_state`.
    With `resume`, the update continues where ``accumulate_partial`` stopped; the caller has
    restored that run's local ``.grad``, and the partial sums of d carry on from `resume`.
    The pre-check and the non-finite checks are precount's, over the hook's process group.
    """
    spec = get_spec(spec)
    group = hook_state.process_group
    precheck(microbatches, vocab_size, group, precheck_timeout_s)
    start = starting_point(resume, "postnorm", len(microbatches))
    plan = _postnorm_plan(
        spec, microbatches, group=group, id_bounds=id_bounds, timeout_s=precheck_timeout_s
    )
    backward_microbatches(
        model, microbatches, plan, start,
        hook_state=hook_state, per_token_losses=per_token_losses,
    )  # fmt: skip
    per_rank = hook_state.take()
    D = plan.denominator([d for d, _, _ in per_rank])
    with torch.no_grad():
        divide_all_exactly((p.grad for p in _parameters(model) if p.grad is not None), D)
    counts = [(d, n) for d, _, n in per_rank]
    return _accumulated(spec, plan, D, counts, [loss for _, loss, _ in per_rank])


def accumulate_partial(
    model: nn.Module,
    microbatches: Sequence[TokenBatch],
    spec: SpecLike,
    *,
    strategy: Strategy,
    vocab_size: int,
    num_microbatches: int,
    reduce_factor: float | None = None,
    group: dist.ProcessGroup | None = None,
    resume: PartialAccumulation | None = None,
    id_bounds: IdBounds | None = None,
    precheck_timeout_s: float = PRECHECK_TIMEOUT_S,
) -> PartialAccumulation:
    """Run only the first `num_microbatches` (< M) of an update and stop, mid-window.

    Every one of them runs without gradient sync, so ``.grad`` holds this rank's local,
    unreduced accumulation and nothing has crossed ranks except the pre-check (every rank's M
    and validity) and the count collectives (precount's, and a spec's pre-pass).
    That, plus the returned sums, is what a mid-accumulation checkpoint saves; passing the
    result as ``resume=`` to ``accumulate_precount``/``accumulate_postnorm`` (after restoring
    ``.grad``) finishes the update.
    """
    if not 0 < num_microbatches < len(microbatches):
        raise ValueError(
            f"a partial update stops after 1 to {len(microbatches) - 1} of its "
            f"{len(microbatches)} microbatches, got {num_microbatches}"
        )
    spec = get_spec(spec)
    precheck(microbatches, vocab_size, group, precheck_timeout_s)
    start = starting_point(resume, strategy, num_microbatches)
    common = dict(group=group, id_bounds=id_bounds, timeout_s=precheck_timeout_s)
    scale = None
    if strategy == "precount":
        if reduce_factor is None:
            raise ValueError("precount needs its reduce_factor s for a partial update too")
        plan, start, D = _precount_plan(spec, microbatches, start, **common)
        # As in accumulate_precount: s / D in float64, whatever the params' dtype.
        scale = over_or_zero(reduce_factor, D)
    elif strategy == "postnorm":
        plan = _postnorm_plan(spec, microbatches, **common)
    else:
        raise ValueError(f"strategy must be 'precount' or 'postnorm', got {strategy!r}")
    return backward_microbatches(
        model, microbatches, plan, start, stop=num_microbatches, scale=scale
    )


def layout_plans(
    spec: SpecLike,
    batch: Mapping[str, Any],
    world_size: int,
    accum_steps: int,
    context_size: int = 1,
    context_order: str = "contiguous",
) -> list[tuple[list[TokenBatch], SpecView, UpdatePlan]]:
    """Every process's microbatches, view and plan of a global batch [N, T] under layout
    (R, M), every row's positions over `context_size` context ranks, in one process.

    Every process's view is built here and the pre-pass sums their vectors by hand: the same
    numbers the processes of a real launch compute, for tests and for looking at a spec
    without starting processes.
    """
    from torch_impl.batch import context_microbatches

    spec = get_spec(spec)
    processes = world_size * context_size
    ranks = [
        context_microbatches(batch, p, world_size, context_size, accum_steps, context_order)
        for p in range(processes)
    ]
    bounds = IdBounds.of([b for mbs in ranks for b in mbs])
    views = [
        SpecView(spec, mbs, Position(p, processes, accum_steps), bounds)
        for p, mbs in enumerate(ranks)
    ]
    summed = torch.stack([v.local_prepass() for v in views]).sum(dim=0)
    return [
        (mbs, view, plan_update(view, view.split_prepass(summed)))
        for mbs, view in zip(ranks, views, strict=True)
    ]


def layout_weights(
    spec: SpecLike,
    batch: Mapping[str, Any],
    world_size: int,
    accum_steps: int,
    context_size: int = 1,
    context_order: str = "contiguous",
) -> torch.Tensor:
    """c_t = a_t / D_u / K of a global batch [N, T] under layout (R, M, C), in one process:
    each microbatch's weights of ``layout_plans``, over D or K, put back at their rows and
    positions."""
    from torch_impl.batch import context_positions

    plans = layout_plans(spec, batch, world_size, accum_steps, context_size, context_order)
    D = plans[0][2].denominator([view.update_share() for _, view, _ in plans])
    shape = tuple(np.shape(batch["targets"]))
    positions = context_positions(shape[1], context_size, context_order)
    weights = torch.zeros(shape, dtype=torch.float64)
    for mbs, _, plan in plans:
        for mb, w in zip(mbs, plan.weights, strict=True):
            rows = slice(mb.first_row, mb.first_row + w.shape[0])
            weights[rows, positions[mb.context_rank]] = w
    return weights / D if D else torch.zeros_like(weights)
