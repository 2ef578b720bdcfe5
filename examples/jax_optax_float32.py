r"""``optax.MultiSteps`` with its default float32 accumulator: one correct step and four bugs.

Mirrors a JAX data-parallel loop with gradient accumulation by ``optax.MultiSteps``: the
jitted train step runs once per microbatch, ``jax.shard_map`` over the "data" mesh axis gives
every device its own share of the microbatch, ``jax.grad`` differentiates the device's loss, a
collective (``psum`` or ``pmean``) reduces the gradient over the devices, and
``MultiSteps(tx, every_k_schedule=M)`` accumulates the M micro-steps' gradients before the
wrapped optimizer sees them. The accumulator is MultiSteps' *default*: float32, although the
params and gradients are float64. MultiSteps stores its running gradient in float32 between
micro-steps and adds the last micro-step's float64 gradient to it in float64, so every
micro-step but the last is rounded to float32: ``crosscheck verify`` judges these steps at
float32-level (a case with M = 1 rounds nothing and is float64-exact).

The steps (``crosscheck verify --framework jax --scheme token_mean``):

* ``step``: each micro-step's loss is its summed token loss divided by D, the valid targets
  of the whole update on every device (counted from the batch before the first micro-step),
  ``psum`` sums the gradient over the devices, and MultiSteps *sums* its micro-steps
  (``use_grad_mean=False``): every token weighs 1 / D. PASSES at float32-level.
* ``step_microbatch_mean``: each device's microbatch token mean, ``pmean``, MultiSteps'
  default mean over micro-steps: microbatch-mean (as ``examples/jax_optax_multisteps.py``).
* ``step_rank_count``: each device divides by its own valid count of the whole update,
  ``pmean``: rank-mean.
* ``step_extra_accum_divide``: global D and ``psum``, but MultiSteps' default
  ``use_grad_mean=True`` divides the sum by M once more: double-accum-divide.
* ``step_averaged_grads``: global D and a summing MultiSteps, but ``pmean`` divides by the R
  devices: missing-world-size. It logs D, which tells it apart from double-reduce-count.

Each step logs the denominator it divides by with ``crosscheck.log_denominator``, outside jit,
where a training loop would log it.

Protocol: every step takes ``optimizer`` (the harness passes ``optax.sgd(1.0)``), wraps it in
MultiSteps as a real loop wraps its own, and returns the updates MultiSteps emits on the M-th
micro-step (for SGD with learning rate 1: minus the accumulated gradient), so that MultiSteps'
own accumulation, float32 and averaging included, is what is verified.
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

from crosscheck import log_denominator
from examples._jax_common import (
    IGNORE_INDEX,
    Batch,
    Optimizer,
    device_varying,
    run_micro_steps,
    token_losses,
)

Reduction = Callable[[Any, str], Any]


def loss_sum_and_count(
    params: Any, apply_fn: Callable, microbatch: dict[str, jax.Array]
) -> tuple[jax.Array, jax.Array]:
    """Summed token loss of one microbatch on one device, and its number of valid targets."""
    losses, mask = token_losses(params, apply_fn, microbatch)
    return jnp.sum(losses), jnp.sum(mask)


@functools.cache
def accumulate(optimizer: Optimizer, accum_steps: int, use_grad_mean: bool) -> optax.MultiSteps:
    """The user's optimizer, applied once every `accum_steps` micro-steps."""
    # No accumulator_dtype, on purpose: MultiSteps then keeps its running gradient in float32
    # (its default), although params and gradients are float64. That is the point of this
    # example: the accumulated gradient is float32 (up to the last micro-step's share, added
    # in float64), and verify must judge the weighting through that rounding.
    return optax.MultiSteps(optimizer, every_k_schedule=accum_steps, use_grad_mean=use_grad_mean)


@functools.cache
def make_train_step(
    apply_fn: Callable, tx: optax.MultiSteps, mesh: Mesh, token_mean: bool, reduce: Reduction
) -> Callable:
    """The jitted micro-step, built once per model, optimizer, mesh and loss as a script does.

    Every device divides its summed token loss by its entry of `denominators` (one per
    device), or, with `token_mean`, takes its microbatch's own token mean; `reduce` (``psum``
    or ``pmean``) combines the devices' gradients.
    """

    def device_grads(params: Any, microbatch: dict[str, jax.Array], denominator: jax.Array) -> Any:
        def loss(p: Any) -> jax.Array:
            loss_sum, count = loss_sum_and_count(p, apply_fn, microbatch)
            if token_mean:  # guarded: a microbatch without targets adds 0, not NaN
                return loss_sum / jnp.maximum(count, 1)
            return loss_sum / denominator[0]

        return reduce(jax.grad(loss)(device_varying(params)), "data")

    grads_fn = jax.shard_map(
        device_grads, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=P()
    )

    @jax.jit
    def train_step(
        params: Any, opt_state: Any, microbatch: dict[str, jax.Array], denominators: jax.Array
    ) -> tuple:
        grads = grads_fn(params, microbatch, denominators)
        return tx.update(grads, opt_state, params)

    return train_step


def run_update(
    params: Any,
    apply_fn: Callable,
    batch: Batch,
    mesh: Mesh,
    optimizer: Optimizer,
    denominators: int | np.ndarray | None,
    *,
    reduce: Reduction = jax.lax.psum,
    use_grad_mean: bool = False,
) -> Any:
    """One optimizer update over M micro-steps; returns the updates MultiSteps emits.

    Every device divides its summed token loss by `denominators` (one number for all, or one
    per device, [R]); None: each microbatch takes its own token mean instead. `reduce`
    combines the devices' gradients; MultiSteps sums its micro-steps, or averages them with
    `use_grad_mean`. The defaults are those of the correct `step`.
    """
    world_size, accum_steps = batch["inputs"].shape[:2]
    tx = accumulate(optimizer, accum_steps, use_grad_mean)
    train_step = make_train_step(apply_fn, tx, mesh, denominators is None, reduce)
    if denominators is None:  # unused: each microbatch takes its own token mean
        denominators = np.ones(world_size)
    per_device = np.array(np.broadcast_to(denominators, world_size), dtype=np.float64)  # [R]
    micro_step = functools.partial(train_step, denominators=per_device)
    return run_micro_steps(micro_step, params, tx.init(params), batch)


def global_valid_targets(batch: Batch) -> int:
    """D: the valid targets of the whole update, every device and microbatch, counted from
    the batch before the first micro-step (at least 1: an empty update adds nothing)."""
    return max(int(np.sum(batch["targets"] != IGNORE_INDEX)), 1)


def device_valid_targets(batch: Batch) -> np.ndarray:
    """Each device's own valid targets over all its microbatches, [R] (at least 1)."""
    return np.maximum(np.sum(batch["targets"] != IGNORE_INDEX, axis=(1, 2, 3)), 1)


def step(params: Any, apply_fn: Callable, batch: Batch, mesh: Mesh, optimizer: Optimizer) -> Any:
    """Sum / global D on every device, psum, MultiSteps summing: the global token mean."""
    D = global_valid_targets(batch)
    log_denominator(D)
    return run_update(params, apply_fn, batch, mesh, optimizer, D)


def step_microbatch_mean(
    params: Any, apply_fn: Callable, batch: Batch, mesh: Mesh, optimizer: Optimizer
) -> Any:
    """Each device's microbatch token mean, pmean, MultiSteps averaging: microbatch-mean."""
    # What the loop would log: the count device 0's last microbatch was averaged over.
    log_denominator(np.sum(batch["targets"][0, -1] != IGNORE_INDEX))
    return run_update(
        params, apply_fn, batch, mesh, optimizer, None, reduce=jax.lax.pmean, use_grad_mean=True
    )


def step_rank_count(
    params: Any, apply_fn: Callable, batch: Batch, mesh: Mesh, optimizer: Optimizer
) -> Any:
    """Each device divides by its own count of the whole update, pmean: rank-mean."""
    counts = device_valid_targets(batch)  # the bug: never summed over the devices
    log_denominator(counts[0])
    return run_update(params, apply_fn, batch, mesh, optimizer, counts, reduce=jax.lax.pmean)


def step_extra_accum_divide(
    params: Any, apply_fn: Callable, batch: Batch, mesh: Mesh, optimizer: Optimizer
) -> Any:
    """Global D and psum, but MultiSteps' default mean divides by M again."""
    D = global_valid_targets(batch)
    log_denominator(D)
    # The bug: D already covers all M micro-steps.
    return run_update(params, apply_fn, batch, mesh, optimizer, D, use_grad_mean=True)


def step_averaged_grads(
    params: Any, apply_fn: Callable, batch: Batch, mesh: Mesh, optimizer: Optimizer
) -> Any:
    """Global D and a summing MultiSteps, but pmean over the devices: missing-world-size."""
    D = global_valid_targets(batch)
    log_denominator(D)  # D, not R D: not double-reduce-count
    # The bug: pmean averages where D already counts every device.
    return run_update(params, apply_fn, batch, mesh, optimizer, D, reduce=jax.lax.pmean)
