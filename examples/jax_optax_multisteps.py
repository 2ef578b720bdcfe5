"""Gradient accumulation with ``optax.MultiSteps`` and a mean loss: the microbatch-mean bug.

Mirrors the common optax recipe for gradient accumulation (the optax "gradient accumulation"
guide, and training loops that wrap their optimizer as ``optax.MultiSteps(tx,
every_k_schedule=k)``): the train step is called once per microbatch, each call takes the
token mean loss of the microbatch on each device, ``jax.lax.pmean`` averages the gradient over
the data-parallel devices, and MultiSteps averages the k micro-step gradients before its inner
optimizer sees them. Written with ``jax.shard_map`` over the "data" mesh axis.

What ``crosscheck verify examples.jax_optax_multisteps:step --scheme token_mean`` says: FAIL
at M > 1. A token of device r, microbatch m weighs 1 / (R M n_rm), with n_rm the valid tokens
of that one microbatch on that one device, instead of 1 / N: the oracle's ``microbatch_mean``
exactly (transformers#34191 is the same bug in torch). At M = 1 it is ``rank_mean``, and
with R = M = 1 it is correct. The fix: ``examples/jax_token_weighted.py``.

Protocol: this step takes ``optimizer`` (the harness passes ``optax.sgd(1.0)``), wraps it in
MultiSteps as the real loop wraps its own, and returns the updates MultiSteps emits on the
M-th micro-step: the inner optimizer's output for the accumulated gradient, which for SGD with
learning rate 1 is minus that gradient. Returning the optimizer's updates rather than a
gradient reconstructed by hand keeps MultiSteps' own averaging in what is verified.
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


def mean_loss(params: Any, apply_fn: Callable, microbatch: dict[str, jax.Array]) -> jax.Array:
    """Token mean of one microbatch on one device (guarded: 0, not NaN, when it has none)."""
    losses, mask = token_losses(params, apply_fn, microbatch)
    return jnp.sum(losses) / jnp.maximum(jnp.sum(mask), 1)


@functools.cache
def accumulate(optimizer: Optimizer, accum_steps: int, dtype: jnp.dtype) -> optax.MultiSteps:
    """The user's optimizer wrapped to apply once every `accum_steps` micro-steps."""
    # optax's MultiSteps keeps its running mean in float32 unless told otherwise, which would
    # round a float64 gradient at ~1e-8; accumulating in the params' dtype leaves only the
    # weighting for verify to find.
    return optax.MultiSteps(optimizer, every_k_schedule=accum_steps, accumulator_dtype=dtype)


@functools.cache
def make_train_step(apply_fn: Callable, tx: optax.MultiSteps, mesh: Mesh) -> Callable:
    """The jitted micro-step, built once per model, optimizer and mesh as a script does (the
    caches let jobs of one shape reuse its compiled code)."""

    def device_grads(params: Any, microbatch: dict[str, jax.Array]) -> Any:
        grads = jax.grad(mean_loss)(device_varying(params), apply_fn, microbatch)
        return jax.lax.pmean(grads, "data")  # the mean over the devices

    grads_fn = jax.shard_map(device_grads, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())

    @jax.jit
    def train_step(params: Any, opt_state: Any, microbatch: dict[str, jax.Array]) -> tuple:
        grads = grads_fn(params, microbatch)
        return tx.update(grads, opt_state, params)

    return train_step


def step(params: Any, apply_fn: Callable, batch: Batch, mesh: Mesh, optimizer: Optimizer) -> Any:
    """One optimizer update over M micro-steps; returns the updates MultiSteps emits."""
    tx = accumulate(optimizer, batch["inputs"].shape[1], jax.tree.leaves(params)[0].dtype)
    train_step = make_train_step(apply_fn, tx, mesh)
    return run_micro_steps(train_step, params, tx.init(params), batch)
