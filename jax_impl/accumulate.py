r"""One rank's share of an update: accumulate over M microbatches, then reduce across ranks.

Runs inside a named axis (``jax.pmap(axis_name=...)`` or ``jax.shard_map`` over a mesh axis);
the front-ends differ only in how they map this function over devices. With R ranks, M
microbatches per rank and every microbatch contributing :math:`(\sum_t a_t l_t,\ d)`:

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

Dtypes (the rule of `jax_impl.denominators`): the count channel is int32 through both
collectives and converted once, in `jax_impl.schemes.global_denominator`; the weight-sum
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
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_impl.denominators import (
    ExactSum,
    denominator_dtype,
    divide_by_denominator,
    exact_sum,
    rank_slots,
)
from jax_impl.losses import Microbatch, TokenLossesFn, weighted_loss_sum
from jax_impl.model import Params
from jax_impl.schemes import (
    IGNORE_INDEX,
    Scheme,
    global_denominator,
    safe_denominator,
    scheme_terms,
)


class Strategy(enum.Enum):
    """When the global denominator D is applied."""

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
    """The fully reduced gradient and what went into it, as seen on one rank."""

    grads: Params  # identical on every rank after the collective
    local_valid_tokens: jax.Array  # int32, valid targets of this rank over its M microbatches
    local_loss_sum: jax.Array  # sum of a_t l_t over this rank's tokens (denominator dtype)
    global_denominator: jax.Array  # D (denominator dtype)
    loss: jax.Array  # the objective L = (sum over ranks of local_loss_sum) / D


#: The signature every per-rank gradient function has (intended, or a reproduced bug):
#: (params, rank_batch [M, B, T], scheme index, constant normalizer, axis name) -> gradients.
RankGradientsFn = Callable[[Params, Microbatch, jax.Array, jax.Array, str], RankGradients]


def reduce_factor(collective: Collective, world_size: int) -> int:
    """s: R when the gradient collective averages, 1 when it sums."""
    return world_size if collective is Collective.PMEAN else 1


def continue_accumulation(
    params: Params,
    rank_batch: Microbatch,
    token_weights: jax.Array,
    scale: jax.Array,
    sums: tuple[Params, jax.Array],
    token_losses_fn: TokenLossesFn | None = None,
) -> tuple[Params, jax.Array]:
    """`sums` = (gradient sum, loss sum) continued over the microbatches of `rank_batch`.

    Adds grad((sum_t a_t l_t) * scale) and sum_t a_t l_t of each microbatch in turn, a
    ``lax.scan`` whose carry starts at `sums`: from zeros for a whole update
    (`accumulate_microbatches`), from a checkpoint's partial sums for the rest of a window that
    was stopped part-way (`jax_impl.resume`), with the additions in the same order either way.
    No collective. `token_losses_fn`: the model's l_t (None: the bilinear model).
    """

    def scaled_loss(p: Params, inputs, targets, a, segment_ids):
        loss_sum = weighted_loss_sum(p, inputs, targets, a, segment_ids, token_losses_fn)
        return loss_sum * scale, loss_sum

    grad_fn = jax.grad(scaled_loss, has_aux=True)

    def micro_step(carry, xs):
        grads_acc, loss_acc = carry
        grads, loss_sum = grad_fn(params, *xs)
        grads_acc = jax.tree.map(jnp.add, grads_acc, grads)
        return (grads_acc, loss_acc + loss_sum), None

    xs = (rank_batch.inputs, rank_batch.targets, token_weights, rank_batch.segment_ids)
    (grads, loss_sum), _ = jax.lax.scan(micro_step, sums, xs)
    return grads, loss_sum


@functools.partial(jax.jit, static_argnames=("token_losses_fn",))
def accumulate_microbatches(
    params: Params,
    rank_batch: Microbatch,
    token_weights: jax.Array,
    scale: jax.Array,
    token_losses_fn: TokenLossesFn | None = None,
) -> tuple[Params, jax.Array]:
    """sum over the M microbatches of grad((sum_t a_t l_t) * scale), and sum of sum_t a_t l_t.

    `rank_batch` and `token_weights` are [M, B, T]; `scale` is s / D (precount) or 1 (postnorm),
    in the denominator dtype like the loss sums it multiplies; the gradient is in the params'
    dtype. jit-wrapped so that its trace is cached per shape and shared by the strategies of a sweep
    (inside another jit, pmap or shard_map it is inlined, not a separate program).
    """
    # Zeros shaped like the params but built from the data: under shard_map they then carry
    # the data's varying-manual-axes type, as the scan carry must (the gradient of a rank's
    # own microbatch varies across ranks), without this code having to name the axis.
    zeros = jax.tree.map(
        lambda p: jnp.zeros_like(token_weights, shape=p.shape, dtype=p.dtype), params
    )
    init = (zeros, jnp.zeros_like(token_weights, shape=(), dtype=denominator_dtype()))
    return continue_accumulation(params, rank_batch, token_weights, scale, init, token_losses_fn)


def reduce_denominator(
    scheme: jax.Array | Scheme,
    local_count: jax.Array,
    local_weight_sum: ExactSum,
    constant_normalizer: jax.Array | float,
    axis_name: str,
) -> jax.Array:
    """D over every rank from this rank's d channels, before any forward pass (precount).

    One collective: the int32 count and this rank's weight-sum pair in its own slot (the psum
    adds zeros to it), then `jax_impl.schemes.global_denominator`.
    """
    total_count, weight_slots = jax.lax.psum(
        (local_count, rank_slots(local_weight_sum, axis_name)), axis_name
    )
    return global_denominator(scheme, total_count, exact_sum(weight_slots), constant_normalizer)


def reduce_precount(
    grads: Params, local_loss_sum: jax.Array, collective: Collective, axis_name: str
) -> tuple[Params, jax.Array]:
    """precount's reduction of gradients already scaled by s / D: (pmean or psum of the
    gradient, psum of the loss sums). The loss sums are for the metrics only: the objective's
    value needs every rank's."""
    if collective is Collective.PMEAN:
        grads = jax.lax.pmean(grads, axis_name)
    else:
        grads = jax.lax.psum(grads, axis_name)
    return grads, jax.lax.psum(local_loss_sum, axis_name)


def reduce_postnorm(
    grad_sums: Params,
    local_loss_sum: jax.Array,
    local_count: jax.Array,
    local_weight_sum: ExactSum,
    scheme: jax.Array | Scheme,
    constant_normalizer: jax.Array | float,
    axis_name: str,
) -> tuple[Params, jax.Array, jax.Array]:
    """postnorm's reduction of unnormalized sums: (g / D, the total loss sum, D).

    One collective: gradient sums (params' dtype), loss sums, the int32 count and the
    weight-sum slots together. D never travels in the gradients' dtype; g / D is formed in the
    denominator dtype and rounded once into the params' dtype.
    """
    grad_sums, total_loss_sum, total_count, weight_slots = jax.lax.psum(
        (grad_sums, local_loss_sum, local_count, rank_slots(local_weight_sum, axis_name)),
        axis_name,
    )
    D = global_denominator(scheme, total_count, exact_sum(weight_slots), constant_normalizer)
    return divide_by_denominator(grad_sums, safe_denominator(D)), total_loss_sum, D


def rank_gradients(
    params: Params,
    rank_batch: Microbatch,
    scheme: jax.Array | Scheme,
    constant_normalizer: jax.Array | float,
    axis_name: str,
    *,
    strategy: Strategy = Strategy.PRECOUNT,
    collective: Collective = Collective.PSUM,
    scale_override: float | None = None,
    token_losses_fn: TokenLossesFn | None = None,
) -> RankGradients:
    """The reduced gradient of the scheme's objective; call inside `axis_name`'s mapping.

    `scale_override` replaces s (precount only) to reproduce a mis-scaled step: s = 1 with
    pmean is the missing-world-size bug, s = R with psum a doubled world size.
    `token_losses_fn` is the model's l_t (None: the bilinear model).
    """
    world_size = jax.lax.axis_size(axis_name)
    dtype = denominator_dtype()
    terms = scheme_terms(scheme, rank_batch.targets, rank_batch.segment_ids, rank_batch.weights)
    # int32 sums: exact up to 2^31 - 1 (past that they wrap; see jax_impl.denominators).
    local_count = jnp.sum(terms.count, dtype=jnp.int32)
    local_weight_sum = exact_sum(terms.weight_sum)  # the M microbatches' pairs, one pair
    local_valid = jnp.sum(rank_batch.targets != IGNORE_INDEX, dtype=jnp.int32)

    if strategy is Strategy.PRECOUNT:
        # D over all R * M microbatches first, from the labels alone.
        D = reduce_denominator(
            scheme, local_count, local_weight_sum, constant_normalizer, axis_name
        )
        s = reduce_factor(collective, world_size) if scale_override is None else scale_override
        scale = jnp.asarray(s, dtype) / safe_denominator(D)
        grads, local_loss_sum = accumulate_microbatches(
            params, rank_batch, terms.token_weights, scale, token_losses_fn=token_losses_fn
        )
        grads, total_loss_sum = reduce_precount(grads, local_loss_sum, collective, axis_name)
    elif strategy is Strategy.POSTNORM:
        if collective is not Collective.PSUM or scale_override is not None:
            raise ValueError(
                "postnorm reduces sums and divides by D afterwards: it takes collective=psum "
                f"and no scale override, got collective={collective.value}, "
                f"scale_override={scale_override}"
            )
        one = jnp.ones((), dtype)
        grad_sums, local_loss_sum = accumulate_microbatches(
            params, rank_batch, terms.token_weights, one, token_losses_fn=token_losses_fn
        )
        grads, total_loss_sum, D = reduce_postnorm(
            grad_sums,
            local_loss_sum,
            local_count,
            local_weight_sum,
            scheme,
            constant_normalizer,
            axis_name,
        )
    else:
        raise ValueError(f"unknown strategy {strategy!r}")

    return RankGradients(
        grads=grads,
        local_valid_tokens=local_valid,
        local_loss_sum=local_loss_sum,
        global_denominator=D,
        loss=total_loss_sum / safe_denominator(D),
    )


@jax.jit
def microbatch_finiteness(
    params: Params, batch: Microbatch, scheme: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Per (rank, microbatch) of an [R, M, B, T] batch: is its loss sum finite, and is its own
    gradient (local, before any reduction) finite? Two [R, M] bool arrays.

    A diagnosis, run outside the step and only after the step's result held a NaN or inf
    (`jax_impl.update.check_finite`): inside the step the microbatches' values are summed and
    reduced before anything leaves the program, so where a NaN first appeared is recomputed
    here. The R M microbatches run one after another (``lax.map``): one gradient is live at a
    time, as in the step. `scheme` is the int32 scheme index the steps take.
    """
    terms = scheme_terms(scheme, batch.targets, batch.segment_ids, batch.weights)
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

    xs = (flat(batch.inputs), flat(batch.targets), flat(terms.token_weights))
    loss_finite, grads_finite = jax.lax.map(one, xs)
    return loss_finite.reshape(R, M), grads_finite.reshape(R, M)
