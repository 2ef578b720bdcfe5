r"""The gradient of a spec's objective, per rank (pmap, shard_map, multi-process) or global.

With K units of the spec's scope U (1, R or R M) and D_u from `jax_impl.spec_counts`,

.. math::

    L = \frac{1}{K} \sum_u \frac{\sum_{t \in u} a_t l_t}{D_u},

a unit with D_u = 0 contributing 0 (its scale is 0, not 1/0). Per rank, `spec_rank_gradients`
(a `jax_impl.accumulate.RankGradientsFn` once the spec and strategy are bound: see
`SpecGradients` and `spec_step_config`; the scheme index and constant normalizer it is
handed are ignored, the spec says everything):

precount
    the pre-pass psum carries the count vectors and, for U = update, D's channels; then each
    microbatch m backpropagates :math:`(\sum a l) \cdot s / (K D_{u(m)})` with s = 1 under
    psum and s = R under pmean, and the gradient collective runs once.
postnorm
    U = update: the unnormalized sums are backpropagated and the gradient, the loss sums and
    D's channels reduced in one psum, then divided by D (the count vectors, needed for a_t,
    went first). U = rank or microbatch: the normalization is local (what rank_mean and
    microbatch_mean are): a rank's sum divided by its D_r, or each microbatch's by its D_rm,
    then one psum and the division by K.

For U = update the arithmetic is that of `jax_impl.accumulate.rank_gradients` (same D
channels, same scale s / D, same accumulation), so a v1 scheme written as a spec gives the
same bits. The global-view form (`spec_global_gradients`) computes the same per-rank terms
under ``vmap`` with the mesh's axis name (psum is then a sum over the rank axis) and writes
the sum over ranks directly, as `jax_impl.global_step` does.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jax_impl.accumulate import Collective, RankGradients, Strategy, accumulate_microbatches
from jax_impl.denominators import (
    ExactSum,
    denominator_dtype,
    divide_by_denominator,
    exact_sum,
    rank_slots,
)
from jax_impl.losses import TokenLossesFn, token_losses, weighted_loss_sum
from jax_impl.model import Params, logits_fn
from jax_impl.schemes import IGNORE_INDEX, safe_denominator
from jax_impl.spec import SchemeSpec, parse_spec
from jax_impl.spec_batch import SpecBatch
from jax_impl.spec_counts import DenominatorParts, rank_spec_terms
from jax_impl.update import ReducedGradients, StepConfig


def unit_count(spec: SchemeSpec, world_size: int, accum_steps: int) -> int:
    """K: the number of units of the spec's scope in one update."""
    return {"update": 1, "rank": world_size, "microbatch": world_size * accum_steps}[spec.scope]


def _assemble(spec: SchemeSpec, count: jax.Array, weight: ExactSum, parts: DenominatorParts):
    """D of a unit from its summed channels: the int32 count converted once, the weight pair
    rounded once (as `jax_impl.schemes.global_denominator`), the derived parts added; or the
    configured value, or 1."""
    dtype = denominator_dtype()
    kind = spec.denominator.kind
    if kind == "configured":
        return jnp.zeros_like(weight.hi) + jnp.asarray(spec.denominator.value, dtype)
    if kind == "one":
        return jnp.ones_like(weight.hi)
    if parts.derived_count is not None:
        count = count + parts.derived_count
    D = count.astype(dtype) + weight.value()
    return D if parts.derived_float is None else D + parts.derived_float


def _update_channels(parts: DenominatorParts, axis_name: str) -> tuple[jax.Array, ExactSum]:
    """This rank's additive channels for a psum over ranks: the int32 count (the M
    microbatches' and the rank-level one) and the weight pair in this rank's slot."""
    count = jnp.sum(parts.mb_count, dtype=jnp.int32) + parts.rank_count
    return count, rank_slots(exact_sum(parts.mb_weight), axis_name)


def _local_denominators(spec: SchemeSpec, parts: DenominatorParts) -> jax.Array:
    """D_u for U = rank (a scalar) or microbatch ([M]), from local parts only."""
    if spec.scope == "rank":
        count = jnp.sum(parts.mb_count, dtype=jnp.int32) + parts.rank_count
        return _assemble(spec, count, exact_sum(parts.mb_weight), parts)
    return _assemble(spec, parts.mb_count, parts.mb_weight, parts)


def _unit_scale(D: jax.Array, numerator: float | jax.Array, units: int) -> jax.Array:
    """numerator / (K D) where D > 0, else 0: a unit without denominator adds nothing."""
    dtype = denominator_dtype()
    safe = safe_denominator(D)
    denominator = safe if units == 1 else jnp.asarray(units, dtype) * safe
    return jnp.where(D > 0, jnp.asarray(numerator, dtype) / denominator, 0)


def _scan_scaled(
    params: Params, batch: SpecBatch, a: jax.Array, scale: jax.Array, inverse_D: jax.Array,
    token_losses_fn: TokenLossesFn | None = None,
) -> tuple[Params, jax.Array]:  # fmt: skip
    """sum over microbatches of grad((sum a l)_m * scale_m) with a per-microbatch `scale`
    [M] (`accumulate_microbatches` takes one scalar), and sum_m (sum a l)_m * inverse_D_m."""

    def scaled_loss(p, inputs, targets, weights, s, segments):
        loss_sum = weighted_loss_sum(p, inputs, targets, weights, segments, token_losses_fn)
        return loss_sum * s, loss_sum

    grad_fn = jax.grad(scaled_loss, has_aux=True)

    def micro_step(carry, xs):
        grads_acc, normalized_acc = carry
        *xs, inverse, segments = xs
        grads, loss_sum = grad_fn(params, *xs, segments)
        grads_acc = jax.tree.map(jnp.add, grads_acc, grads)
        return (grads_acc, normalized_acc + loss_sum * inverse), None

    # Zeros built from the data: under shard_map they vary across ranks, as the carry must.
    zero = jnp.zeros_like(a, shape=(), dtype=denominator_dtype())
    zeros = jax.tree.map(lambda p: jnp.zeros_like(a, shape=p.shape, dtype=p.dtype), params)
    xs = (batch.inputs, batch.targets, a, scale, inverse_D, batch.segment_ids)
    (grads, normalized), _ = jax.lax.scan(micro_step, (zeros, zero), xs)
    return grads, normalized


def spec_rank_gradients(
    params: Params,
    rank_batch: SpecBatch,
    scheme: jax.Array | None,
    constant_normalizer: jax.Array | None,
    axis_name: str,
    *,
    spec: SchemeSpec,
    strategy: Strategy = Strategy.PRECOUNT,
    collective: Collective = Collective.PSUM,
    scale_override: float | None = None,
    token_losses_fn: TokenLossesFn | None = None,
) -> RankGradients:
    """The reduced gradient of `spec`'s objective; call inside `axis_name`'s mapping.

    `scheme` and `constant_normalizer` (the `RankGradientsFn` arguments) are ignored;
    `token_losses_fn` is the model's l_t (None: the bilinear model).
    For U = update the reported denominator is D and the per-rank loss sum is sum a l; for
    U = rank or microbatch they are K and the rank's sum over its units of (sum a l) / D_u
    (as `jax_impl.accidental` reports them), so that loss = psum(loss sums) / D either way.
    """
    del scheme, constant_normalizer
    world_size = jax.lax.axis_size(axis_name)
    M = rank_batch.targets.shape[0]
    K = unit_count(spec, world_size, M)
    dtype = denominator_dtype()
    if strategy is Strategy.POSTNORM and (
        collective is not Collective.PSUM or scale_override is not None
    ):
        raise ValueError("postnorm takes collective=psum and no scale override")
    s = world_size if collective is Collective.PMEAN else 1
    s = s if scale_override is None else scale_override
    local_valid = jnp.sum(rank_batch.targets != IGNORE_INDEX, dtype=jnp.int32)
    precount_update = strategy is Strategy.PRECOUNT and spec.scope == "update"
    join = functools.partial(_update_channels, axis_name=axis_name) if precount_update else None
    terms, reduced = rank_spec_terms(spec, rank_batch, axis_name, join)
    a, parts = terms

    if spec.scope == "update":
        if strategy is Strategy.PRECOUNT:
            total_count, slots = reduced
            D = _assemble(spec, total_count, exact_sum(slots), parts)
            grads, local_loss = accumulate_microbatches(
                params, rank_batch, a, _unit_scale(D, s, 1), token_losses_fn=token_losses_fn
            )
            reduce_grads = jax.lax.pmean if collective is Collective.PMEAN else jax.lax.psum
            grads = reduce_grads(grads, axis_name)
            total_loss = jax.lax.psum(local_loss, axis_name)
        else:
            one = jnp.ones((), dtype)
            grad_sums, local_loss = accumulate_microbatches(
                params, rank_batch, a, one, token_losses_fn=token_losses_fn
            )
            count, slots = _update_channels(parts, axis_name)
            grad_sums, total_loss, total_count, slots = jax.lax.psum(
                (grad_sums, local_loss, count, slots), axis_name
            )
            D = _assemble(spec, total_count, exact_sum(slots), parts)
            grads = divide_by_denominator(grad_sums, safe_denominator(D))
            grads = jax.tree.map(lambda g: jnp.where(D > 0, g, jnp.zeros_like(g)), grads)
        loss = jnp.where(D > 0, total_loss / safe_denominator(D), 0)
        return RankGradients(grads, local_valid, local_loss, D, loss)

    # U = rank or microbatch: every unit's D is local, and so is its normalization.
    D_units = jnp.broadcast_to(_local_denominators(spec, parts), (M,))
    inverse_D = _unit_scale(D_units, 1, 1)
    K_ = jnp.asarray(K, dtype)
    if strategy is Strategy.PRECOUNT:
        # Each microbatch's sum scaled by s / (K D_u) before its backward, then the collective.
        grads, local_loss = _scan_scaled(
            params, rank_batch, a, _unit_scale(D_units, s, K), inverse_D, token_losses_fn
        )
        grads = (jax.lax.pmean if collective is Collective.PMEAN else jax.lax.psum)(
            grads, axis_name
        )
    elif spec.scope == "rank":
        # The rank's unnormalized sum, divided by its own D_r, summed over ranks, / K.
        one = jnp.ones((), dtype)
        grad_sums, loss_sum = accumulate_microbatches(
            params, rank_batch, a, one, token_losses_fn=token_losses_fn
        )
        D_r = D_units[0]
        grads = divide_by_denominator(grad_sums, safe_denominator(D_r))
        grads = jax.tree.map(lambda g: jnp.where(D_r > 0, g, jnp.zeros_like(g)), grads)
        grads = divide_by_denominator(jax.lax.psum(grads, axis_name), K_)
        local_loss = loss_sum * inverse_D[0]
    else:
        # A microbatch's own D_rm is applied where its sum is formed (the accumulation adds
        # the microbatches' normalized gradients); summed over ranks, then / K.
        grads, local_loss = _scan_scaled(
            params, rank_batch, a, inverse_D, inverse_D, token_losses_fn
        )
        grads = divide_by_denominator(jax.lax.psum(grads, axis_name), K_)
    # local_loss: the rank's sum over its units of (sum a l) / D_u.
    total = jax.lax.psum(local_loss, axis_name)
    return RankGradients(grads, local_valid, local_loss, K_, total / K_)


@dataclass(frozen=True)
class SpecGradients:
    """A spec's per-rank gradient with its strategy bound: a `RankGradientsFn` for
    ``StepConfig(gradients=...)`` (pmap, shard_map, multi-process), which also knows its
    global-view form (`global_view`, used by `jax_impl.global_step`). Build the whole config
    with `spec_step_config`, so that the config's strategy and collective say the same."""

    spec: SchemeSpec
    strategy: Strategy = Strategy.PRECOUNT
    collective: Collective = Collective.PSUM
    scale_override: float | None = None
    #: The model's l_t (``jax_impl.losses.TokenLossesFn``); None: the bilinear model.
    token_losses_fn: TokenLossesFn | None = None

    def __call__(
        self,
        params: Params,
        rank_batch: SpecBatch,
        scheme: jax.Array | None,
        constant_normalizer: jax.Array | None,
        axis_name: str,
    ) -> RankGradients:
        return spec_rank_gradients(
            params, rank_batch, scheme, constant_normalizer, axis_name, spec=self.spec,
            strategy=self.strategy, collective=self.collective,
            scale_override=self.scale_override, token_losses_fn=self.token_losses_fn,
        )  # fmt: skip

    def global_view(self, params: Params, batch: SpecBatch, axis_name: str) -> ReducedGradients:
        """`spec_global_gradients`: no collective, hence psum and no reduction factor only."""
        if self.collective is not Collective.PSUM or self.scale_override is not None:
            raise ValueError("global-view jit writes the sum itself: psum, no scale override")
        return spec_global_gradients(
            params, batch, self.spec, strategy=self.strategy, axis_name=axis_name
        )


def spec_step_config(
    spec: SchemeSpec | Mapping[str, Any] | str,
    optimizer: optax.GradientTransformation,
    *,
    strategy: Strategy | str = Strategy.PRECOUNT,
    collective: Collective | str = Collective.PSUM,
    **config: Any,
) -> StepConfig:
    """A `StepConfig` whose per-rank gradient is `spec`'s (any front-end); `config` passes
    the other StepConfig fields (max_grad_norm, axis_name, check_finite, reduce_factor)."""
    strategy, collective = Strategy(strategy), Collective(collective)
    gradients = SpecGradients(parse_spec(spec), strategy, collective, config.get("reduce_factor"))
    return StepConfig(
        optimizer=optimizer, strategy=strategy, collective=collective, gradients=gradients,
        **config,
    )  # fmt: skip


def spec_global_gradients(
    params: Params,
    batch: SpecBatch,
    spec: SchemeSpec,
    *,
    strategy: Strategy = Strategy.PRECOUNT,
    axis_name: str = "data",
) -> ReducedGradients:
    """The gradient of one update over the global [R, M, B, T] batch (global-view jit).

    The labels-only per-rank terms run under ``vmap(axis_name=...)``, so their psums are
    sums over the rank axis; the gradient is one scan over the M global microbatches of
    sum over ranks of (sum a l)_{rm} * scale_{rm}, divided by D afterwards in postnorm with
    U = update (for U = rank or microbatch there is no reduction to postpone: each unit's
    scale 1 / (K D_u) is applied where its sums are formed).
    """
    R, M = batch.targets.shape[:2]
    K = unit_count(spec, R, M)
    dtype = denominator_dtype()
    postnorm_update = strategy is Strategy.POSTNORM and spec.scope == "update"

    def per_rank(rank_batch: SpecBatch):
        join = functools.partial(_update_channels, axis_name=axis_name)
        terms, reduced = rank_spec_terms(spec, rank_batch, axis_name, join)
        if spec.scope == "update":
            D = _assemble(spec, reduced[0], exact_sum(reduced[1]), terms.parts)
            scale = _unit_scale(D, 1, 1)
            D_units = jnp.broadcast_to(D, (M,))
        else:
            D_units = jnp.broadcast_to(_local_denominators(spec, terms.parts), (M,))
            scale = _unit_scale(D_units, 1, K)
        return terms.token_weights, jnp.broadcast_to(scale, (M,)), D_units

    a, scale, D_units = jax.vmap(per_rank, axis_name=axis_name)(batch)  # [R, M, ...]
    if postnorm_update:
        scale = jnp.ones_like(scale)

    def scaled_loss(p: Params, inputs, targets, weights, s):
        losses = token_losses(logits_fn(p, inputs), targets)
        per_rank = jnp.sum(weights.astype(losses.dtype) * losses, axis=(1, 2), dtype=dtype)
        if spec.scope == "update":  # one scalar scale: global_step's arithmetic
            return jnp.sum(per_rank) * s[0], (per_rank, per_rank * s)
        return jnp.sum(per_rank * s), (per_rank, per_rank * s)

    grad_fn = jax.grad(scaled_loss, has_aux=True)

    def micro_step(carry, xs):
        grads_acc, raw_acc, scaled_acc = carry
        grads, (raw, scaled) = grad_fn(params, *xs)
        return (jax.tree.map(jnp.add, grads_acc, grads), raw_acc + raw, scaled_acc + scaled), None

    zeros = jnp.zeros((R,), dtype)
    init = (jax.tree.map(jnp.zeros_like, params), zeros, zeros)
    xs = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), (batch.inputs, batch.targets, a, scale))
    (grads, raw, scaled), _ = jax.lax.scan(micro_step, init, xs)
    valid = jnp.sum(batch.targets != IGNORE_INDEX, axis=(1, 2, 3), dtype=jnp.int32)
    if spec.scope == "update":
        D = D_units[0, 0]
        if postnorm_update:
            grads = divide_by_denominator(grads, safe_denominator(D))
            grads = jax.tree.map(lambda g: jnp.where(D > 0, g, jnp.zeros_like(g)), grads)
        loss = jnp.where(D > 0, jnp.sum(raw) / safe_denominator(D), 0)
        return ReducedGradients(grads, valid, raw, D, loss)
    K_ = jnp.asarray(K, dtype)
    return ReducedGradients(grads, valid, scaled * K, K_, jnp.sum(scaled))
