r"""One optimizer update under data parallelism with accumulation: precount and postnorm.

One update sees R ranks x M microbatches. Every microbatch returns
:math:`(\sum_t a_t l_t,\ d)` (``torch_impl.schemes``) and the update must leave

.. math::

    g = \frac{1}{D} \sum_{r, m} \nabla \sum_{t \in (r, m)} a_t l_t, \qquad D = \sum_{r, m} d

in every rank's ``.grad``. The gradient all-reduce runs once, in the backward pass of the last
microbatch; the others run under ``no_sync()`` (DDP) or ``set_requires_gradient_sync(False)``
(FSDP2) and only accumulate locally. Two strategies get there:

precount
    D first: every rank sums its d over its M microbatches (labels only), one all-reduce makes
    D global, then each microbatch backpropagates :math:`(\sum_t a_t l_t)\, s / D`. The wrapper
    divides the summed gradient by its reduce factor f, so the result is
    :math:`\frac{s}{f D} \sum \nabla(\ldots)`: right exactly when s = f. DDP averages, so
    s = R; s comes from ``torch_impl.probe`` rather than being assumed.
postnorm
    Backpropagate the unnormalized sums; a comm hook sums the buckets (no division) and carries
    every rank's d in the same all-reduce (``torch_impl.comm_hooks``); divide by D afterwards.

Then clipping by the global norm of the fully accumulated, fully reduced gradient, never per
microbatch, the optimizer step and the update's record (``torch_impl.optimizer_step``).

Whatever the params' dtype (float64, float32, bf16), the numbers that make D never take it:
counts are ints, d, D and the loss sums float64 (``schemes.accumulation_dtype``), carried
exactly across ranks (float64 slots, or limbs in the bucket dtype), and the division by D is
done in float64 before the result is cast: precount's seed s / D, postnorm's G / D. Only the
gradients themselves, and what the optimizer does with them, live in the params' dtype.

An update can also stop inside its accumulation window (``accumulate_partial``) and continue
later, in fresh processes, from a ``PartialAccumulation`` plus the restored local ``.grad``
(``resume=``): the checkpoint resume of ``torch_impl.checkpoint``. Both paths run the same
microbatch loop in the same order, so a resumed update is the uninterrupted one, bit for bit.

Before anything else, every update runs a pre-check, and inside the loop every loss sum and
gradient is checked for NaN and inf (``torch_impl.guards``): bad input, ranks holding different
numbers of microbatches and the first non-finite value are each named where they are, on
every rank, instead of one rank stopping while the others wait in a collective for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

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
    non_finite_grad,
    params_hint,
    precheck,
    rank_of,
)
from torch_impl.guards import RankMismatchError as RankMismatchError
from torch_impl.partial import PartialAccumulation, ResumeMismatchError, Strategy, starting_point
from torch_impl.schemes import (
    PerTokenLosses,
    WeightingScheme,
    bilinear_token_losses,
    global_denominator,
    microbatch_loss,
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Accumulated:
    """The state after the backward passes of one update, before clipping."""

    rank_valid_tokens: tuple[int, ...]
    rank_loss_sums: tuple[float, ...]
    rank_denominators: tuple[float, ...]
    global_denominator: float


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


def _precount_counts(
    microbatches: Sequence[TokenBatch],
    scheme: WeightingScheme,
    start: PartialAccumulation,
    group: dist.ProcessGroup | None,
) -> tuple[PartialAccumulation, float]:
    """The count collective of precount: every rank's (sum of d, valid targets), and D.

    Labels only, never the model: d and the counts are float64 here and cross ranks in float64
    slots (``all_ranks_values``), whatever the params' dtype, so a bf16 or float32 model
    cannot round D (counts are exact to 2^53, weight sums to float64's rounding).
    """
    local_d = math.fsum(scheme.denominator(batch) for batch in microbatches)
    local_valid = sum(int(batch.valid.sum()) for batch in microbatches)
    counts = tuple(
        (float(d), float(n)) for d, n in all_ranks_values([local_d, local_valid], group=group)
    )
    if start.rank_counts and start.rank_counts != counts:
        raise ResumeMismatchError(
            f"rank {dist.get_rank(group)}: the interrupted update counted (d, valid tokens) "
            f"per rank {list(start.rank_counts)}, its batch now gives {list(counts)}: "
            "the resumed update does not see the batch it started on"
        )
    D = global_denominator(scheme, [d for d, _ in counts])
    return dataclasses.replace(start, rank_counts=counts), D


def backward_microbatches(
    model: nn.Module,
    microbatches: Sequence[TokenBatch],
    scheme: WeightingScheme,
    vocab_size: int,
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
    `per_token_losses` runs the model on a microbatch (``torch_impl.schemes.PerTokenLosses``).
    """
    # Python floats (float64) and ints: the running sums of d and of the loss never take the
    # params' dtype; postnorm's hook then carries them exactly in any bucket dtype.
    d, loss, valid = start.local_denominator, start.local_loss_sum, start.local_valid_tokens
    last = len(microbatches) - 1
    stop = len(microbatches) if stop is None else stop
    for step in range(start.microbatches_done, stop):
        where = f"rank {rank_of(microbatches, step)}, microbatch {step}"
        with sync_context(model, step == last):
            out = microbatch_loss(model, microbatches[step], scheme, vocab_size, per_token_losses)
            loss_value = float(out.weighted_sum.detach())
            if not math.isfinite(loss_value):
                # Before the backward and before postnorm's hook is armed: a NaN must not
                # reach the gradient, the carried d or another rank.
                raise NonFiniteError(
                    f"{where}: the loss sum (sum of a_t l_t) is {loss_value!r}; "
                    f"{params_hint(model)}"
                )
            d += out.denominator
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
    scheme: WeightingScheme,
    *,
    vocab_size: int,
    reduce_factor: float,
    group: dist.ProcessGroup | None = None,
    resume: PartialAccumulation | None = None,
    precheck_timeout_s: float = PRECHECK_TIMEOUT_S,
    per_token_losses: PerTokenLosses = bilinear_token_losses,
) -> Accumulated:
    """precount: all-reduce d first, then backpropagate (sum a_t l_t) * s / D, s = reduce_factor.

    With `resume`, the update continues where ``accumulate_partial`` stopped; the caller has
    restored that run's local ``.grad``. Bad input, unequal microbatch counts and a rank that
    does not arrive fail in the pre-check (module docstring); a NaN or inf loss sum or
    gradient raises NonFiniteError naming the rank and microbatch.
    """
    precheck(microbatches, vocab_size, group, precheck_timeout_s)
    start = starting_point(resume, "precount", len(microbatches))
    start, D = _precount_counts(microbatches, scheme, start, group)
    # s / D in float64, never in the params' dtype: D past 2^24 (or 256 in bf16) would round.
    scale = over_or_zero(reduce_factor, D)
    done = backward_microbatches(
        model, microbatches, scheme, vocab_size, start,
        scale=scale, per_token_losses=per_token_losses,
    )  # fmt: skip
    # Metrics only (the objective's value); a loop that does not log it can skip this.
    loss_sums = tuple(v for (v,) in all_ranks_values([done.local_loss_sum], group=group))
    return Accumulated(
        rank_valid_tokens=tuple(int(n) for _, n in done.rank_counts),
        rank_loss_sums=loss_sums,
        rank_denominators=tuple(d for d, _ in done.rank_counts),
        global_denominator=D,
    )


def accumulate_postnorm(
    model: nn.Module,
    microbatches: Sequence[TokenBatch],
    scheme: WeightingScheme,
    *,
    vocab_size: int,
    hook_state: PostnormState,
    resume: PartialAccumulation | None = None,
    precheck_timeout_s: float = PRECHECK_TIMEOUT_S,
    per_token_losses: PerTokenLosses = bilinear_token_losses,
) -> Accumulated:
    """postnorm: backpropagate sum a_t l_t; the hook sums and carries d; divide by D after.

    `model` must be a DDP model with ``sum_and_carry_hook`` registered with `hook_state`.
    With `resume`, the update continues where ``accumulate_partial`` stopped; the caller has
    restored that run's local ``.grad``, and the partial sums of d carry on from `resume`.
    The pre-check and the non-finite checks are precount's, over the hook's process group.
    """
    precheck(microbatches, vocab_size, hook_state.process_group, precheck_timeout_s)
    start = starting_point(resume, "postnorm", len(microbatches))
    backward_microbatches(
        model, microbatches, scheme, vocab_size, start,
        hook_state=hook_state, per_token_losses=per_token_losses,
    )  # fmt: skip
    per_rank = hook_state.take()
    denominators = tuple(d for d, _, _ in per_rank)
    D = global_denominator(scheme, list(denominators))
    with torch.no_grad():
        divide_all_exactly((p.grad for p in _parameters(model) if p.grad is not None), D)
    return Accumulated(
        rank_valid_tokens=tuple(int(n) for _, _, n in per_rank),
        rank_loss_sums=tuple(s for _, s, _ in per_rank),
        rank_denominators=denominators,
        global_denominator=D,
    )


def accumulate_partial(
    model: nn.Module,
    microbatches: Sequence[TokenBatch],
    scheme: WeightingScheme,
    *,
    strategy: Strategy,
    vocab_size: int,
    num_microbatches: int,
    reduce_factor: float | None = None,
    group: dist.ProcessGroup | None = None,
    resume: PartialAccumulation | None = None,
    precheck_timeout_s: float = PRECHECK_TIMEOUT_S,
) -> PartialAccumulation:
    """Run only the first `num_microbatches` (< M) of an update and stop, mid-window.

    Every one of them runs without gradient sync, so ``.grad`` holds this rank's local,
    unreduced accumulation and nothing has crossed ranks except the pre-check (every rank's M
    and validity) and precount's count collective.
    That, plus the returned sums, is what a mid-accumulation checkpoint saves; passing the
    result as ``resume=`` to ``accumulate_precount``/``accumulate_postnorm`` (after restoring
    ``.grad``) finishes the update.
    """
    if not 0 < num_microbatches < len(microbatches):
        raise ValueError(
            f"a partial update stops after 1 to {len(microbatches) - 1} of its "
            f"{len(microbatches)} microbatches, got {num_microbatches}"
        )
    precheck(microbatches, vocab_size, group, precheck_timeout_s)
    start = starting_point(resume, strategy, num_microbatches)
    scale = None
    if strategy == "precount":
        if reduce_factor is None:
            raise ValueError("precount needs its reduce_factor s for a partial update too")
        start, D = _precount_counts(microbatches, scheme, start, group)
        # As in accumulate_precount: s / D in float64, whatever the params' dtype.
        scale = over_or_zero(reduce_factor, D)
    elif strategy != "postnorm":
        raise ValueError(f"strategy must be 'precount' or 'postnorm', got {strategy!r}")
    return backward_microbatches(
        model, microbatches, scheme, vocab_size, start, stop=num_microbatches, scale=scale
    )
