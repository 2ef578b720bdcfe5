"""Gradient accumulation that weighs every token the same: the fix for the MultiSteps loop.

The same loop as ``examples/jax_optax_multisteps.py`` (one jitted micro-step per microbatch,
``jax.shard_map`` over the "data" mesh axis, the user's optimizer wrapped by an accumulator),
with two changes that make the update the gradient of the global token mean:

* each micro-step differentiates the *sum* of its token losses, not their mean, and ``psum``s
  that gradient and the number of valid targets over the devices;
* the accumulator is gradweight's ``jax_impl.token_weighted.token_weighted_accumulation``
  (a drop-in for ``optax.MultiSteps``): it sums the micro-steps' gradients and counts and
  divides once, by the count of the whole update, before the wrapped optimizer sees it.

What ``crosscheck verify examples.jax_token_weighted:step --scheme token_mean`` says: PASS.
Every token weighs 1 / N for every layout (R, M), within float64 rounding of the oracle.

Protocol: like the MultiSteps example, the step takes ``optimizer`` and returns the updates
the accumulator emits on the M-th micro-step (for ``optax.sgd(1.0)``: minus the gradient).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_impl.token_weighted import token_weighted_accumulation

IGNORE_INDEX = -100


def loss_sum_and_count(
    params: Any, apply_fn: Callable, microbatch: dict[str, jax.Array]
) -> tuple[jax.Array, jax.Array]:
    """Sum of the token losses of one microbatch on one device, and its valid-token count."""
    logits = apply_fn(params, microbatch["inputs"])
    targets = microbatch["targets"]
    mask = targets != IGNORE_INDEX
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(mask, targets, 0))
    return jnp.sum(jnp.where(mask, losses, 0.0)), jnp.sum(mask, dtype=jnp.int32)


@functools.cache
def accumulate(
    optimizer: optax.GradientTransformation, accum_steps: int
) -> optax.GradientTransformationExtraArgs:
    """The user's optimizer, applied once every `accum_steps` micro-steps to sum / count."""
    return token_weighted_accumulation(optimizer, accum_steps)


@functools.cache
def make_train_step(
    apply_fn: Callable, tx: optax.GradientTransformationExtraArgs, mesh: Mesh
) -> Callable:
    """The jitted micro-step, built once per model, optimizer and mesh as a script does."""

    def device_grads(params: Any, microbatch: dict[str, jax.Array]) -> tuple[Any, jax.Array]:
        # Device-varying params: jax.grad then returns this device's own gradient (as under
        # pmap), and the psum below is the one data-parallel reduction.
        params = jax.lax.pcast(params, ("data",), to="varying")
        grads, count = jax.grad(loss_sum_and_count, has_aux=True)(params, apply_fn, microbatch)
        return jax.lax.psum(grads, "data"), jax.lax.psum(count, "data")

    grads_fn = jax.shard_map(
        device_grads, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P())
    )

    @jax.jit
    def train_step(params: Any, opt_state: Any, microbatch: dict[str, jax.Array]) -> tuple:
        grads, count = grads_fn(params, microbatch)
        return tx.update(grads, opt_state, params, denominator=count)

    return train_step


def step(
    params: Any,
    apply_fn: Callable,
    batch: dict[str, np.ndarray],
    mesh: Mesh,
    optimizer: optax.GradientTransformation,
) -> Any:
    """One optimizer update over M micro-steps; returns the updates the accumulator emits."""
    accum_steps = batch["inputs"].shape[1]
    tx = accumulate(optimizer, accum_steps)
    opt_state = tx.init(params)
    train_step = make_train_step(apply_fn, tx, mesh)
    for m in range(accum_steps):
        microbatch = {key: value[:, m] for key, value in batch.items()}  # [R, B, T]
        updates, opt_state = train_step(params, opt_state, microbatch)
        params = optax.apply_updates(params, updates)  # zeros until the M-th micro-step
    return updates
