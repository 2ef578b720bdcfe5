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
    out = microbatch_loss(params, mb, "token_mean")  # grads: of out.loss_sum
    updates, state = opt.update(grads_of_loss_sum, state, params, denominator=out.count)

Clipping inside the wrapped optimizer applies to the accumulated gradient, as it should.

The denominator never lives in the gradients' dtype (`jax_impl.denominators`): d accumulates
in ``denominator_dtype`` (int32 by default, exact to 2^31 - 1; float32 or float64 for soft
weights, never narrower), and with bfloat16 gradients the division g / D is formed in float32
(float64 for a float64 D) and rounded once into bfloat16.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jax_impl.batch import Batch
from jax_impl.denominators import refuse_narrow_float
from jax_impl.losses import weighted_loss_sum
from jax_impl.model import Params
from jax_impl.spec import ID_GROUPINGS, SchemeSpec, parse_spec
from jax_impl.spec_counts import rank_spec_terms


class MicrobatchLoss(NamedTuple):
    """What one micro-step hands `token_weighted_accumulation`: the unnormalized loss and
    its denominator contribution d, in two channels (one of them zero)."""

    loss_sum: jax.Array  # sum_t a_t l_t, denominator dtype
    count: jax.Array  # int32 d of the counting specs
    weight_sum: jax.Array  # d of the weight-sum specs, denominator dtype (rounded once)


def _local_to_a_microbatch(spec: SchemeSpec) -> None:
    """Refuse a spec whose a_t or d is not known from one microbatch alone, or whose D is not
    the sum of the micro-steps' d: the accumulation here only ever sees one at a time."""
    w, d = spec.weight, spec.denominator
    why = None
    if spec.scope != "update":
        why = f"its scope is {spec.scope!r} (each unit normalizes by itself: no sum of d)"
    elif d.kind in ("configured", "one"):
        why = f"its D is fixed ({d.kind}), not a sum of the micro-steps' d"
    elif w.group in ID_GROUPINGS or d.group in ID_GROUPINGS:
        why = "a group or document may span microbatches, so its count is not local"
    elif w.group in ("rank", "microbatch") or d.group in ("rank", "microbatch"):
        why = "it counts ranks or microbatches, which one micro-step cannot see"
    elif w.group != "none" and w.count_scope != "update":
        why = f"its counts are per {w.count_scope}"
    if why:
        raise ValueError(
            f"microbatch_loss: the spec {spec.to_dict()} cannot be accumulated one micro-step "
            f"at a time: {why}; use a step of jax_impl (pmap, shard_map, jit), which counts "
            "the whole update first"
        )


def microbatch_loss(
    params: Params, microbatch: Batch, spec: SchemeSpec | Mapping[str, Any] | str
) -> MicrobatchLoss:
    """(sum_t a_t l_t, d) of one microbatch ([B, T] fields) under a spec whose a_t and d are
    local to it (token_mean, sequence_mean, row_mean, weighted_mean, constant, ...).

    Both d channels and the loss sum are in the denominator dtype or int32, whatever the
    params' dtype (`jax_impl.denominators`).

    >>> import numpy as np
    >>> from jax_impl.batch import lay_out_global_batch
    >>> params = {"embed": np.eye(3, 2), "unembed": np.zeros((2, 3))}
    >>> arrays = dict(inputs=np.array([[0, 1]]), targets=np.array([[1, -100]]),
    ...               segment_ids=np.ones((1, 2), int), weights=np.ones((1, 2)))
    >>> mb = jax.tree.map(lambda x: x[0, 0], lay_out_global_batch(arrays, 1, 1, vocab_size=3))
    >>> out = microbatch_loss(params, mb, "token_mean")
    >>> round(float(out.loss_sum), 4), int(out.count)  # log 3: uniform over 3 classes
    (1.0986, 1)
    """
    spec = parse_spec(spec)
    _local_to_a_microbatch(spec)
    stacked = jax.tree.map(lambda x: x[None], microbatch)  # one rank's M = 1 microbatches
    # No count here crosses the microbatch (checked above), so the pre-pass never reduces:
    # the axis is a size-1 vmap only so that the spec code runs as it does inside a step.
    (a, parts), _ = jax.vmap(
        lambda b: rank_spec_terms(spec, b, "microbatch"), axis_name="microbatch"
    )(jax.tree.map(lambda x: x[None], stacked))
    loss_sum = weighted_loss_sum(params, microbatch.inputs, microbatch.targets, a[0, 0])
    return MicrobatchLoss(loss_sum, parts.mb_count[0, 0], parts.mb_weight.value()[0, 0])


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
