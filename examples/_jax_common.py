"""What the JAX examples share and is not their lesson: the token losses, the micro-step loop.

Every JAX example gets one update's batch as [R, M, B, T] arrays (R devices, M micro-steps)
and differentiates a loss built from the same per-token cross-entropy. How it normalizes that
loss, which collective reduces the gradient over the devices and how the micro-steps combine
is each example's lesson, and stays in its own file; the scaffolding around it is here, once.
An example copied out of this folder takes this file along.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

IGNORE_INDEX = -100

Batch = dict[str, np.ndarray]
Microbatch = dict[str, jax.Array]
Optimizer = optax.GradientTransformation
#: (params, opt_state, microbatch) -> (updates, opt_state): one jitted micro-step.
TrainStep = Callable[[Any, Any, Microbatch], tuple[Any, Any]]


def token_losses(
    params: Any, apply_fn: Callable, microbatch: Microbatch
) -> tuple[jax.Array, jax.Array]:
    """Each target's cross-entropy (0 where the target is ignored), and the valid-target mask."""
    logits = apply_fn(params, microbatch["inputs"])
    targets = microbatch["targets"]
    mask = targets != IGNORE_INDEX
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(mask, targets, 0))
    return jnp.where(mask, losses, 0.0), mask


def device_varying(params: Any) -> Any:
    """`params` marked as varying over the "data" mesh axis, inside ``jax.shard_map``.

    shard_map treats replicated params as device-invariant, and jax.grad would then already
    sum the gradient over the devices; device-varying params give each device its own
    gradient, as pmap does, so that the example's own collective is the one data-parallel
    reduction.
    """
    return jax.lax.pcast(params, ("data",), to="varying")


def run_micro_steps(train_step: TrainStep, params: Any, opt_state: Any, batch: Batch) -> Any:
    """`train_step` on each of the batch's M microbatches in turn, its updates applied after
    each; returns the updates of the M-th call: what an accumulating optimizer emits once the
    update's micro-steps are all in (zeros before)."""
    for m in range(batch["inputs"].shape[1]):
        microbatch = {key: value[:, m] for key, value in batch.items()}  # [R, B, T]
        updates, opt_state = train_step(params, opt_state, microbatch)
        params = optax.apply_updates(params, updates)  # zeros until the M-th micro-step
    return updates
