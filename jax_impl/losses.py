r"""Per-token cross-entropy and the per-microbatch loss terms of every scheme.

Each microbatch contributes :math:`(\sum_t a_t l_t,\ d)`; nothing here divides by anything but
the local group sizes inside a_t, so these are the unnormalized pieces that a step sums over
microbatches and ranks before (postnorm) or after (precount) knowing D.

Dtypes (`jax_impl.denominators`): the cross-entropy :math:`l_t` is computed in at least float32
(bfloat16 logits are upcast before the log-softmax), the product :math:`a_t l_t` in that loss
dtype, and :math:`\sum_t a_t l_t` is summed in the denominator dtype (float64 under
``jax_enable_x64``, else float32). Gradients with respect to the params come back in the
params' dtype: the upcasts are where autodiff casts the cotangents back.

The accidental normalizations (a local mean per microbatch or per rank) are here too, because
that is how real training loops write them (see ``jax_impl.accidental``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jax_impl.denominators import denominator_dtype, loss_dtype
from jax_impl.model import Params, logits_fn
from jax_impl.schemes import IGNORE_INDEX, Scheme, SchemeTerms, scheme_terms


class Microbatch(NamedTuple):
    """One microbatch (arrays [B, T]), or a stack of them with leading axes [..., B, T]."""

    inputs: jax.Array
    targets: jax.Array
    segment_ids: jax.Array
    weights: jax.Array


def token_losses(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """l_t = logsumexp(z_t) - z_t[y_t], and exactly 0 where y_t = IGNORE_INDEX.

    Computed in at least float32 (`jax_impl.denominators.loss_dtype`): bfloat16 logits are
    upcast first, as Hugging Face's ``logits.float()`` does. Ignored targets are replaced by
    class 0 before the lookup so that -100 never indexes the logits (an out-of-range gather
    is clamped or NaN depending on the backend); the loss there is then masked by ``where``,
    which also keeps its gradient exactly zero.
    """
    logits = logits.astype(loss_dtype(logits.dtype))
    valid = targets != IGNORE_INDEX
    safe_targets = jnp.where(valid, targets, 0)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, safe_targets)
    return jnp.where(valid, losses, 0)


#: l_t [B, T] of a model, (params, inputs, targets, segment_ids) -> losses (0 where ignored):
#: a step given one trains that model (``jax_impl.transformer.token_losses``); a step given
#: None trains the bilinear model, whose logits read the inputs alone.
TokenLossesFn = Callable[[Params, jax.Array, jax.Array, jax.Array], jax.Array]


def weighted_loss_sum(
    params: Params,
    inputs: jax.Array,
    targets: jax.Array,
    a: jax.Array,
    segment_ids: jax.Array | None = None,
    token_losses_fn: TokenLossesFn | None = None,
) -> jax.Array:
    """sum_t a_t l_t over every token of `inputs` / `targets` (any leading shape).

    a_t l_t in the loss dtype (at least float32), their sum in the denominator dtype: the sum
    is the numerator of L and a logged metric, and is added over microbatches and ranks.
    l_t is `token_losses_fn`'s (it gets `segment_ids`), or the bilinear model's when None.
    """
    if token_losses_fn is None:
        losses = token_losses(logits_fn(params, inputs), targets)
    else:
        losses = token_losses_fn(params, inputs, targets, segment_ids)
    return jnp.sum(a.astype(losses.dtype) * losses, dtype=denominator_dtype())


class MicrobatchLoss(NamedTuple):
    """What one microbatch hands the step: the unnormalized loss and its denominator."""

    loss_sum: jax.Array  # sum_t a_t l_t, denominator dtype
    count: jax.Array  # int32 d channel (counting schemes)
    weight_sum: jax.Array  # d channel of weighted_mean, denominator dtype (rounded once)


def microbatch_loss(
    params: Params, microbatch: Microbatch, scheme: Scheme | str | jax.Array
) -> MicrobatchLoss:
    """(sum_t a_t l_t, d) for one microbatch under `scheme` (static, or a traced index).

    Both d channels and the loss sum are in the denominator dtype or int32, whatever the
    params' dtype (`jax_impl.denominators`).

    >>> import numpy as np
    >>> params = {"embed": np.eye(3, 2), "unembed": np.zeros((2, 3))}
    >>> mb = Microbatch(np.array([[0, 1]]), np.array([[1, -100]]), np.ones((1, 2), int),
    ...                 np.ones((1, 2), np.float32))
    >>> out = microbatch_loss(params, mb, "token_mean")
    >>> round(float(out.loss_sum), 4), int(out.count)  # log 3: uniform over 3 classes
    (1.0986, 1)
    """
    terms: SchemeTerms = scheme_terms(
        scheme, microbatch.targets, microbatch.segment_ids, microbatch.weights
    )
    loss_sum = weighted_loss_sum(params, microbatch.inputs, microbatch.targets, terms.token_weights)
    return MicrobatchLoss(loss_sum, terms.count, terms.weight_sum.value())


def local_mean_loss(params: Params, microbatch: Microbatch) -> jax.Array:
    """The loss most training loops write: the token mean of *this* microbatch only.

    0 when the microbatch has no valid token (real code usually divides 0 by 0 there; the
    oracle's accidental schemes count such a microbatch as contributing nothing, and so does
    this). Averaged over microbatches and ranks it is the microbatch-mean bug of docs/bugs.md
    (transformers#34191, optax.MultiSteps with a mean loss).

    The count is int32 and is converted once, to the denominator dtype, for the division
    (a bfloat16 count of 257 would be 256); the loss sum is in that dtype too.
    """
    valid = microbatch.targets != IGNORE_INDEX
    losses = token_losses(logits_fn(params, microbatch.inputs), microbatch.targets)
    count = jnp.sum(valid, dtype=jnp.int32)
    dtype = denominator_dtype()
    return jnp.sum(losses, dtype=dtype) / jnp.where(count > 0, count, 1).astype(dtype)
