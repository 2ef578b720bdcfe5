"""Steps for tests/test_jax_verify.py: one correct, the others broken in one way each.

Imported only by the verify worker (``tests.jax_verify_steps:...``), never by the test process:
the harness side must not import JAX. A step learns which job it is on from the batch shape:
``packed`` is [R, M, B, 64] and ``ragged`` [R, M, B, 24].
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

PACKED_T, RAGGED_T = 64, 24


def _token_mean(params: Any, apply_fn: Callable, batch: dict[str, Any]) -> jax.Array:
    """The global token mean over the whole [R, M, B, T] batch (no collective needed)."""
    valid = batch["targets"] != -100
    logits = apply_fn(params, batch["inputs"])
    losses = optax.softmax_cross_entropy_with_integer_labels(
        logits, jnp.where(valid, batch["targets"], 0)
    )
    return jnp.sum(jnp.where(valid, losses, 0.0)) / jnp.sum(valid)


def correct_grads(params: Any, apply_fn: Callable, batch: dict[str, Any]) -> dict[str, Any]:
    """The token-mean gradient, computed on one device without any data parallelism."""
    return jax.jit(jax.grad(_token_mean), static_argnums=1)(params, apply_fn, batch)


def _job(batch: dict[str, np.ndarray]) -> tuple[str, int, int]:
    R, M, _, T = batch["inputs"].shape
    return {PACKED_T: "packed", RAGGED_T: "ragged"}[T], R, M


def _check_the_batch(batch: dict[str, np.ndarray]) -> None:
    raise ValueError(f"boom: this step rejects a batch of shape {batch['inputs'].shape}")


def misbehaving(params: Any, apply_fn: Callable, batch: dict[str, np.ndarray], mesh: Any) -> Any:
    """A different failure per job; correct on ragged R=2 M=1; kills its process last."""
    grads = correct_grads(params, apply_fn, batch)
    job = _job(batch)
    if job == ("packed", 1, 1):
        _check_the_batch(batch)  # raises from a helper: the traceback must show both frames
    if job == ("packed", 2, 1):
        return {"embed": grads["embed"].T, "unembed": grads["unembed"]}
    if job == ("packed", 1, 2):
        return {"embedding": grads["embed"], "unembed": grads["unembed"]}
    if job == ("packed", 2, 2):
        # pmap-style output whose replicas were never synchronized.
        stacked = {key: jnp.stack([value, 2 * value]) for key, value in grads.items()}
        return stacked
    if job == ("ragged", 1, 2):
        os._exit(3)  # the worker dies: no result for this job, the earlier ones stay
    return grads


def hangs_on_ragged(params: Any, apply_fn: Callable, batch: dict[str, Any], mesh: Any) -> Any:
    """Correct on packed; sleeps (far past any test's time limit) on ragged."""
    if _job(batch)[0] == "ragged":
        time.sleep(3600)
    return correct_grads(params, apply_fn, batch)


NOT_A_FUNCTION = 42


def _bf16(params: Any) -> Any:
    return jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)


def _losses_f32(params: Any, apply_fn: Callable, batch: dict[str, Any]) -> tuple:
    """Per-token losses of a bf16 model (logits upcast to float32), and the valid mask."""
    valid = batch["targets"] != -100
    logits = apply_fn(params, batch["inputs"]).astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(
        logits, jnp.where(valid, batch["targets"], 0)
    )
    return jnp.where(valid, losses, 0.0), valid


def bf16_params(params: Any, apply_fn: Callable, batch: dict[str, Any], mesh: Any) -> Any:
    """The correct token mean, computed by a model whose params the step casts to bf16: it
    returns the bf16 gradient."""

    def loss(p):
        losses, valid = _losses_f32(p, apply_fn, batch)
        return jnp.sum(losses) / jnp.sum(valid)

    return jax.jit(jax.grad(loss))(_bf16(params))


def bf16_params_microbatch_mean(
    params: Any, apply_fn: Callable, batch: dict[str, Any], mesh: Any
) -> Any:
    """The same bf16 model, each microbatch's own token mean averaged over R x M."""

    def loss(p):
        losses, valid = _losses_f32(p, apply_fn, batch)
        per_mb = jnp.sum(losses, axis=(-2, -1)) / jnp.maximum(jnp.sum(valid, axis=(-2, -1)), 1)
        return jnp.mean(per_mb)

    return jax.jit(jax.grad(loss))(_bf16(params))


def bf16_compute(params: Any, apply_fn: Callable, batch: dict[str, Any], mesh: Any) -> Any:
    """The correct token mean computed in bf16 inside the loss (as mixed precision does), the
    gradient handed back in the params' own dtype."""

    def loss(p):
        losses, valid = _losses_f32(_bf16(p), apply_fn, batch)
        return jnp.sum(losses) / jnp.sum(valid)

    return jax.jit(jax.grad(loss))(params)


def dies_on_one_sleeps_on_others(
    params: Any, apply_fn: Callable, batch: dict[str, Any], mesh: Any
) -> Any:
    """Kills its process at once on ragged R=1 M=2; takes 1.5 s on packed, then is correct."""
    job = _job(batch)
    if job == ("ragged", 1, 2):
        os._exit(3)
    if job[0] == "packed":
        time.sleep(1.5)
    return correct_grads(params, apply_fn, batch)
