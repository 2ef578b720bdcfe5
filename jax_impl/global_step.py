r"""The update as one global-view ``jax.jit``: the global sum written directly, no collectives.

The [R, M, B, T] batch is sharded over a "data" mesh on its rank axis; the program is written
for the whole global batch and XLA inserts the cross-device reductions. There is no reduction
factor: the code says :math:`\sum_{r,m}` and that is what is computed, so the only way to get
the normalization wrong here is to write the wrong sum. Accumulation scans over the M
microbatches; global microbatch m holds every rank's microbatch m ([R, B, T]).

precount: D from the labels of all R M microbatches first, then
:math:`\sum_m \nabla \big(\sum_{r,t \in m} a_t l_t / D\big)`.
postnorm: :math:`\big(\sum_m \nabla \sum_{r,t \in m} a_t l_t\big) / D`.
For a spec whose scope U is rank or microbatch, each unit's scale 1 / (K D_u) is applied where
its sums are formed (there is no reduction to postpone).

Dtypes as in `jax_impl.denominators`: the count sum is int32 and converted once; the weight
sum is an `ExactSum` pair in the denominator dtype (float64 under x64, else float32), first
per rank, then over the R per-rank pairs (the partitioner gathers those R pairs: a two-sum
reduction is no all-reduce it could use); D, s / D, the loss sums and g / D are in that
dtype, the gradient in the params' dtype.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh

from jax_impl.accumulate import (
    AxisName,
    Collective,
    Strategy,
    local_denominators,
    unit_count,
    unit_denominator,
    unit_scale,
    update_channels,
)
from jax_impl.batch import IGNORE_INDEX, Batch
from jax_impl.denominators import (
    denominator_dtype,
    divide_by_denominator,
    exact_sum,
    safe_denominator,
)
from jax_impl.losses import TokenLossesFn, token_losses
from jax_impl.model import Params, logits_fn
from jax_impl.shard_map_step import mesh_sweep, mesh_update
from jax_impl.spec import SchemeSpec
from jax_impl.spec_counts import rank_spec_terms
from jax_impl.update import (
    GradientsFn,
    ReducedGradients,
    StepConfig,
    SweepFn,
    UpdateFn,
    check_sweep,
    over_configs,
    single_config,
)


class GlobalPlan(NamedTuple):
    """The labels-only part of a global-view update: a_t [R, M, B, T], each (rank, microbatch)'s
    scale [R, M] and D (or D_u) per (rank, microbatch) [R, M]."""

    token_weights: jax.Array
    scale: jax.Array
    denominators: jax.Array


def global_plan(
    batch: Batch, spec: SchemeSpec, strategy: Strategy, axis_name: AxisName = "data"
) -> GlobalPlan:
    """The per-rank terms under ``vmap(axis_name=...)``, so that their psums are sums over the
    rank axis: a_t, and the scale 1 / D (U = update; 1 in postnorm, where D divides after)
    or 1 / (K D_u) (U = rank or microbatch: no reduction to postpone).

    Under context parallel `axis_name` is ("data", "context") and the batch [R, C, M, B, T/C]:
    the per-process terms run under one vmap per axis, and the plan comes back with the
    R C processes as its ranks, [R C, M, ...] (process r C + c)."""
    axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    lead = batch.targets.shape[: len(axes)]
    R, M = math.prod(lead), batch.targets.shape[len(axes)]
    K = unit_count(spec, R, M)

    def per_rank(rank_batch: Batch):
        join = functools.partial(update_channels, axis_name=axis_name)
        terms, reduced = rank_spec_terms(spec, rank_batch, axis_name, join)
        if spec.scope == "update":
            D = unit_denominator(spec, reduced[0], exact_sum(reduced[1]), terms.parts)
            scale = unit_scale(D, 1, 1)
            D_units = jnp.broadcast_to(D, (M,))
        else:
            D_units = jnp.broadcast_to(local_denominators(spec, terms.parts), (M,))
            scale = unit_scale(D_units, 1, K)
        return terms.token_weights, jnp.broadcast_to(scale, (M,)), D_units

    per_process = per_rank
    for name in reversed(axes):  # the outer axis last: vmap over data of vmap over context
        per_process = jax.vmap(per_process, axis_name=name)
    a, scale, D_units = jax.tree.map(
        lambda x: x.reshape(R, *x.shape[len(axes) :]), per_process(batch)
    )  # [R, M, ...]
    return _for_strategy(GlobalPlan(a, scale, D_units), spec, strategy)


def _for_strategy(plan: GlobalPlan, spec: SchemeSpec, strategy: Strategy) -> GlobalPlan:
    """The plan as `strategy` uses it: postnorm with U = update scales by 1 (D divides after)."""
    if strategy is Strategy.POSTNORM and spec.scope == "update":
        return plan._replace(scale=jnp.ones_like(plan.scale))
    return plan


def global_plans(
    batch: Batch, wanted: Sequence[tuple[SchemeSpec, Strategy]], axis_name: AxisName
) -> list[GlobalPlan]:
    """`global_plan` of every (spec, strategy) of a sweep, each spec's traced once: its a_t, D
    and scales come from the labels alone, and a strategy changes only whether the scale is
    applied (`_for_strategy`)."""
    by_spec: dict[SchemeSpec, GlobalPlan] = {}
    plans = []
    for spec, strategy in wanted:
        if spec not in by_spec:
            by_spec[spec] = global_plan(batch, spec, Strategy.PRECOUNT, axis_name)
        plans.append(_for_strategy(by_spec[spec], spec, strategy))
    return plans


@functools.partial(jax.jit, static_argnames=("one_scale", "token_losses_fn"))
def global_accumulate(
    params: Params,
    batch: Batch,
    token_weights: jax.Array,
    scale: jax.Array,
    *,
    one_scale: bool,
    token_losses_fn: TokenLossesFn | None = None,
) -> tuple[Params, jax.Array, jax.Array]:
    """One scan over the M global microbatches: the gradient of sum over ranks of
    (sum a l)_{rm} * scale_{rm}, and per rank the sums of (sum a l)_{rm} and of it scaled.

    `one_scale` (U = update): the scale is one scalar, sum_r (sum a l)_r times it.
    jit-wrapped so that its trace is cached per shape and shared by the configs of a sweep."""
    R = batch.targets.shape[0]
    dtype = denominator_dtype()

    def scaled_loss(p: Params, inputs, targets, weights, s, segment_ids):
        if token_losses_fn is None:
            losses = token_losses(logits_fn(p, inputs), targets)
        else:  # the model's l_t reads [B, T] rows: every rank's rows of microbatch m at once
            rows = [x.reshape(-1, x.shape[-1]) for x in (inputs, targets, segment_ids)]
            losses = token_losses_fn(p, *rows).reshape(targets.shape)
        per_rank = jnp.sum(weights.astype(losses.dtype) * losses, axis=(1, 2), dtype=dtype)
        if one_scale:
            return jnp.sum(per_rank) * s[0], (per_rank, per_rank * s)
        return jnp.sum(per_rank * s), (per_rank, per_rank * s)

    grad_fn = jax.grad(scaled_loss, has_aux=True)

    def micro_step(carry, xs):
        grads_acc, raw_acc, scaled_acc = carry
        grads, (raw, scaled) = grad_fn(params, *xs)
        return (jax.tree.map(jnp.add, grads_acc, grads), raw_acc + raw, scaled_acc + scaled), None

    zeros = jnp.zeros((R,), dtype)
    init = (jax.tree.map(jnp.zeros_like, params), zeros, zeros)
    xs = (batch.inputs, batch.targets, token_weights, scale, batch.segment_ids)
    # [R, M, ...] -> [M, R, ...]: the scan walks the microbatches, every rank's at once.
    xs = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), xs)
    (grads, raw, scaled), _ = jax.lax.scan(micro_step, init, xs)
    return grads, raw, scaled


def global_finish(
    spec: SchemeSpec,
    strategy: Strategy,
    plan: GlobalPlan,
    sums: tuple[Params, jax.Array, jax.Array],
    batch: Batch,
) -> ReducedGradients:
    """The division by D that postnorm postponed (U = update), and the metrics."""
    grads, raw, scaled = sums
    R, M = batch.targets.shape[:2]
    valid = jnp.sum(batch.targets != IGNORE_INDEX, axis=(1, 2, 3), dtype=jnp.int32)
    if spec.scope == "update":
        D = plan.denominators[0, 0]
        if strategy is Strategy.POSTNORM:
            grads = divide_by_denominator(grads, safe_denominator(D))
            grads = jax.tree.map(lambda g: jnp.where(D > 0, g, jnp.zeros_like(g)), grads)
        loss = jnp.where(D > 0, jnp.sum(raw) / safe_denominator(D), 0)
        return ReducedGradients(grads, valid, raw, D, loss)
    K = unit_count(spec, R, M)
    return ReducedGradients(
        grads, valid, scaled * K, jnp.asarray(K, denominator_dtype()), jnp.sum(scaled)
    )


def global_gradients(
    params: Params,
    batch: Batch,
    spec: SchemeSpec,
    *,
    strategy: Strategy = Strategy.PRECOUNT,
    axis_name: str = "data",
    token_losses_fn: TokenLossesFn | None = None,
) -> ReducedGradients:
    """The gradient of one update over the global [R, M, B, T] batch (see the module doc):
    `global_plan`, `global_accumulate`, `global_finish`. Under context parallel (`axis_name`
    a pair of axes, the batch [R, C, M, B, T/C]) the R C processes are its ranks."""
    plan = global_plan(batch, spec, strategy, axis_name)
    batch = processes_as_ranks(batch, axis_name)
    sums = global_accumulate(
        params, batch, plan.token_weights, plan.scale, one_scale=spec.scope == "update",
        token_losses_fn=token_losses_fn,
    )  # fmt: skip
    return global_finish(spec, strategy, plan, sums, batch)


def global_sweep(
    configs: Sequence[StepConfig], params: Sequence[Params], batch: Batch, axis_name: AxisName
) -> list[ReducedGradients]:
    """Every config's gradient: configs of one model and one kind of scale share one scan,
    batched over the configs with ``vmap`` (as `jax_impl.update.sweep_rank_gradients`)."""
    out: list[ReducedGradients | None] = [None] * len(configs)
    families: dict[tuple, list[int]] = {}
    for i, config in enumerate(configs):
        key = (config.token_losses_fn, config.scheme.scope == "update")
        families.setdefault(key, []).append(i)

    for (token_losses_fn, one_scale), members in families.items():
        plans = global_plans(
            batch, [(configs[i].scheme, configs[i].strategy) for i in members], axis_name
        )
        ranks_batch = processes_as_ranks(batch, axis_name)
        accumulate = functools.partial(
            global_accumulate, one_scale=one_scale, token_losses_fn=token_losses_fn
        )
        sums = over_configs(
            accumulate,
            [params[i] for i in members],
            ranks_batch,
            [plan.token_weights for plan in plans],
            [plan.scale for plan in plans],
        )
        for i, plan, own in zip(members, plans, sums, strict=True):
            out[i] = global_finish(configs[i].scheme, configs[i].strategy, plan, own, ranks_batch)
    return out  # type: ignore[return-value]


def processes_as_ranks(batch: Batch, axis_name: AxisName) -> Batch:
    """The batch with every process a rank: [R, C, M, ...] -> [R C, M, ...] under context
    parallel (process r C + c); as it is otherwise."""
    if isinstance(axis_name, str) or len(axis_name) == 1:
        return batch
    return jax.tree.map(lambda x: x.reshape(-1, *x.shape[len(axis_name) :]), batch)


def check_global_configs(configs: Sequence[StepConfig]) -> tuple[StepConfig, ...]:
    """The configs (`check_sweep`), refusing pmean, a reduction factor or a replaced per-rank
    gradient: there is no collective in a global-view program for them to act on."""
    configs = check_sweep(configs)
    for config in configs:
        if (
            config.collective is not Collective.PSUM
            or config.reduce_factor is not None
            or config.gradients is not None
        ):
            raise ValueError(
                "global-view jit writes the global sum directly: it takes no collective, "
                "reduction factor or per-rank gradient; got "
                f"collective={config.collective.value!r}, "
                f"reduce_factor={config.reduce_factor!r}, gradients={config.gradients!r}"
            )
    return configs


def make_global_sweep(
    configs: Sequence[StepConfig],
    mesh: Mesh,
    compile_with: Callable[[Callable], Callable] | None = None,
) -> SweepFn:
    """sweep(params per config, batch [R, M, B, T]) -> one ReducedGradients per config.

    The batch's rank axis is sharded over the mesh's only axis; R must equal the mesh size.
    A config asking for pmean, a reduction factor or a replaced per-rank gradient is refused:
    there is no collective here for them to act on. `compile_with`, when given, wraps the
    jitted program: how it is compiled, not what it computes (as in
    `jax_impl.shard_map_step.make_shard_map_sweep`).
    """
    configs = check_global_configs(configs)
    (axis,) = mesh.axis_names

    def all_configs(params, batch):
        return tuple(global_sweep(configs, params, batch, axis))

    jitted = jax.jit(all_configs)
    program = jitted if compile_with is None else compile_with(jitted)
    return mesh_sweep(program, len(configs), auto_mesh(mesh), axis, "global-view jit gradients")


def auto_mesh(mesh: Mesh) -> Mesh:
    """The same devices and axis with Auto axis type.

    The model's gather embed[inputs] with sharded ids has no single output sharding that
    Explicit mode accepts without annotations; with Auto the partitioner propagates the batch
    sharding through the whole step, as a classic pjit data-parallel program does.
    """
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * mesh.devices.ndim)


def make_global_gradients(config: StepConfig, mesh: Mesh) -> GradientsFn:
    """gradients(params, batch [R, M, B, T]) -> ReducedGradients."""
    return single_config(make_global_sweep([config], mesh))


def make_global_update(config: StepConfig, mesh: Mesh) -> UpdateFn:
    """update(params, opt_state, batch [R, M, B, T]) -> UpdateResult."""
    return mesh_update(make_global_gradients(config, mesh), config, auto_mesh(mesh))
