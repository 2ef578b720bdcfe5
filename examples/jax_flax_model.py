"""A small Flax causal LM of your own, in a pmap data-parallel step: one correct, one buggy.

``crosscheck verify --framework jax --model examples.jax_flax_model:model --step
examples.jax_flax_model:step --scheme token_mean``: the step gets this model's params and
``apply`` instead of the analytic model's, and is judged against the intended gradient the same
model gives in float64 (docs/verify.md, "Bring your own model").

``model()`` returns ``(apply_fn, params)``: a one-block pre-norm Transformer (token and
learned position embeddings, causal self-attention, an MLP, tied to nothing) over the
fixtures' 40-token vocabulary, initialized from a fixed PRNGKey, so every call gives the same
params. Rows are independent (causal attention within a row, layer norm per token).

* ``step``: every device sums its tokens' cross-entropy, divides by the valid tokens of the
  whole update (``psum`` of the device counts, before the gradient) and ``psum``s the
  gradients: the global token mean; PASSES.
* ``step_device_mean``: every device divides by its own count and the gradients are
  ``pmean``ed: rank-mean (the classic Flax ``train_step``; ``examples/jax_pmap_mean.py``).

``logits`` is the reference's forward written out (``--forward``), as the default takes it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from examples._jax_common import Batch, token_losses

VOCAB_SIZE = 40
#: The longest row of the built-in fixtures (packed is 8 x 64).
MAX_LENGTH = 64


class TinyCausalLM(nn.Module):
    """logits [..., T, V] of a one-block pre-norm causal Transformer."""

    vocab_size: int = VOCAB_SIZE
    width: int = 32
    heads: int = 4

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        length = inputs.shape[-1]
        positions = self.param("positions", nn.initializers.normal(0.02), (MAX_LENGTH, self.width))
        x = nn.Embed(self.vocab_size, self.width)(inputs) + positions[:length]
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(
            h, h, mask=nn.make_causal_mask(inputs)
        )
        h = nn.LayerNorm()(x)
        x = x + nn.Dense(self.width)(nn.gelu(nn.Dense(2 * self.width)(h)))
        return nn.Dense(self.vocab_size)(nn.LayerNorm()(x))


def model() -> tuple[Callable[..., jax.Array], Any]:
    """(apply_fn, params), the same params every call (PRNGKey 0)."""
    module = TinyCausalLM()
    params = module.init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))
    return module.apply, params


def logits(apply_fn: Callable[..., jax.Array], params: Any, microbatch: dict) -> jax.Array:
    """The logits [B, T, V] the reference's token losses come from (``--forward``): the
    model's of the inputs, as the default forward takes them."""
    return apply_fn(params, microbatch["inputs"])


def device_grads(
    apply_fn: Callable, global_count: bool, params: Any, batch: dict[str, jax.Array]
) -> Any:
    """One device's gradient, reduced over the devices: of its token losses summed and
    divided by the update's count (`global_count`, then summed), or by its own (averaged)."""

    def loss(p: Any) -> jax.Array:
        losses, mask = token_losses(p, apply_fn, batch)
        count = jnp.sum(mask)
        if global_count:  # the count of the whole update, known before the gradient
            return jnp.sum(losses) / jax.lax.psum(count, axis_name="batch")
        # The bug: this device's own count (guarded against an empty device).
        return jnp.sum(losses) / jnp.maximum(count, 1)

    grads = jax.grad(loss)(params)
    if global_count:
        return jax.lax.psum(grads, axis_name="batch")
    return jax.lax.pmean(grads, axis_name="batch")


@functools.cache
def p_grads(apply_fn: Callable, global_count: bool, devices: tuple[jax.Device, ...]) -> Callable:
    """The pmapped step, built once per model and device set."""
    return jax.pmap(
        functools.partial(device_grads, apply_fn, global_count),
        axis_name="batch",
        in_axes=(None, 0),  # params broadcast, batch split over devices
        devices=devices,
    )


def _per_device(batch: Batch) -> dict[str, Any]:
    """Each device's M microbatches as one batch of M * B rows."""
    R, M, B, T = batch["inputs"].shape
    return {key: batch[key].reshape(R, M * B, T) for key in ("inputs", "targets")}


def step(params: Any, apply_fn: Callable, batch: Batch, mesh: Mesh) -> Any:
    """The global token mean: sum / psum'd count, gradients psum'd ([R, ...], replicated)."""
    return p_grads(apply_fn, True, tuple(mesh.devices.flat))(params, _per_device(batch))


def step_device_mean(params: Any, apply_fn: Callable, batch: Batch, mesh: Mesh) -> Any:
    """Each device's own token mean, gradients pmean'd: rank-mean."""
    return p_grads(apply_fn, False, tuple(mesh.devices.flat))(params, _per_device(batch))
