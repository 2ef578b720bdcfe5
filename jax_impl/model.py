r"""The analytic bilinear language model as a Flax module.

For token t with input :math:`x_t`: :math:`z_t = E[x_t]\, U`, with ``embed`` :math:`E` [V, H]
and ``unembed`` :math:`U` [H, V]. The parameter names and shapes are the fixtures' own, so a
dict of numpy arrays ``{"embed": ..., "unembed": ...}`` is a valid ``params`` collection.
"""

from __future__ import annotations

from collections.abc import Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

Params = dict[str, jax.Array]


class BilinearLM(nn.Module):
    """logits = embed[inputs] @ unembed; computes in the dtype of the params it is given."""

    vocab_size: int
    hidden_size: int

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        embed = self.param(
            "embed", nn.initializers.normal(1.0), (self.vocab_size, self.hidden_size)
        )
        unembed = self.param(
            "unembed",
            nn.initializers.normal(1.0 / np.sqrt(self.hidden_size)),
            (self.hidden_size, self.vocab_size),
        )
        return jnp.take(embed, inputs, axis=0) @ unembed


def model_for(params: Mapping[str, np.ndarray | jax.Array]) -> BilinearLM:
    """The module whose parameters have these shapes; raises naming a wrong key or shape."""
    if set(params) != {"embed", "unembed"}:
        raise ValueError(f"params must hold exactly 'embed' and 'unembed', got {sorted(params)}")
    embed_shape, unembed_shape = np.shape(params["embed"]), np.shape(params["unembed"])
    if len(embed_shape) != 2 or unembed_shape != embed_shape[::-1]:
        raise ValueError(
            f"params: embed must be [V, H] and unembed [H, V], got embed {embed_shape} and "
            f"unembed {unembed_shape}"
        )
    return BilinearLM(vocab_size=embed_shape[0], hidden_size=embed_shape[1])


def params_from_numpy(params: Mapping[str, np.ndarray], dtype: jnp.dtype) -> Params:
    """The fixture's float64 params as jax arrays of `dtype` (float64 needs jax_enable_x64)."""
    model_for(params)
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float64 and not jax.config.jax_enable_x64:
        raise ValueError("params_from_numpy: float64 needs jax.config.update('jax_enable_x64', 1)")
    return {key: jnp.asarray(np.asarray(value), dtype=dtype) for key, value in params.items()}


def logits_fn(params: Params, inputs: jax.Array) -> jax.Array:
    """Apply the model to `inputs` [..., T] with `params` given as a plain dict."""
    return model_for(params).apply({"params": params}, inputs)
