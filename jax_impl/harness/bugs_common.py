r"""What every buggy step of `jax_impl.harness.bugs` shares: its signature and the microbatch loop.

A buggy step is written for one device of a ``jax.shard_map`` over a 1-D mesh with axis
``"data"``: it sees its own rank's [M, B, T] microbatches, its own copy of the params, and the
collectives (``lax.psum`` / ``lax.pmean``) over the axis. It runs one accumulation window and
returns the gradient as the optimizer would receive it, the denominator it would log, and any
state it carries into the next window (a counter, an optax state).

Notation: l_t the cross-entropy of token t (0 where the target is IGNORE_INDEX), v_t = 1 for a
valid target, R ranks, M microbatches per rank, D the global valid-token count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jax_impl.batch import IGNORE_INDEX, Batch
from jax_impl.losses import token_losses
from jax_impl.model import Params, logits_fn

#: The mesh axis every buggy step reduces over.
AXIS = "data"

State = Any  # a pytree carried from one window to the next (None when a step has none)


class StepContext(NamedTuple):
    """What a step may know besides params, batch and state (static except `skew`)."""

    axis: str
    accum_steps: int  # M
    clip_norm: float | None  # the clip-per-microbatch threshold (None if not needed)
    skew: jax.Array  # rank-skew's factor on rank 0's loss (traced: one compile for all skews)
    #: [M, B] prompt group of each of this rank's rows (traced, sharded by rank); None on the
    #: host, where only the initial states are built. Read by local-group-count.
    group_ids: jax.Array | None = None
    #: [M, B, T] float loss weights as an input pipeline hands them (T5X's
    #: ``decoder_loss_weights``: 1.0 where the target carries a loss); None on the host.
    #: Read by zero-count-nan.
    loss_weights: jax.Array | None = None


class WindowOut(NamedTuple):
    """One window's result on one device."""

    grads: Params  # synchronized: identical on every device
    logged: jax.Array  # the denominator the step logs (may differ by rank: rank 0's is used)
    state: State  # carried into the next window; must be identical on every device


WindowFn = Callable[[Params, Batch, State, StepContext], WindowOut]
InitFn = Callable[[Params, StepContext], State]


def no_state(params: Params, ctx: StepContext) -> None:
    """The initial state of a step that carries nothing between windows."""
    del params, ctx


class BugStep(NamedTuple):
    """A buggy step: its per-device window and the host-side state before the first window."""

    window: WindowFn
    init_state: InitFn = no_state


def valid(batch: Batch) -> jax.Array:
    """v_t as booleans, same shape as the targets."""
    return batch.targets != IGNORE_INDEX


def count(mask: jax.Array) -> jax.Array:
    """The number of True entries as int32 (exact far past float32's 2^24)."""
    return jnp.sum(mask, dtype=jnp.int32)


def token_loss_sum(params: Params, microbatch: Batch, a: jax.Array | None = None) -> jax.Array:
    """sum_t a_t l_t over one microbatch ([B, T]); a_t = 1 when not given (l_t = 0 if ignored)."""
    losses = token_losses(logits_fn(params, microbatch.inputs), microbatch.targets)
    return jnp.sum(losses if a is None else a * losses)


def accumulate(
    loss_fn: Callable[[Params, Batch], jax.Array], params: Params, rank_batch: Batch
) -> tuple[jax.Array, Params]:
    """sum over this rank's M microbatches of (loss_fn, grad loss_fn): a gradient-accumulation
    loop, one ``jax.value_and_grad`` per microbatch, as a ``lax.scan`` so the program does not
    grow with M. No collective: the caller reduces, which is where most of the bugs live."""
    value_and_grad = jax.value_and_grad(loss_fn)

    def micro_step(carry, microbatch):
        loss_acc, grads_acc = carry
        loss, grads = value_and_grad(params, microbatch)
        return (loss_acc + loss, jax.tree.map(jnp.add, grads_acc, grads)), None

    # Zeros of the params (rank-varying under shard_map, as the carry must be: every rank
    # accumulates its own microbatches).
    zeros = jax.tree.map(jnp.zeros_like, params)
    # The loss is at least float32 (token_losses upcasts bf16 logits): so is its running sum.
    loss_dtype = jnp.promote_types(jax.tree.leaves(params)[0].dtype, jnp.float32)
    init = (jnp.zeros_like(jax.tree.leaves(params)[0], shape=(), dtype=loss_dtype), zeros)
    (loss, grads), _ = jax.lax.scan(micro_step, init, rank_batch)
    return loss, grads


def dtype_of(params: Params) -> jnp.dtype:
    """The compute dtype: the params'."""
    return jax.tree.leaves(params)[0].dtype
