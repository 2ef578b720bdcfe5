r"""The contract-v2 steps of the bug catalogue in JAX: a local group count, and a local 0/0.

Same conventions as `jax_impl.harness.bugs` (one device of a ``jax.shard_map`` over the axis
``"data"``, a ``lax.scan`` over its M microbatches, each step wrong in exactly one way), with
two more inputs, laid out by `jax_impl.harness.bugs_sweep`: ``ctx.group_ids`` [M, B], the
prompt group of each of this rank's rows (without ``group_ids`` every row is its own group),
and ``ctx.loss_weights`` [M, B, T], the float loss mask an input pipeline hands a step.

Notation: v_t valid target, g(t) the group of t's row, :math:`n_g` the valid targets of group g
over the whole update, :math:`D_G` the groups with a valid target. The intended
``group_token_mean`` is :math:`L = \frac{1}{D_G} \sum_t \frac{v_t}{n_{g(t)}} l_t`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jax_impl.batch import Batch
from jax_impl.denominators import loss_dtype
from jax_impl.harness.bugs_common import (
    BugStep,
    State,
    StepContext,
    WindowOut,
    accumulate,
    count,
    dtype_of,
    token_loss_sum,
    valid,
)
from jax_impl.model import Params, logits_fn


def _same_group(ids: jax.Array) -> jax.Array:
    """[K, K] True where two rows share a group id. Ids need not be dense or bounded, so no
    ``segment_sum`` with a static segment count: an equality matrix over the rows does it."""
    return ids[:, None] == ids[None, :]


def nonempty_groups(row_counts: jax.Array, ctx: StepContext) -> jax.Array:
    """D_G: groups of the whole update with a valid target (int32, the same on every rank).

    Every rank's row ids and row counts are gathered ([N] each); a group is counted once, at
    its first row, when its global count is positive."""
    ids = lax.all_gather(ctx.group_ids, ctx.axis).reshape(-1)
    counts = lax.all_gather(row_counts, ctx.axis).reshape(-1)
    same = _same_group(ids)
    n_group = jnp.sum(jnp.where(same, counts[None, :], 0), axis=1)
    first = jnp.argmax(same, axis=1) == jnp.arange(ids.shape[0])
    return count(first & (n_group > 0))


def local_group_count(params: Params, batch: Batch, state: State, ctx: StepContext) -> WindowOut:
    r"""Each microbatch counts a group's tokens on its own rows (slime per-rollout means;
    verl#2776; SkyRL prompt_mean computed per microbatch):
    :math:`g = \frac{1}{D_G} \sum_t \frac{v_t}{n^{rm}_{g(t)}} \nabla l_t`, with
    :math:`n^{rm}_g` the group's valid targets inside t's (rank, microbatch); D_G is right and
    the gradient all-reduce a sum. Logs D_G."""
    dtype = dtype_of(params)
    row_counts = jnp.sum(valid(batch), axis=-1, dtype=jnp.int32)  # [M, B]
    num_groups = nonempty_groups(row_counts, ctx)

    def loss_fn(p: Params, part: tuple[Batch, jax.Array, jax.Array]) -> jax.Array:
        mb, ids, rows = part
        # BUG: the group's count over this microbatch's rows only ([B]), never summed over
        # microbatches and ranks before use.
        n_local = jnp.sum(jnp.where(_same_group(ids), rows[None, :], 0), axis=1)
        # A group without a valid target here has a zero loss sum: max keeps its weight 0
        # (0/0 is zero-count-nan, not this bug).
        a = jnp.where(valid(mb), 1 / jnp.maximum(n_local, 1)[:, None].astype(dtype), 0)
        return token_loss_sum(p, mb, a.astype(dtype)) / num_groups.astype(dtype)

    # The scan walks the microbatches with their group ids and row counts alongside.
    _, grads = accumulate(loss_fn, params, (batch, ctx.group_ids, row_counts))
    return WindowOut(lax.psum(grads, ctx.axis), num_groups, state)


def zero_count_nan(params: Params, batch: Batch, state: State, ctx: StepContext) -> WindowOut:
    r"""A per-microbatch token mean with a loss mask and no guard for 0 tokens (mcore-bridge#104;
    Megatron-LM#3396; verl#6464; prime-rl#808; NeMo-RL#212):
    :math:`g = \frac{1}{R M} \sum_{r, m} \nabla \frac{\sum_t m_t l_t}{\sum_t m_t}`, m_t = v_t.
    On a microbatch without a valid target the loss is 0/0 = NaN and its backward
    :math:`m_t \cdot \infty = 0 \cdot \infty` = NaN, which ``pmean`` spreads to every rank.
    (With no empty microbatch it is microbatch-mean.) Logs n_rm of this rank's last
    microbatch."""

    def loss_fn(p: Params, part: tuple[Batch, jax.Array]) -> jax.Array:
        mb, loss_weights = part
        logits = logits_fn(p, mb.inputs)
        logits = logits.astype(loss_dtype(logits.dtype))
        # Labels without -100 and the pipeline's float loss weights, T5X-style: the weights
        # multiply the incoming gradient, so 0 x inf reaches the logits as NaN. (A mask made
        # in the step from ``targets != -100`` would hide it under jit: XLA turns the
        # multiply by a converted boolean into a select, whose masked branch is 0.)
        labels = jnp.where(valid(mb), mb.targets, 0)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        mask = loss_weights.astype(losses.dtype)
        # BUG: jnp.sum(mask) is 0 on an empty microbatch: no maximum(..., 1), no skip.
        return jnp.sum(losses * mask) / jnp.sum(mask) / ctx.accum_steps

    _, grads = accumulate(loss_fn, params, (batch, ctx.loss_weights))
    return WindowOut(lax.pmean(grads, ctx.axis), count(valid(batch)[-1]), state)


#: The v2 steps by their ids in crosscheck.diagnosis.patterns (merged into BUG_STEPS).
GROUP_BUG_STEPS: dict[str, BugStep] = {
    "local-group-count": BugStep(local_group_count),
    "zero-count-nan": BugStep(zero_count_nan),
}
