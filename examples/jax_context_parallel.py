r"""A context-parallel step in JAX: every row's positions split over the "context" mesh axis.

The step gets a 2-D ("data", "context") mesh of R x C devices and its batch already split:
every token array is [R, C, M, B, T/C], context rank c's positions of data rank r's rows at
``[r, c]`` (contiguous, or two chunks in the load-balanced zigzag order of Megatron-LM and
torchtitan; ``context.positions`` says which). Under ``jax.shard_map`` each device holds one
shard; the count it divides by must cover every data *and* context rank:

.. math::  g = \frac{1}{D} \sum_{r,c,m} \sum_{t \in \text{shard}} v_t \nabla l_t,
    \qquad D = \sum_{r,c,m} n_{rcm},

the global token mean of the rows without the split. ``step`` counts first (one ``psum``
over both axes), differentiates each device's summed token losses over D and ``psum``\ s the
gradient over both axes: ``crosscheck verify`` PASSES it against token_mean.

The variants are the bugs of the context split, each named by the diagnosis:

* ``step_local_count``: each device divides by its own shard's count and the gradient is
  averaged (Megatron-LM#7513): ``cp-local-count``;
* ``step_count_over_dp_only``: the count is ``psum``\ ed over "data" only (verl#5993,
  prime-rl#2359): ``cp-count-over-dp-only``;
* ``step_missing_cp_compensation``: the gradient is summed over "data" but averaged over
  "context", as a loop that treats the context ranks as replicas does (slime#990):
  ``missing-cp-compensation``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from crosscheck import log_denominator
from examples._jax_common import Batch, token_losses

AXES = ("data", "context")


def shard_sum_and_count(params: Any, apply_fn: Callable, shard: dict) -> tuple[jax.Array, Any]:
    """One device's summed token losses over its M microbatches, and its valid targets. The
    bilinear model's tokens do not interact, so a shard's logits are its positions' logits;
    a transformer would gather keys and values over "context" here (ring attention)."""
    losses, mask = token_losses(params, apply_fn, shard)
    return jnp.sum(losses), jnp.sum(mask, dtype=jnp.int32)


@functools.cache
def make_step(
    apply_fn: Callable, mesh: Mesh, count_axes: tuple[str, ...], grad_reduction: str
) -> Callable:
    """The jitted step: the count reduced over `count_axes` (() leaves it the shard's own),
    the gradient of the shard's sum / count reduced by ``psum`` over both axes ("sum"), by
    ``pmean`` over both ("mean"), or summed over "data" and averaged over "context"
    ("sum-data-mean-context")."""

    def device_step(params: Any, shard: dict) -> tuple[Any, jax.Array]:
        shard = {key: value[0, 0] for key, value in shard.items()}  # [M, B, T/C]
        _, count = shard_sum_and_count(params, apply_fn, shard)
        if count_axes:
            count = jax.lax.psum(count, count_axes)
        denominator = jnp.maximum(count, 1).astype(jnp.float64)
        varying = jax.lax.pcast(params, AXES, to="varying")  # each device its own gradient
        grads = jax.grad(lambda p: shard_sum_and_count(p, apply_fn, shard)[0] / denominator)(
            varying
        )
        if grad_reduction == "sum":
            grads = jax.lax.psum(grads, AXES)
        elif grad_reduction == "mean":
            grads = jax.lax.pmean(grads, AXES)
        else:
            grads = jax.lax.pmean(jax.lax.psum(grads, "data"), "context")
        return grads, denominator[None, None]  # [R, C]: every device's D

    return jax.jit(
        jax.shard_map(device_step, mesh=mesh, in_specs=(P(), P(*AXES)), out_specs=(P(), P(*AXES)))
    )


def _run(params: Any, apply_fn: Callable, batch: Batch, mesh: Mesh, *how: Any) -> Any:
    grads, denominator = make_step(apply_fn, mesh, *how)(params, batch)
    log_denominator(denominator[0, 0])  # device (0, 0)'s D, where a loop would log it
    return grads


def step(params: Any, apply_fn: Callable, batch: Batch, mesh: Mesh, context: Any) -> Any:
    """The global count over data x context; the gradient summed over both axes."""
    return _run(params, apply_fn, batch, mesh, AXES, "sum")


def step_local_count(params: Any, apply_fn: Callable, batch: Batch, mesh: Mesh, context: Any):
    """Bug: each device's own shard count, the gradient averaged (cp-local-count)."""
    return _run(params, apply_fn, batch, mesh, (), "mean")


def step_count_over_dp_only(
    params: Any, apply_fn: Callable, batch: Batch, mesh: Mesh, context: Any
) -> Any:
    """Bug: the count reduced over "data" only (cp-count-over-dp-only)."""
    return _run(params, apply_fn, batch, mesh, ("data",), "sum")


def step_missing_cp_compensation(
    params: Any, apply_fn: Callable, batch: Batch, mesh: Mesh, context: Any
) -> Any:
    """Bug: the right count, the gradient averaged over "context" (missing-cp-compensation)."""
    return _run(params, apply_fn, batch, mesh, AXES, "sum-data-mean-context")
