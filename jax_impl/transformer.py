r"""The small decoder-only transformer in JAX: a pure function of a flat params dict.

For a row of tokens :math:`x_t` with segment ids :math:`s_t` (packed documents; 0 = padding):

.. math::

    h_t &= E[x_t] + P[\mathrm{pos}_t], \qquad \mathrm{pos}_t = t - \text{(start of t's run of
    equal } s\text{)},\ 0 \text{ on padding}\\
    h &\leftarrow h + \mathrm{Attn}(\mathrm{LN}_1 h)\, W_{out}, \qquad
    h \leftarrow h + \mathrm{gelu}(\mathrm{LN}_2(h)\, W_{up})\, W_{down} \quad\text{per layer}\\
    z_t &= \mathrm{LN}_f(h_t)\, U

Attention has ``heads`` heads on q, k, v = split(LN_1(h) W_qkv), scores
:math:`q_i \cdot k_j / \sqrt{W/\text{heads}}`, and i sees j iff :math:`j \le i` and
:math:`s_i = s_j`; a padding token (segment 0) sees only itself, so no softmax row is empty.
:math:`\mathrm{LN}(z) = (z - \bar z)/\sqrt{\mathrm{var}\, z + \epsilon}\, \gamma + \beta`
(biased variance); :math:`\mathrm{gelu}(z) = \tfrac12 z(1 + \tanh(\sqrt{2/\pi}(z + 0.044715
z^3)))`.

Params are the flat dict of the shared weights file (``embed``, ``positions``,
``layer0.ln1.scale``, ..., ``unembed``; ``crosscheck.fixtures.transformer_weights`` is data
only). Everything here is jnp on that dict: jit-able, differentiable, and usable inside
``shard_map`` (no collective, no Python branch on values). Written for JAX on its own, not
ported from the torch model: comparing the two is one of the checks.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from crosscheck.fixtures.transformer_weights import (
    TRANSFORMER_CONFIG,
    TransformerConfig,
    initial_weights,
)
from jax_impl.context_parallel import context_positions

IGNORE_INDEX = -100
Params = dict[str, jax.Array]


def initial_params(dtype: jnp.dtype = jnp.float64) -> Params:
    """The committed initial weights as jax arrays of `dtype` (float64 needs x64 enabled)."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float64 and not jax.config.jax_enable_x64:
        raise ValueError(
            "initial_params: float64 needs jax.config.update('jax_enable_x64', True) first, "
            "otherwise JAX silently makes the weights float32"
        )
    return {name: jnp.asarray(value, dtype=dtype) for name, value in initial_weights().items()}


def layer_norm(z: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """(z - mean) / sqrt(var + eps) * scale + bias over the last axis, biased variance."""
    centred = z - jnp.mean(z, axis=-1, keepdims=True)
    variance = jnp.mean(jnp.square(centred), axis=-1, keepdims=True)
    return centred * jax.lax.rsqrt(variance + eps) * scale + bias


def gelu_tanh(z: jax.Array) -> jax.Array:
    """0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3))), written out."""
    return 0.5 * z * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (z + 0.044715 * z**3)))


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """pos_t [B, T]: t minus the start of its run of equal segment ids; 0 on padding."""
    T = segment_ids.shape[-1]
    index = jnp.broadcast_to(jnp.arange(T), segment_ids.shape)
    changed = jnp.concatenate(
        [
            jnp.ones_like(segment_ids[..., :1], dtype=bool),
            segment_ids[..., 1:] != segment_ids[..., :-1],
        ],
        axis=-1,
    )
    run_start = jax.lax.cummax(jnp.where(changed, index, 0), axis=segment_ids.ndim - 1)
    return jnp.where(segment_ids == 0, 0, index - run_start)


def attention_mask(segment_ids: jax.Array) -> jax.Array:
    """[B, T, T] bool: i sees j iff j <= i and s_i = s_j != 0, or i = j (padding)."""
    T = segment_ids.shape[-1]
    i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
    same = segment_ids[..., :, None] == segment_ids[..., None, :]
    document = (segment_ids != 0)[..., :, None]
    return ((j <= i) & same & document) | (i == j)


def _attention(
    h: jax.Array,
    qkv: jax.Array,
    out: jax.Array,
    mask: jax.Array,
    heads: int,
    context: ContextShard | None = None,
) -> jax.Array:
    B, T, W = h.shape
    head = W // heads
    q, k, v = jnp.split(h @ qkv, 3, axis=-1)
    if context is not None:  # this shard's queries against every shard's keys and values
        k, v = context.gather(k), context.gather(v)
    q, k, v = (y.reshape(B, -1, heads, head) for y in (q, k, v))
    scores = jnp.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(head)
    # Masked scores are -inf: exp gives exactly 0, and where() keeps their gradient 0.
    scores = jnp.where(mask[:, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    mixed = jnp.einsum("bhij,bjhd->bihd", probs, v).reshape(B, T, W)
    return mixed @ out


class ContextShard(NamedTuple):
    """Context parallel inside ``shard_map``: the mesh axis whose C ranks split every row, and
    the order they split it in (contiguous, or zigzag: `jax_impl.context_parallel`)."""

    axis: str
    order: str

    def gather(self, x: jax.Array) -> jax.Array:
        """[B, T/C, ...] of every context rank, rank by rank along the positions. Its
        transpose sums the gradient over the ranks: each rank's loss reads every rank's keys
        and values."""
        return jax.lax.all_gather(x, self.axis, axis=1, tiled=True)

    def layout(self, shard_len: int) -> tuple[np.ndarray, jax.Array]:
        """(the position of each gathered entry [T], static; this rank's positions [T/C])."""
        C = jax.lax.axis_size(self.axis)
        positions = context_positions(shard_len * C, C, self.order)  # [C, T/C]
        return positions.ravel(), jnp.asarray(positions)[jax.lax.axis_index(self.axis)]


def transformer_logits(
    params: Params,
    inputs: jax.Array,
    segment_ids: jax.Array,
    config: TransformerConfig = TRANSFORMER_CONFIG,
    context: ContextShard | None = None,
) -> jax.Array:
    """logits [B, T, V] of inputs and segment_ids [B, T] (module docstring), in the params'
    dtype. Shapes are checked at trace time; values cannot be inside jit (an id outside the
    tables is clamped by the gather), so a caller validates its batch first.

    Under context parallel (`context`, inside ``shard_map``) the arrays are this rank's shard
    [B, T/C] and so are the logits; positions and the attention mask are the whole rows'
    (the segment ids gathered over the context axis), and attention reads every shard's keys
    and values, as torchtitan's context parallel does."""
    if inputs.ndim != 2 or segment_ids.shape != inputs.shape:
        raise ValueError(
            f"transformer_logits: inputs and segment_ids must both be [B, T], got "
            f"{inputs.shape} and {segment_ids.shape}"
        )
    if inputs.shape[1] > config.max_positions:
        raise ValueError(
            f"transformer_logits: rows of {inputs.shape[1]} tokens exceed the "
            f"{config.max_positions} positions the model has"
        )
    eps = config.ln_eps
    if context is not None:
        T = inputs.shape[1] * jax.lax.axis_size(context.axis)
        if config.max_positions < T:
            raise ValueError(
                f"transformer_logits: rows of {T} tokens (every context shard's) exceed the "
                f"{config.max_positions} positions the model has"
            )
    if context is None:
        positions, mask = segment_positions(segment_ids), attention_mask(segment_ids)
    else:
        key_positions, own = context.layout(segment_ids.shape[-1])
        gathered = context.gather(segment_ids)  # [B, T] in the gathered order
        whole = gathered[:, np.argsort(key_positions, kind="stable")]  # in position order
        positions = jnp.take(segment_positions(whole), own, axis=-1)
        # Rows: this shard's queries; columns: the gathered keys, in their gathered order.
        mask = jnp.take(attention_mask(whole), own, axis=1)[:, :, key_positions]
    x = jnp.take(params["embed"], inputs, axis=0)
    x = x + jnp.take(params["positions"], positions, axis=0)
    for i in range(config.layers):
        p = f"layer{i}."
        h = layer_norm(x, params[p + "ln1.scale"], params[p + "ln1.bias"], eps)
        x = x + _attention(h, params[p + "qkv"], params[p + "out"], mask, config.heads, context)
        h = layer_norm(x, params[p + "ln2.scale"], params[p + "ln2.bias"], eps)
        x = x + gelu_tanh(h @ params[p + "up"]) @ params[p + "down"]
    x = layer_norm(x, params["final_ln.scale"], params["final_ln.bias"], eps)
    return x @ params["unembed"]


def token_losses(
    params: Params, inputs: jax.Array, targets: jax.Array, segment_ids: jax.Array
) -> jax.Array:
    r"""l_t = logsumexp(z_t) - z_t[y_t] [B, T], exactly 0 (value and gradient) where
    y_t = IGNORE_INDEX. In at least float32: a bfloat16 model's logits are upcast first.

    Its signature is the ``token_losses_fn`` a `jax_impl.update.StepConfig` takes to train
    this model.
    """
    return _losses(transformer_logits(params, inputs, segment_ids), targets)


def context_parallel_token_losses(order: str, axis: str = "context"):
    """The ``token_losses_fn`` of a context-parallel update (`jax_impl.context_parallel`):
    `token_losses` of this rank's shard, attending across the shards of `axis`."""
    context = ContextShard(axis, order)

    def losses(params, inputs, targets, segment_ids):
        logits = transformer_logits(params, inputs, segment_ids, context=context)
        return _losses(logits, targets)

    return losses


def _losses(logits: jax.Array, targets: jax.Array) -> jax.Array:
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    valid = targets != IGNORE_INDEX
    # -100 must never index the logits: class 0 stands in, and where() drops it.
    safe = jnp.where(valid, targets, 0)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(log_probs, safe[..., None], axis=-1)[..., 0]
    return jnp.where(valid, -picked, 0)


def numpy_params(params: Params) -> dict[str, np.ndarray]:
    """float64 numpy copies, keyed like the weights file (for comparisons)."""
    return {name: np.asarray(value, dtype=np.float64) for name, value in params.items()}
