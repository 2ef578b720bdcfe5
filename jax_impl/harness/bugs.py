r"""The bug catalogue of docs/bugs.md, each pattern as the buggy JAX step that produces it.

Every step is written the way data-parallel JAX code writes it: one device of a
``jax.shard_map`` over the mesh axis ``"data"`` (`jax_impl.harness.bugs_common.AXIS`), a
``jax.value_and_grad`` of this device's loss per microbatch, a ``lax.scan`` over its M
microbatches, and ``lax.psum`` / ``lax.pmean`` for counts and gradients. The steps are run,
two windows each, by `jax_impl.harness.bugs_sweep`. Only the normalization is wrong, and each in
exactly one way; the docstring gives the gradient the step hands the optimizer.

Notation: l_t token loss, v_t valid target, R ranks, M microbatches per rank, n_r / n_rm the
valid targets of a rank / microbatch, D = sum_t v_t over the global batch of N rows x T slots,
and :math:`\nabla L = \sum_t v_t \nabla l_t / D` the intended token-mean gradient.

Why one file: the steps are one list, a step per pattern in the order of docs/bugs.md, read side
by side as the table is (the contract-v2 steps are in `jax_impl.harness.bugs_groups`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jax_impl.batch import Batch
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
from jax_impl.harness.bugs_groups import GROUP_BUG_STEPS
from jax_impl.model import Params

#: Id of the calibration step (crosscheck.diagnosis.patterns.RANK_SKEW; jax_impl does not import
#: it).
RANK_SKEW = "rank-skew"


def _global_count(batch: Batch, ctx: StepContext) -> jax.Array:
    """D: this rank's valid targets over its M microbatches, summed over ranks (int32)."""
    return lax.psum(count(valid(batch)), ctx.axis)


def _synchronized_token_sum_grads(
    params: Params, batch: Batch, denominator: jax.Array, ctx: StepContext, scale=1
) -> Params:
    """psum_r sum_m grad(scale * sum_t l_t / denominator): the precount step, the gradient
    all-reduce a sum (reduction factor 1). Correct for denominator D and scale 1."""
    dtype = dtype_of(params)

    def loss_fn(p: Params, mb: Batch) -> jax.Array:
        return token_loss_sum(p, mb) / denominator.astype(dtype) * scale

    _, grads = accumulate(loss_fn, params, batch)
    return lax.psum(grads, ctx.axis)


def rank_mean(params: Params, batch: Batch, state: State, ctx: StepContext) -> WindowOut:
    r"""Each rank's own token mean, averaged by the all-reduce (seed example; torchtune#2980;
    prime-rl#2358): :math:`g = \frac1R \sum_r \frac{1}{n_r} \sum_{t \in r} v_t \nabla l_t`.

    Logs n_r. A rank without a valid target would divide 0 by 0; it divides by 1 here so that
    it adds nothing (no catalogue layout has one).
    """
    n_r = count(valid(batch))  # local: the count never meets a collective
    denominator = jnp.maximum(n_r, 1).astype(dtype_of(params))
    _, grads = accumulate(lambda p, mb: token_loss_sum(p, mb) / denominator, params, batch)
    return WindowOut(lax.pmean(grads, ctx.axis), n_r, state)


def _multisteps(params: Params, ctx: StepContext) -> optax.MultiSteps:
    # MultiSteps accumulates in float32 by default: that alone would round a float64 step.
    return optax.MultiSteps(
        optax.identity(), every_k_schedule=ctx.accum_steps, accumulator_dtype=dtype_of(params)
    )


def _feed_microbatches(
    tx: optax.GradientTransformation,
    params: Params,
    batch: Batch,
    denominator: jax.Array,
    state: State,
    ctx: StepContext,
) -> tuple[Params, State]:
    r"""A loop that hands `tx` every accumulation step's synchronized gradient
    :math:`g_m = \sum_r \nabla \sum_{t \in rm} v_t l_t / D`, D = `denominator` (this
    microbatch's share of the token mean), as a training loop calling its optimizer every
    micro-step does: the last update `tx` emitted, and its state."""

    def micro_step(carry, mb: Batch):
        opt_state, _ = carry
        _, grads = jax.value_and_grad(lambda p: token_loss_sum(p, mb) / denominator)(params)
        updates, opt_state = tx.update(lax.psum(grads, ctx.axis), opt_state)
        return (opt_state, updates), None

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype), params)
    (state, updates), _ = lax.scan(micro_step, (state, zeros), batch)
    return updates, state


def microbatch_mean(params: Params, batch: Batch, state: State, ctx: StepContext) -> WindowOut:
    r"""optax.MultiSteps with a mean loss (transformers#34191; nanoGPT; T5X microbatches; Levanter
    MEAN): every microbatch's own token mean, its gradient pmean'd over ranks, and MultiSteps
    averaging the M microbatch gradients:
    :math:`g = \frac1R \sum_r \frac1M \sum_m \frac{1}{n_{rm}} \sum_{t \in rm} v_t \nabla l_t`.

    The state is the MultiSteps state; the optimizer it wraps is the identity, so its emitted
    update is the gradient the optimizer would receive. Logs n_rm of the last microbatch.
    """
    tx = _multisteps(params, ctx)
    dtype = dtype_of(params)

    def micro_step(carry, mb: Batch):
        opt_state, _, _ = carry
        n_rm = count(valid(mb))

        def mean_loss(p: Params) -> jax.Array:  # this microbatch's own token mean: the bug
            return token_loss_sum(p, mb) / jnp.maximum(n_rm, 1).astype(dtype)

        _, grads = jax.value_and_grad(mean_loss)(params)
        # A pmap-style train step: synchronize, then hand the gradient to MultiSteps.
        updates, opt_state = tx.update(lax.pmean(grads, ctx.axis), opt_state)
        return (opt_state, updates, n_rm), None

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype), params)
    n0 = jnp.zeros_like(batch.targets, shape=(), dtype=jnp.int32)
    (state, updates, n_last), _ = lax.scan(micro_step, (state, zeros, n0), batch)
    return WindowOut(updates, n_last, state)


def microstep_mean(params: Params, batch: Batch, state: State, ctx: StepContext) -> WindowOut:
    r"""optax.MultiSteps (``use_grad_mean=True``) fed the gradient of each micro-step's token
    mean over the *global* microbatch, as ``jax.jit`` over a batch sharded on "data" computes
    it (the optax gradient accumulation guide's mean loss; transformers#34191 is the per-rank
    cousin): the microbatch's count psum'd, :math:`n_m = \sum_r n_{rm}`, its gradient psum'd,
    and MultiSteps averaging the M of them:
    :math:`g = \frac1M \sum_m \frac{1}{n_m} \sum_{t \in m} v_t \nabla l_t`, every rank of
    a microbatch weighed alike. The state is the MultiSteps state (identity inner optimizer).
    Logs n_m of the last microbatch."""
    tx = _multisteps(params, ctx)
    dtype = dtype_of(params)

    def micro_step(carry, mb: Batch):
        opt_state, _, _ = carry
        n_m = lax.psum(count(valid(mb)), ctx.axis)  # the global microbatch's count

        def mean_loss(p: Params) -> jax.Array:  # BUG: the microbatch's mean, not the window's
            return token_loss_sum(p, mb) / n_m.astype(dtype)

        _, grads = jax.value_and_grad(mean_loss)(params)
        # What jit's all-reduce of a globally sharded mean gives: the sum of the ranks' parts.
        updates, opt_state = tx.update(lax.psum(grads, ctx.axis), opt_state)
        return (opt_state, updates, n_m), None

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype), params)
    n0 = jnp.zeros((), dtype=jnp.int32)  # the same on every rank, as the psum'd n_m is
    (state, updates, n_last), _ = lax.scan(micro_step, (state, zeros, n0), batch)
    return WindowOut(updates, n_last, state)


def missing_world_size(params: Params, batch: Batch, state: State, ctx: StepContext) -> WindowOut:
    r"""sum / D with the global D, under an averaging all-reduce nobody compensated
    (transformers#37474): :math:`g = \frac1R \sum_r \sum_{t \in r} v_t \nabla l_t / D
    = \nabla L / R`. Logs D."""
    D = _global_count(batch, ctx)
    dtype = dtype_of(params)
    _, grads = accumulate(lambda p, mb: token_loss_sum(p, mb) / D.astype(dtype), params, batch)
    return WindowOut(lax.pmean(grads, ctx.axis), D, state)


def double_world_size(params: Params, batch: Batch, state: State, ctx: StepContext) -> WindowOut:
    r"""x R by the user and x R again by a wrapper, under an averaging all-reduce
    (liquid-finetune#38; transformers#48690): :math:`g = \frac1R \sum_r \nabla (R \cdot R
    \sum_{t \in r} v_t l_t / D) = R\, \nabla L`. Logs D."""
    D = _global_count(batch, ctx)
    R = lax.axis_size(ctx.axis)
    dtype = dtype_of(params)

    def user_loss(p: Params, mb: Batch) -> jax.Array:
        # Right on its own: pmean divides by R, so the user scales by R.
        return token_loss_sum(p, mb) / D.astype(dtype) * R

    def wrapped_loss(p: Params, mb: Batch) -> jax.Array:
        # A trainer wrapper that "undoes the averaging" as well, not knowing the user did.
        return user_loss(p, mb) * R

    _, grads = accumulate(wrapped_loss, params, batch)
    return WindowOut(lax.pmean(grads, ctx.axis), D, state)


def double_accum_scale(params: Params, batch: Batch, state: State, ctx: StepContext) -> WindowOut:
    r"""Every microbatch loss multiplied by M once too often (transformers#35438), under a
    correct psum: :math:`g = \sum_r \sum_m \nabla (M \sum_{t \in rm} v_t l_t / D)
    = M\, \nabla L`. Logs D."""
    D = _global_count(batch, ctx)
    # The loss is already normalized by the global D; the "* M" undoes a "/ M" that never ran.
    grads = _synchronized_token_sum_grads(params, batch, D, ctx, scale=ctx.accum_steps)
    return WindowOut(grads, D, state)


def double_accum_divide(params: Params, batch: Batch, state: State, ctx: StepContext) -> WindowOut:
    r"""A loss already normalized by the whole window's global count, fed to an
    ``optax.MultiSteps`` that averages its M mini-steps (its default ``use_grad_mean=True``):
    the accumulation steps divide a second time (ms-swift#10117, there the trainer's
    ``/ gradient_accumulation_steps`` on a ``num_items_in_batch`` loss). With
    :math:`g_m = \sum_r \nabla \sum_{t \in rm} v_t l_t / D` under a correct psum,
    :math:`g = \frac1M \sum_m g_m = \nabla L / M`. The state is the MultiSteps state.
    Logs D."""
    tx = _multisteps(params, ctx)  # BUG: averages the M gradients; summing them was right
    D = _global_count(batch, ctx)
    updates, state = _feed_microbatches(tx, params, batch, D.astype(dtype_of(params)), state, ctx)
    return WindowOut(updates, D, state)


def unshifted_count(params: Params, batch: Batch, state: State, ctx: StepContext) -> WindowOut:
    r"""The denominator counts labels before the causal shift (transformers#46204): a row's
    labels hold one more entry than its shifted targets, so every row with a valid target
    counts once more. With K the global number of such rows,
    :math:`g = \sum_t v_t \nabla l_t / (D + K) = \frac{D}{D + K} \nabla L`. Logs D + K."""
    v = valid(batch)
    labels_before_shift = count(v) + count(jnp.any(v, axis=-1))  # + 1 per row with a target
    denominator = lax.psum(labels_before_shift, ctx.axis)
    grads = _synchronized_token_sum_grads(params, batch, denominator, ctx)
    return WindowOut(grads, denominator, state)


def attention_mask_count(params: Params, batch: Batch, state: State, ctx: StepContext) -> WindowOut:
    r"""The denominator counts attended positions, ``attention_mask.sum()`` (unsloth-zoo#1217;
    multimodal trainers): with A the global number of positions with segment_ids > 0 (prompt,
    image placeholders and document ends included), :math:`g = \sum_t v_t \nabla l_t / A`.
    Logs A."""
    attended = lax.psum(count(batch.segment_ids > 0), ctx.axis)
    grads = _synchronized_token_sum_grads(params, batch, attended, ctx)
    return WindowOut(grads, attended, state)


def _clip_then_accumulate(ctx: StepContext) -> optax.GradientTransformation:
    # gpt-jax#2: the clip sits before apply_every in the chain, so it sees every microbatch.
    return optax.chain(optax.clip_by_global_norm(ctx.clip_norm), optax.apply_every(ctx.accum_steps))


def clip_per_microbatch(params: Params, batch: Batch, state: State, ctx: StepContext) -> WindowOut:
    r"""``optax.chain(clip_by_global_norm(c), apply_every(M))`` fed every accumulation step's
    synchronized gradient (transformers#986; gpt-jax#2): with
    :math:`g_m = \sum_r \nabla \sum_{t \in rm} v_t l_t / D` and
    :math:`\operatorname{clip}_c(x) = x \min(1, c / \lVert x \rVert)`,
    :math:`g = \sum_m \operatorname{clip}_c(g_m)`, which equals :math:`\nabla L` only while no
    :math:`\lVert g_m \rVert` exceeds c. The state is the chain's. Logs D."""
    tx = _clip_then_accumulate(ctx)
    D = _global_count(batch, ctx).astype(dtype_of(params))
    updates, state = _feed_microbatches(tx, params, batch, D, state, ctx)
    return WindowOut(updates, D, state)


def stale_count(params: Params, batch: Batch, state: State, ctx: StepContext) -> WindowOut:
    r"""The running token counter is never reset after an optimizer step (torchtune#1917):
    window w divides by :math:`w D`, so the second window's :math:`g = \nabla L / 2`.
    The state is the counter. Logs the counter (2 D in the second window)."""
    num_tokens = state + _global_count(batch, ctx)  # `num_tokens += ...`; the `= 0` is missing
    grads = _synchronized_token_sum_grads(params, batch, num_tokens, ctx)
    return WindowOut(grads, num_tokens, num_tokens)


def double_reduce_count(params: Params, batch: Batch, state: State, ctx: StepContext) -> WindowOut:
    r"""The count is all-reduced in place and the same buffer all-reduced again
    (Megatron-LM#7481). Under shard_map the first psum returns an axis-invariant value, and a
    psum of an invariant value multiplies it by R: the count is R D and
    :math:`g = \nabla L / R`. Logs R D."""
    num_tokens = lax.psum(count(valid(batch)), ctx.axis)
    num_tokens = lax.psum(num_tokens, ctx.axis)  # e.g. a logging helper that "syncs" it again
    grads = _synchronized_token_sum_grads(params, batch, num_tokens, ctx)
    return WindowOut(grads, num_tokens, state)


def packed_as_one(params: Params, batch: Batch, state: State, ctx: StepContext) -> WindowOut:
    r"""A per-sequence mean taken per packed row (packing collators; functionary#265): every
    segment of a row shares the row's count :math:`n_{row}`, and the denominator counts rows
    with a valid target, :math:`K`: :math:`g = \sum_t v_t \nabla l_t / (n_{row(t)} K)`.
    Intended was the mean over segments of each segment's mean. Logs K."""
    dtype = dtype_of(params)
    rows = lax.psum(count(jnp.any(valid(batch), axis=-1)), ctx.axis)

    def loss_fn(p: Params, mb: Batch) -> jax.Array:
        v = valid(mb)
        n_row = jnp.sum(v, axis=-1, keepdims=True)  # the row, not the segment: the bug
        a = jnp.where(v, 1 / jnp.maximum(n_row, 1).astype(dtype), 0).astype(dtype)
        return token_loss_sum(p, mb, a) / rows.astype(dtype)

    _, grads = accumulate(loss_fn, params, batch)
    return WindowOut(lax.psum(grads, ctx.axis), rows, state)


def padding_as_tokens(params: Params, batch: Batch, state: State, ctx: StepContext) -> WindowOut:
    r"""The normalizer counts every target slot, padding and ignored ones included (T5X
    NUM_TOTAL_TARGET_TOKENS where NUM_REAL_TARGET_TOKENS was meant):
    :math:`g = \sum_t v_t \nabla l_t / (N T) = \frac{D}{N T} \nabla L`. Logs N T."""
    slots = lax.psum(count(jnp.ones_like(batch.targets, dtype=bool)), ctx.axis)  # no mask
    grads = _synchronized_token_sum_grads(params, batch, slots, ctx)
    return WindowOut(grads, slots, state)


def float32_count(params: Params, batch: Batch, state: State, ctx: StepContext) -> WindowOut:
    r"""The weighted-mean denominator :math:`W = \sum_t w_t v_t` summed and psum'd in float32
    while losses and gradients stay in the params' dtype (large-batch pretraining): past
    :math:`2^{24}` float32 cannot hold W, so :math:`g = \sum_t w_t v_t \nabla l_t /
    \mathrm{fl}_{32}(W) = \frac{W}{\mathrm{fl}_{32}(W)} \nabla L_w`. Logs
    :math:`\mathrm{fl}_{32}(W)`."""
    dtype = dtype_of(params)
    local = jnp.sum(jnp.where(valid(batch), batch.weights, 0).astype(jnp.float32))
    denominator = lax.psum(local, ctx.axis)  # a float32 all-reduce, as the loss code wrote it

    def loss_fn(p: Params, mb: Batch) -> jax.Array:
        a = jnp.where(valid(mb), mb.weights, 0).astype(dtype)
        return token_loss_sum(p, mb, a) / denominator.astype(dtype)

    _, grads = accumulate(loss_fn, params, batch)
    return WindowOut(lax.psum(grads, ctx.axis), denominator, state)


def rank_skew(params: Params, batch: Batch, state: State, ctx: StepContext) -> WindowOut:
    r"""Calibration, not a pattern: the correct token-mean step except that rank 0's loss is
    multiplied by s = ``ctx.skew``: :math:`g = \sum_t s_{r(t)} v_t \nabla l_t / D` with
    :math:`s_0 = s`, :math:`s_{r>0} = 1`; s = 1 is exactly :math:`\nabla L`. Logs D."""
    D = _global_count(batch, ctx)
    # The loss sum is at least float32 (token_losses upcasts bf16 logits), and so are D and
    # the factor: a correct step never rounds its count to the params' bf16.
    dtype = jnp.promote_types(dtype_of(params), jnp.float32)
    factor = jnp.where(lax.axis_index(ctx.axis) == 0, ctx.skew, 1).astype(dtype)
    _, grads = accumulate(
        lambda p, mb: token_loss_sum(p, mb) / D.astype(dtype) * factor, params, batch
    )
    return WindowOut(lax.psum(grads, ctx.axis), D, state)


BUG_STEPS: dict[str, BugStep] = {
    "rank-mean": BugStep(rank_mean),
    "microbatch-mean": BugStep(
        microbatch_mean, lambda params, ctx: _multisteps(params, ctx).init(params)
    ),
    "microstep-mean": BugStep(
        microstep_mean, lambda params, ctx: _multisteps(params, ctx).init(params)
    ),
    "missing-world-size": BugStep(missing_world_size),
    "double-world-size": BugStep(double_world_size),
    "double-accum-scale": BugStep(double_accum_scale),
    "double-accum-divide": BugStep(
        double_accum_divide, lambda params, ctx: _multisteps(params, ctx).init(params)
    ),
    "unshifted-count": BugStep(unshifted_count),
    "attention-mask-count": BugStep(attention_mask_count),
    "clip-per-microbatch": BugStep(
        clip_per_microbatch, lambda params, ctx: _clip_then_accumulate(ctx).init(params)
    ),
    "stale-count": BugStep(stale_count, lambda params, ctx: jnp.zeros((), jnp.int32)),
    "double-reduce-count": BugStep(double_reduce_count),
    "packed-as-one": BugStep(packed_as_one),
    "padding-as-tokens": BugStep(padding_as_tokens),
    "float32-count": BugStep(float32_count),
    RANK_SKEW: BugStep(rank_skew),
    **GROUP_BUG_STEPS,  # contract v2: local-group-count, zero-count-nan
}
"""Every buggy step by its id in crosscheck.diagnosis.patterns (PATTERNS, plus RANK_SKEW)."""
