r"""Per-token cross-entropy and a microbatch's weighted loss sum :math:`\sum_t a_t l_t`.

Nothing here divides by a denominator: these are the unnormalized pieces that a step sums
over microbatches and ranks before (postnorm) or after (precount) knowing D; a_t comes from
the scheme spec (`jax_impl.spec_counts`).

Dtypes (`jax_impl.denominators`): the cross-entropy :math:`l_t` is computed in at least float32
(bfloat16 logits are upcast before the log-softmax), the product :math:`a_t l_t` in that loss
dtype, and :math:`\sum_t a_t l_t` is summed in the denominator dtype (float64 under
``jax_enable_x64``, else float32). Gradients with respect to the params come back in the
params' dtype: the upcasts are where autodiff casts the cotangents back.

`local_mean_loss`, the loss most training loops write (a microbatch's own token mean), is
here too: it is the microbatch-mean bug when averaged over microbatches.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from jax_impl.batch import IGNORE_INDEX, Batch
from jax_impl.denominators import denominator_dtype, loss_dtype
from jax_impl.model import Params, logits_fn


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


def local_mean_loss(params: Params, microbatch: Batch) -> jax.Array:
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
