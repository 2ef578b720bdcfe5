r"""The accidental normalizations, written the way real training loops write them.

Each rank (or each microbatch) takes its own token mean and the data-parallel all-reduce
averages the results. Neither is of the (a_t, d) form with a layout-free D, so neither is a
scheme of `jax_impl.schemes`; they exist so that a gradient can be compared with them and the
bug named (docs/bugs.md: rank-mean, microbatch-mean). Both take the `RankGradientsFn` arguments
(the scheme's are ignored: what the loop does does not depend on them) and plug into any
collective front-end through ``StepConfig(gradients=...)``.

rank_mean
    token t on rank r weighs :math:`v_t / (R\, n_r)`: the seed example's 9x, torchtune#2980,
    prime-rl#2358.
microbatch_mean
    token t on rank r, microbatch m weighs :math:`v_t / (R\, M\, n_{rm})`: nanoGPT-style
    ``loss / grad_accum_steps``, transformers#34191, optax.MultiSteps with a mean loss.

Where a rank or microbatch has no valid token, real code divides 0 by 0; here it contributes
nothing (the oracle's convention), so that the comparison names the reweighting, not a NaN.

The local counts n_r and n_rm are int32 and are converted once, to the denominator dtype
(`jax_impl.denominators`: float64 under x64, else float32), before the division: the
accident reproduced is the local mean, not a count rounded to the params' dtype on top of it
(in bfloat16, n = 257 would become 256).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jax_impl.accumulate import RankGradients, RankGradientsFn, accumulate_microbatches
from jax_impl.denominators import denominator_dtype
from jax_impl.losses import Microbatch, local_mean_loss
from jax_impl.model import Params
from jax_impl.schemes import IGNORE_INDEX


def _whatever_the_scheme(
    gradients: Callable[[Params, Microbatch, str], RankGradients],
) -> RankGradientsFn:
    """`gradients(params, rank_batch, axis_name)` as a `RankGradientsFn`: the scheme index and
    the constant normalizer are taken and ignored, since this is what the loop does whatever
    was intended."""

    # Its name and docstring; its own signature and annotations.
    @functools.wraps(gradients, assigned=("__module__", "__name__", "__qualname__", "__doc__"))
    def with_scheme_arguments(
        params: Params,
        rank_batch: Microbatch,
        scheme: jax.Array,
        constant_normalizer: jax.Array,
        axis_name: str,
    ) -> RankGradients:
        del scheme, constant_normalizer
        return gradients(params, rank_batch, axis_name)

    del with_scheme_arguments.__wrapped__  # inspect.signature: this one, not `gradients`'
    return with_scheme_arguments


@_whatever_the_scheme
def rank_mean_gradients(params: Params, rank_batch: Microbatch, axis_name: str) -> RankGradients:
    """Local token mean over this rank's M microbatches, then ``pmean`` over ranks.

    The scheme arguments are ignored: this is what the loop does whatever was intended. The
    reported denominator is R and the per-rank loss sum is the rank's own mean, as the
    oracle reports them.
    """
    valid = rank_batch.targets != IGNORE_INDEX
    dtype = denominator_dtype()
    n_rank = jnp.sum(valid, dtype=jnp.int32)
    inv_count = 1 / jnp.where(n_rank > 0, n_rank, 1).astype(dtype)  # one conversion of n_r
    grads, loss_sum = accumulate_microbatches(params, rank_batch, valid.astype(dtype), inv_count)
    rank_mean = loss_sum * inv_count
    world_size = jax.lax.axis_size(axis_name)
    return RankGradients(
        grads=jax.lax.pmean(grads, axis_name),
        local_valid_tokens=n_rank,
        local_loss_sum=rank_mean,
        global_denominator=jnp.asarray(world_size, dtype),
        loss=jax.lax.pmean(rank_mean, axis_name),
    )


@_whatever_the_scheme
def microbatch_mean_gradients(
    params: Params, rank_batch: Microbatch, axis_name: str
) -> RankGradients:
    """Each microbatch's own token mean divided by M, accumulated, then ``pmean`` over ranks.

    The scheme arguments are ignored. The reported denominator is R M and the per-rank loss
    sum is the sum of the rank's microbatch means, as the oracle reports them.
    """
    accum_steps = rank_batch.targets.shape[0]
    dtype = denominator_dtype()

    def scaled_mean(p: Params, microbatch: Microbatch) -> tuple[jax.Array, jax.Array]:
        # nanoGPT's `loss = loss / gradient_accumulation_steps` before backward: the division
        # by M happens on the (denominator-dtype) loss, not on the params-dtype gradient.
        mean = local_mean_loss(p, microbatch)
        return mean / jnp.asarray(accum_steps, dtype), mean

    grad_and_mean = jax.grad(scaled_mean, has_aux=True)

    def micro_step(carry, microbatch):
        grads_acc, means_acc = carry
        grads, mean = grad_and_mean(params, microbatch)
        grads_acc = jax.tree.map(jnp.add, grads_acc, grads)
        return (grads_acc, means_acc + mean), None

    like = rank_batch.targets  # zeros built from the data vary across ranks, as the carry must
    init = (
        jax.tree.map(lambda p: jnp.zeros_like(like, shape=p.shape, dtype=p.dtype), params),
        jnp.zeros_like(like, shape=(), dtype=dtype),
    )
    (grads, mean_sum), _ = jax.lax.scan(micro_step, init, rank_batch)
    world_size = jax.lax.axis_size(axis_name)
    return RankGradients(
        grads=jax.lax.pmean(grads, axis_name),
        local_valid_tokens=jnp.sum(rank_batch.targets != IGNORE_INDEX, dtype=jnp.int32),
        local_loss_sum=mean_sum,
        global_denominator=jnp.asarray(world_size * accum_steps, dtype),
        loss=jax.lax.pmean(mean_sum, axis_name) / jnp.asarray(accum_steps, dtype),
    )
