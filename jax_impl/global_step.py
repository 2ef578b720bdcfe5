r"""The update as one global-view ``jax.jit``: the global sum written directly, no collectives.

The [R, M, B, T] batch is sharded over a "data" mesh on its rank axis; the program is written
for the whole global batch and XLA inserts the cross-device reductions. There is no reduction
factor: the code says :math:`\sum_{r,m}` and that is what is computed, so the only way to get
the normalization wrong here is to write the wrong sum. Accumulation scans over the M
microbatches; global microbatch m holds every rank's microbatch m ([R, B, T]).

precount: D from the labels of all R M microbatches first, then
:math:`\sum_m \nabla \big(\sum_{r,t \in m} a_t l_t / D\big)`.
postnorm: :math:`\big(\sum_m \nabla \sum_{r,t \in m} a_t l_t\big) / D`.

Dtypes as in `jax_impl.denominators`: the count sum is int32 and converted once; the weight
sum is an `ExactSum` pair in the denominator dtype (float64 under x64, else float32), first
per rank, then over the R per-rank pairs (the partitioner gathers those R pairs: a two-sum
reduction is no all-reduce it could use); D, s / D, the loss sums and g / D are in that
dtype, the gradient in the params' dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh

from jax_impl.accumulate import Collective, Strategy
from jax_impl.denominators import denominator_dtype, divide_by_denominator, exact_sum
from jax_impl.losses import Microbatch, token_losses
from jax_impl.model import Params, logits_fn
from jax_impl.schemes import (
    IGNORE_INDEX,
    Scheme,
    global_denominator,
    safe_denominator,
    scheme_terms,
)
from jax_impl.shard_map_step import mesh_sweep, mesh_update
from jax_impl.update import (
    GradientsFn,
    ReducedGradients,
    StepConfig,
    SweepFn,
    UpdateFn,
    check_sweep,
    single_config,
)


def global_gradients(
    params: Params,
    batch: Microbatch,
    scheme: jax.Array | Scheme,
    constant_normalizer: jax.Array | float,
    *,
    strategy: Strategy = Strategy.PRECOUNT,
) -> ReducedGradients:
    """The gradient of one update over the global [R, M, B, T] batch (see the module doc)."""
    terms = scheme_terms(scheme, batch.targets, batch.segment_ids, batch.weights)
    dtype = denominator_dtype()
    # Per rank first ([R, M] -> [R]), then over the R ranks: the same pairs, in the same
    # grouping, as the collective front-ends, so every front-end's D is the same number.
    rank_weight_sums = exact_sum(terms.weight_sum, axis=1)
    D = global_denominator(
        scheme,
        jnp.sum(terms.count, dtype=jnp.int32),  # exact up to 2^31 - 1, then wraps
        exact_sum(rank_weight_sums),
        constant_normalizer,
    )
    safe_D = safe_denominator(D)
    scale = 1 / safe_D if strategy is Strategy.PRECOUNT else jnp.ones((), dtype)

    def scaled_loss(p: Params, inputs: jax.Array, targets: jax.Array, a: jax.Array):
        """(sum over [R, B, T] of a_t l_t) * scale, and the per-rank sums [R] as aux.

        a_t l_t in the loss dtype, the sums in the denominator dtype."""
        losses = token_losses(logits_fn(p, inputs), targets)
        per_rank = jnp.sum(a.astype(losses.dtype) * losses, axis=(1, 2), dtype=dtype)
        return jnp.sum(per_rank) * scale, per_rank

    grad_fn = jax.grad(scaled_loss, has_aux=True)

    def micro_step(carry, xs):
        grads_acc, rank_sums_acc = carry
        grads, rank_sums = grad_fn(params, *xs)
        return (jax.tree.map(jnp.add, grads_acc, grads), rank_sums_acc + rank_sums), None

    world_size = batch.targets.shape[0]
    init = (jax.tree.map(jnp.zeros_like, params), jnp.zeros((world_size,), dtype))
    # [R, M, ...] -> [M, R, ...]: the scan walks the microbatches, every rank's at once.
    xs = jax.tree.map(
        lambda x: jnp.swapaxes(x, 0, 1), (batch.inputs, batch.targets, terms.token_weights)
    )
    (grads, rank_sums), _ = jax.lax.scan(micro_step, init, xs)
    if strategy is Strategy.POSTNORM:
        grads = divide_by_denominator(grads, safe_D)
    return ReducedGradients(
        grads=grads,
        rank_valid_tokens=jnp.sum(batch.targets != IGNORE_INDEX, axis=(1, 2, 3), dtype=jnp.int32),
        rank_loss_sums=rank_sums,
        global_denominator=D,
        loss=jnp.sum(rank_sums) / safe_D,
    )


def make_global_sweep(configs: Sequence[StepConfig], mesh: Mesh) -> SweepFn:
    """sweep(params per config, batch [R, M, B, T], scheme, normalizer) -> result per config.

    The batch's rank axis is sharded over the mesh's only axis; R must equal the mesh size.
    A config asking for pmean, a reduction factor or a replaced per-rank gradient is refused:
    there is no collective here for them to act on.
    """
    configs = check_sweep(configs)
    for config in configs:
        # A per-rank gradient that knows its global-view form (a spec's,
        # `jax_impl.spec_step.SpecGradients.global_view`) is taken; any other is refused.
        if (
            config.collective is not Collective.PSUM
            or config.reduce_factor is not None
            or (config.gradients is not None and not hasattr(config.gradients, "global_view"))
        ):
            raise ValueError(
                "global-view jit writes the global sum directly: it takes no collective, "
                "reduction factor or per-rank gradient; got "
                f"collective={config.collective.value!r}, "
                f"reduce_factor={config.reduce_factor!r}, gradients={config.gradients!r}"
            )
    (axis,) = mesh.axis_names

    def one(config: StepConfig, p, batch, scheme, constant_normalizer) -> ReducedGradients:
        if config.gradients is not None:
            return config.gradients.global_view(p, batch, axis)
        return global_gradients(p, batch, scheme, constant_normalizer, strategy=config.strategy)

    def all_strategies(params, batch, scheme, constant_normalizer):
        return tuple(
            one(config, p, batch, scheme, constant_normalizer)
            for config, p in zip(configs, params, strict=True)
        )

    jitted = jax.jit(all_strategies)

    return mesh_sweep(jitted, len(configs), auto_mesh(mesh), axis, "global-view jit gradients")


def auto_mesh(mesh: Mesh) -> Mesh:
    """The same devices and axis with Auto axis type.

    The model's gather embed[inputs] with sharded ids has no single output sharding that
    Explicit mode accepts without annotations; with Auto the partitioner propagates the batch
    sharding through the whole step, as a classic pjit data-parallel program does.
    """
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * mesh.devices.ndim)


def make_global_gradients(config: StepConfig, mesh: Mesh) -> GradientsFn:
    """gradients(params, batch [R, M, B, T], scheme, constant_normalizer) -> ReducedGradients."""
    return single_config(make_global_sweep([config], mesh))


def make_global_update(config: StepConfig, mesh: Mesh) -> UpdateFn:
    """update(params, opt_state, batch [R, M, B, T], scheme, constant_normalizer=0.0)."""
    return mesh_update(make_global_gradients(config, mesh), config, auto_mesh(mesh))
