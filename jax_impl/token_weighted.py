r"""Token-weighted gradient accumulation as an optax transformation.

``optax.MultiSteps(opt, k)`` averages the k micro-step gradients equally. With a mean loss per
microbatch that is the microbatch-mean bug of docs/bugs.md (transformers#34191): a token in a
microbatch with few valid tokens weighs more than one in a full microbatch. Here every
micro-step passes the gradient of its *unnormalized* loss :math:`\sum_t a_t l_t` together with
its denominator contribution :math:`d`, and the update emitted on the k-th micro-step is

.. math::

    g = \frac{\sum_{m=1}^{k} \nabla \sum_{t \in m} a_t l_t}{\sum_{m=1}^{k} d_m}
      = \nabla L,

the gradient of the scheme's objective over all k microbatches (token_mean: a_t = v_t,
d = valid tokens). Under data parallelism, psum both the gradient and d over ranks before
passing them (postnorm per micro-step): the accumulated ratio is then the global one.

Usage::

    opt = token_weighted_accumulation(optax.chain(optax.clip_by_global_norm(1.0),
                                                  optax.adamw(1e-3)), accum_steps=4)
    loss_sum, d = ...  # jax_impl.losses.microbatch_loss(params, mb, "token_mean")
    updates, state = opt.update(grads_of_loss_sum, state, params, denominator=d)

Clipping inside the wrapped optimizer applies to the accumulated gradient, as it should.

The denominator never lives in the gradients' dtype (`jax_impl.denominators`): d accumulates
in ``denominator_dtype`` (int32 by default, exact to 2^31 - 1; float32 or float64 for soft
weights, never narrower), and with bfloat16 gradients the division g / D is formed in float32
(float64 for a float64 D) and rounded once into bfloat16.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jax_impl.denominators import refuse_narrow_float


class TokenWeightedState(NamedTuple):
    """Micro-step counter, running sums of gradients and d, and the wrapped optimizer's state."""

    mini_step: jax.Array  # int32 in [0, accum_steps)
    gradient_step: jax.Array  # int32, updates emitted so far
    grad_sum: optax.Updates  # sum of the micro-steps' unnormalized gradients
    denominator_sum: jax.Array  # sum of their d, in `denominator_dtype` (int32, float32/64)
    inner_state: optax.OptState


def token_weighted_accumulation(
    inner: optax.GradientTransformation,
    accum_steps: int,
    *,
    denominator_dtype: jnp.dtype | type = jnp.int32,
) -> optax.GradientTransformationExtraArgs:
    """Accumulate `accum_steps` micro-steps; emit the token-weighted update, zeros otherwise.

    `update(grads, state, params, denominator=d)` takes this micro-step's gradient of
    sum_t a_t l_t and its d. Counts accumulate in int32 by default, exact where float32 stops
    being exact past 2^24 (the float32-count bug); pass ``denominator_dtype=jnp.float32`` (or
    float64) for weighted_mean, whose d is a sum of soft weights. A float dtype narrower than
    float32 is refused. When no micro-step carried a token (D = 0) the emitted gradient is
    zero, not NaN.
    """
    if accum_steps < 1:
        raise ValueError(
            f"token_weighted_accumulation: accum_steps must be >= 1, got {accum_steps}"
        )
    inner = optax.with_extra_args_support(inner)
    denominator_dtype = refuse_narrow_float(
        denominator_dtype,
        "token_weighted_accumulation: denominator_dtype={dtype} keeps {bits} significant bits, "
        "so D would be rounded before the division; use int32 for counts, float32 or float64 "
        "for weight sums",
    )
    # The dtype g / D is formed in: at least float32, wider if D is (float64).
    quotient_floor = jnp.promote_types(
        jnp.float32,
        denominator_dtype if jnp.issubdtype(denominator_dtype, jnp.floating) else jnp.float32,
    )

    def init(params: optax.Params) -> TokenWeightedState:
        return TokenWeightedState(
            mini_step=jnp.zeros((), jnp.int32),
            gradient_step=jnp.zeros((), jnp.int32),
            grad_sum=optax.tree.zeros_like(params),
            denominator_sum=jnp.zeros((), denominator_dtype),
            inner_state=inner.init(params),
        )

    def update(
        updates: optax.Updates,
        state: TokenWeightedState,
        params: optax.Params | None = None,
        *,
        denominator: jax.Array | float | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, TokenWeightedState]:
        if denominator is None:
            raise TypeError(
                "token_weighted_accumulation.update needs denominator=d, this micro-step's "
                "denominator contribution (e.g. its number of valid target tokens)"
            )
        denominator = jnp.asarray(denominator)
        if jnp.issubdtype(denominator.dtype, jnp.floating) and not jnp.issubdtype(
            denominator_dtype, jnp.floating
        ):
            raise TypeError(
                f"token_weighted_accumulation: denominator has dtype {denominator.dtype} but "
                f"accumulates as {denominator_dtype}; pass denominator_dtype=jnp.float32 (or "
                "float64) for a soft-weight sum"
            )
        grad_sum = jax.tree.map(jnp.add, state.grad_sum, updates)
        denominator_sum = state.denominator_sum + denominator.astype(denominator_dtype)
        emit = state.mini_step == accum_steps - 1

        def normalize(g: jax.Array) -> jax.Array:
            # Divide in at least float32 and round once into g's dtype: casting D to a
            # bfloat16 gradient's dtype first would round it to 8 bits (1001 -> 1000).
            dtype = jnp.promote_types(g.dtype, quotient_floor)
            D = denominator_sum.astype(dtype)
            return (g.astype(dtype) / jnp.where(D > 0, D, jnp.ones_like(D))).astype(g.dtype)

        # Like optax.MultiSteps, run the wrapped optimizer on every micro-step and keep its
        # result only when emitting: no lax.cond, so this composes with pmap and shard_map.
        inner_updates, inner_state = inner.update(
            jax.tree.map(normalize, grad_sum), state.inner_state, params, **extra_args
        )

        def select(new: Any, old: Any) -> Any:
            return jax.tree.map(lambda n, o: jnp.where(emit, n, o).astype(o.dtype), new, old)

        new_state = TokenWeightedState(
            mini_step=(state.mini_step + 1) % accum_steps,
            gradient_step=state.gradient_step + emit.astype(jnp.int32),
            grad_sum=select(optax.tree.zeros_like(grad_sum), grad_sum),
            denominator_sum=jnp.where(emit, jnp.zeros_like(denominator_sum), denominator_sum),
            inner_state=select(inner_state, state.inner_state),
        )
        emitted = select(inner_updates, optax.tree.zeros_like(inner_updates))
        return emitted, new_state

    return optax.GradientTransformationExtraArgs(init, update)
