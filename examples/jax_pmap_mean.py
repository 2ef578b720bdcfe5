"""A pmap data-parallel step with a per-device token mean: the rank-mean bug.

Mirrors the classic Flax/JAX data-parallel ``train_step`` (the Flax WMT and LM1B examples, and
the many training scripts built from them): every device computes the loss of its own batch
normalized by its own number of non-padding tokens, ``mean_loss = loss / weight_sum``, takes
``jax.grad`` of that, and ``jax.lax.pmean(grads, axis_name="batch")`` averages the gradients.
Here each device's batch is all of its M microbatches concatenated, so gradient accumulation
is not the issue; the per-device denominator is.

What ``crosscheck verify examples.jax_pmap_mean:step --scheme token_mean`` says: FAIL. A token
on device r weighs 1 / (R n_r) instead of 1 / N (n_r: the device's valid tokens, N: all of
them), so tokens on devices with few valid tokens count more. The gradient is exactly the
oracle's ``rank_mean``, at every number of accumulation steps M; with one device it is
correct. The fix is to normalize by the global count: ``psum`` the valid-token count before
dividing (see ``examples/jax_token_weighted.py``).

Protocol: ``step(params, apply_fn, batch, mesh)`` returns the pmap output as it is, with its
leading device axis (every replica is the same pmean'd gradient).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from examples._jax_common import Batch, token_losses


def device_loss(params: Any, apply_fn: Callable, batch: dict[str, jax.Array]) -> jax.Array:
    """Token mean of this device's whole batch: sum of losses / this device's own count."""
    losses, mask = token_losses(params, apply_fn, batch)
    # The guard keeps a device without a single target at 0 instead of NaN; the bug is the
    # *local* count, guard or not.
    return jnp.sum(losses) / jnp.maximum(jnp.sum(mask), 1)


def device_grads(apply_fn: Callable, params: Any, batch: dict[str, jax.Array]) -> Any:
    """One device: gradient of its own mean loss, then the data-parallel average."""
    grads = jax.grad(device_loss)(params, apply_fn, batch)
    return jax.lax.pmean(grads, axis_name="batch")


@functools.cache
def p_grads(apply_fn: Callable, devices: tuple[jax.Device, ...]) -> Callable:
    """The pmapped step, built once per model and device set as a training script does."""
    return jax.pmap(
        functools.partial(device_grads, apply_fn),
        axis_name="batch",
        in_axes=(None, 0),  # params broadcast, batch split over devices
        devices=devices,
    )


def step(params: Any, apply_fn: Callable, batch: Batch, mesh: Mesh) -> Any:
    """The gradient of one update, [R, ...] per parameter (pmap's replicated output)."""
    R, M, B, T = batch["inputs"].shape
    # Each device's M microbatches as one batch of M * B rows.
    per_device = {key: value.reshape(R, M * B, T) for key, value in batch.items()}
    return p_grads(apply_fn, tuple(mesh.devices.flat))(params, per_device)
