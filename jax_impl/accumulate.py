r"""One rank's share of an update under a scheme spec: plan, accumulate over M microbatches,
reduce across ranks.

Runs inside a named axis (``jax.pmap(axis_name=...)`` or ``jax.shard_map`` over a mesh axis);
the front-ends differ only in how they map this function over devices. With K units of the
spec's scope U (1, R or R M) and D_u from `jax_impl.spec_counts`,

.. math::

    L = \frac{1}{K} \sum_u \frac{\sum_{t \in u} a_t l_t}{D_u},

a unit with D_u = 0 contributing 0 (its scale is 0, not 1/0). An update is three steps:
`rank_plan` reads the labels only (a_t, D's parts, the count pre-pass, and for each
microbatch the factor its loss sum is multiplied by before its backward), `continue_accumulation`
runs the microbatches, and `finish_rank` reduces across ranks and normalizes. The resumable
loop (`jax_impl.resume`) runs the same three steps with the accumulation split at a
checkpoint. For U = update, with R ranks and M microbatches per rank:

precount
    :math:`D = \operatorname{psum}_r \sum_m d_{rm}` first (labels only, one collective), then
    each microbatch backpropagates :math:`(\sum_t a_t l_t)\, s / D` and the accumulated
    gradient goes through the gradient collective. With :math:`s` the reduction factor,

    .. math::

        \operatorname{psum}_r \sum_m \nabla \frac{\sum a l}{D}\Big|_{s=1}
        = \operatorname{pmean}_r \sum_m \nabla \frac{R \sum a l}{D}\Big|_{s=R}
        = \nabla L,

    so s = 1 under psum and s = R under pmean (DDP's and FSDP's default average; forgetting it
    is transformers#37474, applying it twice liquid-finetune#38).
postnorm
    each microbatch backpropagates the unnormalized :math:`\sum_t a_t l_t`; after the loop one
    psum carries the gradient sums, the loss sums and both d channels, and the gradient is
    divided by D afterwards. No s: a sum is reduced and a sum is wanted.

For U = rank or microbatch the normalization is local (what rank_mean and microbatch_mean are):
precount scales microbatch m by s / (K D_{u(m)}) before its backward; postnorm divides a
rank's sum by its D_r, or each microbatch's by its D_rm, then one psum and the division by K.

Dtypes (the rule of `jax_impl.denominators`): the count channel is int32 through both
collectives and converted once, in `unit_denominator`; the weight-sum
channel is an `ExactSum` pair in the denominator dtype (float64 under x64, else float32),
summed over microbatches with two-sum and over ranks through one slot per rank, so the psum
adds only zeros to it. D, s / D, the loss sums and the division g / D are in that dtype;
only the gradient itself is in the params' dtype (bfloat16 included), cast there once after
the division.

Accumulation is a ``lax.scan`` over the M microbatches rather than a Python loop over a jitted
micro-step: the whole update is one program, so the d collective runs once before and the
gradient collective once after all M microbatches (a Python loop would have to split the step
into separately compiled micro-steps and a reduce step and keep accumulators on the host side
of that boundary), the program size and compile time do not grow with M, and the same code
runs unchanged under pmap, shard_map and multi-process. Only one microbatch's activations are
live at a time, which is the point of accumulating.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_impl.batch import IGNORE_INDEX, Batch
from jax_impl.denominators import (
    ExactSum,
    denominator_dtype,
    divide_by_denominator,
    exact_sum,
    rank_slots,
    safe_denominator,
)
from jax_impl.losses import TokenLossesFn, weighted_loss_sum
from jax_impl.model import Params
from jax_impl.spec import SchemeSpec
from jax_impl.spec_counts import DenominatorParts, SpecTerms, rank_spec_terms


class Strategy(enum.Enum):
    """When the denominator D is applied."""

    PRECOUNT = "precount"
    """D reduced from the labels first; every microbatch backpropagates (sum a l) s / D."""
    POSTNORM = "postnorm"
    """Unnormalized sums backpropagated; gradients and d reduced together, then divided."""


class Collective(enum.Enum):
    """How the gradient is reduced across ranks in the precount strategy."""

    PSUM = "psum"
    """All-reduce sum: reduction factor s = 1."""
    PMEAN = "pmean"
    """All-reduce mean (DDP's default): reduction factor s = R."""


class RankGradients(NamedTuple):
    """The fully reduced gradient and what went into it, as seen on one rank.

    For U = update the denominator is D and the loss sum is this rank's sum of a_t l_t; for
    U = rank or microbatch they are K and the rank's sum over its units of (sum a l) / D_u,
    so that loss = psum(loss sums) / denominator either way."""

    grads: Params  # identical on every rank after the collective
    local_valid_tokens: jax.Array  # int32, valid targets of this rank over its M microbatches
    local_loss_sum: jax.Array  # this rank's loss sum (see above; denominator dtype)
    global_denominator: jax.Array  # D, or K (denominator dtype)
    loss: jax.Array  # the objective L


#: The mapped axis a rank's collectives name: the data-parallel axis, or (data axis, context
#: axis) under context parallel (`jax_impl.context_parallel`), where a "rank" is a process.
AxisName = str | tuple[str, ...]

#: The signature every per-rank gradient function has (intended, or a reproduced bug):
#: (params, rank_batch [M, B, T], axis name) -> gradients.
RankGradientsFn = Callable[[Params, Batch, str], RankGradients]


def reduce_factor(collective: Collective, world_size: int) -> int:
    """s: R when the gradient collective averages, 1 when it sums."""
    return world_size if collective is Collective.PMEAN else 1


def unit_count(spec: SchemeSpec, world_size: int, accum_steps: int) -> int:
    """K: the number of units of the spec's scope in one update."""
    return {"update": 1, "rank": world_size, "microbatch": world_size * accum_steps}[spec.scope]


def unit_denominator(
    spec: SchemeSpec, count: jax.Array, weight: ExactSum, parts: DenominatorParts
) -> jax.Array:
    """D of a unit from its summed channels: the int32 count converted once, the weight pair
    rounded once, the derived parts added; or the configured value, or 1.

    One channel is zero for every spec but those that add a derived part, so the sum of the
    channels adds no rounding: a count stays exact up to 2^31 - 1 (past that the int32 sum
    wraps; see `jax_impl.denominators`)."""
    dtype = denominator_dtype()
    kind = spec.denominator.kind
    if kind == "configured":
        return jnp.zeros_like(weight.hi) + jnp.asarray(spec.denominator.value, dtype)
    if kind == "one":
        return jnp.ones_like(weight.hi)
    if parts.derived_count is not None:
        count = count + parts.derived_count
    D = count.astype(dtype) + weight.value()
    return D if parts.derived_float is None else D + parts.derived_float


def update_channels(parts: DenominatorParts, axis_name: AxisName) -> tuple[jax.Array, ExactSum]:
    """This rank's additive channels for a psum over ranks: the int32 count (the M
    microbatches' and the rank-level one) and the weight pair in this rank's slot."""
    count = jnp.sum(parts.mb_count, dtype=jnp.int32) + parts.rank_count
    return count, rank_slots(exact_sum(parts.mb_weight), axis_name)


def local_denominators(spec: SchemeSpec, parts: DenominatorParts) -> jax.Array:
    """D_u for U = rank (a scalar) or microbatch ([M]), from local parts only."""
    if spec.scope == "rank":
        count = jnp.sum(parts.mb_count, dtype=jnp.int32) + parts.rank_count
        return unit_denominator(spec, count, exact_sum(parts.mb_weight), parts)
    return unit_denominator(spec, parts.mb_count, parts.mb_weight, parts)


def unit_scale(D: jax.Array, numerator: float | jax.Array, units: int) -> jax.Array:
    """numerator / (K D) where D > 0, else 0: a unit without denominator adds nothing."""
    dtype = denominator_dtype()
    safe = safe_denominator(D)
    denominator = safe if units == 1 else jnp.asarray(units, dtype) * safe
    return jnp.where(D > 0, jnp.asarray(numerator, dtype) / denominator, 0)


class RankPlan(NamedTuple):
    """What one rank knows of its update from the labels alone, before any forward pass.

    `grad_scale` [M] multiplies microbatch m's sum of a_t l_t before its backward;
    `loss_scale` [M] multiplies it where the rank's loss sum is accumulated. `denominator`
    is D (U = update, precount; zeros until `finish_rank` for postnorm) or D_u per
    microbatch ([M], U = rank or microbatch)."""

    token_weights: jax.Array  # [M, B, T] a_t, denominator dtype
    grad_scale: jax.Array  # [M], denominator dtype
    loss_scale: jax.Array  # [M], denominator dtype
    parts: DenominatorParts
    denominator: jax.Array


def spec_terms_once(
    wanted: Sequence[tuple[SchemeSpec, Strategy]], rank_batch: Batch, axis_name: AxisName
) -> dict[SchemeSpec, tuple[SpecTerms, object]]:
    """`rank_spec_terms` of each distinct spec among `wanted` (a sweep's (spec, strategy)
    pairs), once: a spec's a_t and D's parts come from the labels alone, whatever the strategy,
    so the configs of one spec (precount and postnorm) share one count pre-pass in the traced
    program instead of each tracing its own. The psum carries precount's denominator
    channels when any of the spec's configs is precount with U = update (postnorm's plan
    leaves them unread)."""
    out: dict[SchemeSpec, tuple[SpecTerms, object]] = {}
    for spec, _ in wanted:
        if spec in out:
            continue
        joined = spec.scope == "update" and any(
            other == spec and strategy is Strategy.PRECOUNT for other, strategy in wanted
        )
        join = functools.partial(update_channels, axis_name=axis_name) if joined else None
        out[spec] = rank_spec_terms(spec, rank_batch, axis_name, join)
    return out


def rank_plan(
    spec: SchemeSpec,
    rank_batch: Batch,
    axis_name: AxisName,
    strategy: Strategy = Strategy.PRECOUNT,
    collective: Collective = Collective.PSUM,
    scale_override: float | None = None,
    terms: tuple[SpecTerms, object] | None = None,
) -> RankPlan:
    """The labels-only part of one rank's update; call inside `axis_name`'s mapping.

    precount with U = update runs the count pre-pass and D's channels in one psum (the one
    collective before the backward); `scale_override` replaces s (precount only) to
    reproduce a mis-scaled step: s = 1 with pmean is the missing-world-size bug, s = R with
    psum a doubled world size. `terms`: the spec's `rank_spec_terms` already computed for
    this rank (`spec_terms_once`), with the denominator channels where precount needs them."""
    if strategy is Strategy.POSTNORM and (
        collective is not Collective.PSUM or scale_override is not None
    ):
        raise ValueError(
            "postnorm reduces sums and divides by D afterwards: it takes collective=psum "
            f"and no scale override, got collective={collective.value}, "
            f"scale_override={scale_override}"
        )
    world_size = jax.lax.axis_size(axis_name)
    M = rank_batch.targets.shape[0]
    K = unit_count(spec, world_size, M)
    dtype = denominator_dtype()
    s = reduce_factor(collective, world_size) if scale_override is None else scale_override
    precount = strategy is Strategy.PRECOUNT
    join = (
        functools.partial(update_channels, axis_name=axis_name)
        if precount and spec.scope == "update"
        else None
    )
    if terms is None:
        terms = rank_spec_terms(spec, rank_batch, axis_name, join)
    (a, parts), reduced = terms
    # Built from the data: under shard_map they vary across ranks, as the scan's inputs must.
    ones = jnp.ones_like(a, shape=(M,), dtype=dtype)
    if spec.scope == "update":
        if precount:
            total_count, slots = reduced
            D = unit_denominator(spec, total_count, exact_sum(slots), parts)
            grad_scale = ones * unit_scale(D, s, 1)
        else:
            D, grad_scale = jnp.zeros_like(ones, shape=()), ones
        return RankPlan(a, grad_scale, ones, parts, D)
    D_units = jnp.broadcast_to(local_denominators(spec, parts), (M,))
    inverse_D = unit_scale(D_units, 1, 1)
    if precount:
        grad_scale, loss_scale = unit_scale(D_units, s, K), inverse_D
    elif spec.scope == "rank":
        # The rank's unnormalized sum, divided by its own D_r in `finish_rank`.
        grad_scale, loss_scale = ones, ones
    else:
        # A microbatch's own D_rm is applied where its sum is formed.
        grad_scale, loss_scale = inverse_D, inverse_D
    return RankPlan(a, grad_scale, loss_scale, parts, D_units)


def continue_accumulation(
    params: Params,
    rank_batch: Batch,
    plan: RankPlan,
    sums: tuple[Params, jax.Array],
    token_losses_fn: TokenLossesFn | None = None,
) -> tuple[Params, jax.Array]:
    """`sums` = (gradient sum, loss sum) continued over the microbatches of `rank_batch`.

    Adds grad((sum_t a_t l_t) * grad_scale_m) and (sum_t a_t l_t) * loss_scale_m of each
    microbatch in turn (`plan` holds the rows of these microbatches), a ``lax.scan`` whose
    carry starts at `sums`: from zeros for a whole update (`accumulate_microbatches`), from a
    checkpoint's partial sums for the rest of a window that was stopped part-way
    (`jax_impl.resume`), with the additions in the same order either way. No collective.
    `token_losses_fn`: the model's l_t (None: the bilinear model).
    """

    def scaled_loss(p: Params, inputs, targets, a, segment_ids, grad_scale, loss_scale):
        loss_sum = weighted_loss_sum(p, inputs, targets, a, segment_ids, token_losses_fn)
        return loss_sum * grad_scale, loss_sum * loss_scale

    grad_fn = jax.grad(scaled_loss, has_aux=True)

    def micro_step(carry, xs):
        grads_acc, loss_acc = carry
        grads, loss_sum = grad_fn(params, *xs)
        grads_acc = jax.tree.map(jnp.add, grads_acc, grads)
        return (grads_acc, loss_acc + loss_sum), None

    xs = (
        rank_batch.inputs, rank_batch.targets, plan.token_weights, rank_batch.segment_ids,
        plan.grad_scale, plan.loss_scale,
    )  # fmt: skip
    (grads, loss_sum), _ = jax.lax.scan(micro_step, sums, xs)
    return grads, loss_sum


def zero_sums(params: Params, like: jax.Array) -> tuple[Params, jax.Array]:
    """Empty (gradient sum, loss sum): gradients in the params' dtype, the loss sum in the
    denominator dtype. Zeros built from the data (`like`): under shard_map they then carry
    the data's varying-manual-axes type, as the scan carry must (the gradient of a rank's own
    microbatch varies across ranks), without this code having to name the axis."""
    zeros = jax.tree.map(lambda p: jnp.zeros_like(like, shape=p.shape, dtype=p.dtype), params)
    return zeros, jnp.zeros_like(like, shape=(), dtype=denominator_dtype())


def finish_rank(
    spec: SchemeSpec,
    plan: RankPlan,
    sums: tuple[Params, jax.Array],
    rank_batch: Batch,
    axis_name: AxisName,
    strategy: Strategy = Strategy.PRECOUNT,
    collective: Collective = Collective.PSUM,
) -> RankGradients:
    """The collective and the normalization of a completed accumulation, on one rank."""
    grads, local_loss = sums
    dtype = denominator_dtype()
    local_valid = jnp.sum(rank_batch.targets != IGNORE_INDEX, dtype=jnp.int32)
    reduce_grads = jax.lax.pmean if collective is Collective.PMEAN else jax.lax.psum
    if spec.scope == "update":
        if strategy is Strategy.PRECOUNT:
            D = plan.denominator
            grads = reduce_grads(grads, axis_name)
            total_loss = jax.lax.psum(local_loss, axis_name)
        else:
            # One psum: gradient sums (params' dtype), loss sums and D's channels together.
            # D never travels in the gradients' dtype; g / D is formed in the denominator
            # dtype and rounded once into the params' dtype.
            count, slots = update_channels(plan.parts, axis_name)
            grads, total_loss, total_count, slots = jax.lax.psum(
                (grads, local_loss, count, slots), axis_name
            )
            D = unit_denominator(spec, total_count, exact_sum(slots), plan.parts)
            grads = divide_by_denominator(grads, safe_denominator(D))
            grads = jax.tree.map(lambda g: jnp.where(D > 0, g, jnp.zeros_like(g)), grads)
        loss = jnp.where(D > 0, total_loss / safe_denominator(D), 0)
        return RankGradients(grads, local_valid, local_loss, D, loss)

    world_size = jax.lax.axis_size(axis_name)
    K = jnp.asarray(unit_count(spec, world_size, rank_batch.targets.shape[0]), dtype)
    if strategy is Strategy.PRECOUNT:
        grads = reduce_grads(grads, axis_name)
    else:
        if spec.scope == "rank":
            D_r = plan.denominator[0]
            grads = divide_by_denominator(grads, safe_denominator(D_r))
            grads = jax.tree.map(lambda g: jnp.where(D_r > 0, g, jnp.zeros_like(g)), grads)
            local_loss = local_loss * unit_scale(D_r, 1, 1)
        grads = divide_by_denominator(jax.lax.psum(grads, axis_name), K)
    # local_loss: the rank's sum over its units of (sum a l) / D_u.
    total = jax.lax.psum(local_loss, axis_name)
    return RankGradients(grads, local_valid, local_loss, K, total / K)


def rank_gradients(
    params: Params,
    rank_batch: Batch,
    axis_name: AxisName,
    *,
    spec: SchemeSpec,
    strategy: Strategy = Strategy.PRECOUNT,
    collective: Collective = Collective.PSUM,
    scale_override: float | None = None,
    token_losses_fn: TokenLossesFn | None = None,
) -> RankGradients:
    """The reduced gradient of `spec`'s objective; call inside `axis_name`'s mapping.

    `rank_plan`, the accumulation over the M microbatches from zeros, `finish_rank`.
    `token_losses_fn` is the model's l_t (None: the bilinear model).
    """
    plan = rank_plan(spec, rank_batch, axis_name, strategy, collective, scale_override)
    sums = accumulate_microbatches(
        params, rank_batch, plan.token_weights, plan.grad_scale, plan.loss_scale,
        token_losses_fn=token_losses_fn,
    )  # fmt: skip
    return finish_rank(spec, plan, sums, rank_batch, axis_name, strategy, collective)


@functools.partial(jax.jit, static_argnames=("token_losses_fn",))
def accumulate_microbatches(
    params: Params,
    rank_batch: Batch,
    token_weights: jax.Array,
    grad_scale: jax.Array,
    loss_scale: jax.Array,
    token_losses_fn: TokenLossesFn | None = None,
) -> tuple[Params, jax.Array]:
    """`continue_accumulation` over all M microbatches from zero sums.

    jit-wrapped so that its trace is cached per shape: every config of a sweep, whatever its
    spec, runs the same accumulation on its own plan's arrays (inside another jit, pmap or
    shard_map it is inlined, not a separate program)."""
    plan = RankPlan(token_weights, grad_scale, loss_scale, None, None)  # type: ignore[arg-type]
    return continue_accumulation(
        params, rank_batch, plan, zero_sums(params, token_weights), token_losses_fn
    )


@functools.partial(jax.jit, static_argnames=("spec",))
def microbatch_finiteness(
    params: Params, batch: Batch, spec: SchemeSpec
) -> tuple[jax.Array, jax.Array]:
    """Per (rank, microbatch) of an [R, M, B, T] batch: is its loss sum finite, and is its own
    gradient (local, before any reduction) finite? Two [R, M] bool arrays.

    A diagnosis, run outside the step and only after the step's result held a NaN or inf
    (`jax_impl.update.check_finite`): inside the step the microbatches' values are summed and
    reduced before anything leaves the program, so where a NaN first appeared is recomputed
    here. The R M microbatches run one after another (``lax.map``): one gradient is live at a
    time, as in the step. a_t is the spec's, its count pre-pass run under ``vmap`` over ranks.
    """
    a = jax.vmap(lambda b: rank_spec_terms(spec, b, "ranks")[0].token_weights, axis_name="ranks")(
        batch
    )
    R, M = batch.targets.shape[:2]

    def flat(x: jax.Array) -> jax.Array:
        return jnp.reshape(x, (R * M, *x.shape[2:]))

    loss_and_grad = jax.value_and_grad(weighted_loss_sum)

    def one(xs: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        loss_sum, grads = loss_and_grad(params, *xs)
        grads_finite = jnp.all(
            jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)])
        )
        return jnp.isfinite(loss_sum), grads_finite

    xs = (flat(batch.inputs), flat(batch.targets), flat(a))
    loss_finite, grads_finite = jax.lax.map(one, xs)
    return loss_finite.reshape(R, M), grads_finite.reshape(R, M)
