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
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from examples._jax_common import Batch, Optimizer, device_varying, run_micro_steps, token_losses
from jax_impl.token_weighted import token_weighted_accumulation


def loss_sum_and_count(
    params: Any, apply_fn: Callable, microbatch: dict[str, jax.Array]
) -> tuple[jax.Array, jax.Array]:
    """Sum of the token losses of one microbatch on one device, and its valid-token count."""
    losses, mask = token_losses(params, apply_fn, microbatch)
    return jnp.sum(losses), jnp.sum(mask, dtype=jnp.int32)


@functools.cache
def accumulate(optimizer: Optimizer, accum_steps: int) -> optax.GradientTransformationExtraArgs:
    """The user's optimizer, applied once every `accum_steps` micro-steps to sum / count."""
    return token_weighted_accumulation(optimizer, accum_steps)


@functools.cache
def make_train_step(
    apply_fn: Callable, tx: optax.GradientTransformationExtraArgs, mesh: Mesh
) -> Callable:
    """The jitted micro-step, built once per model, optimizer and mesh as a script does."""

    def device_grads(params: Any, microbatch: dict[str, jax.Array]) -> tuple[Any, jax.Array]:
        loss_grad = jax.grad(loss_sum_and_count, has_aux=True)
        grads, count = loss_grad(device_varying(params), apply_fn, microbatch)
        # Sums, not means: of the gradients and of the counts, over the devices.
        return jax.lax.psum(grads, "data"), jax.lax.psum(count, "data")

    grads_fn = jax.shard_map(
        device_grads, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P())
    )

    @jax.jit
    def train_step(params: Any, opt_state: Any, microbatch: dict[str, jax.Array]) -> tuple:
        grads, count = grads_fn(params, microbatch)
        return tx.update(grads, opt_state, params, denominator=count)

    return train_step


def step(params: Any, apply_fn: Callable, batch: Batch, mesh: Mesh, optimizer: Optimizer) -> Any:
    """One optimizer update over M micro-steps; returns the updates the accumulator emits."""
    tx = accumulate(optimizer, batch["inputs"].shape[1])
    train_step = make_train_step(apply_fn, tx, mesh)
    return run_micro_steps(train_step, params, tx.init(params), batch)
