"""The update under ``jax.pmap``: one rank per device, collectives over a named axis.

The mapped function is the per-rank gradient of `jax_impl.accumulate` (the same code
shard_map runs), with each config's scheme spec closed over (static). Params are broadcast
(``in_axes=None``); the [R, M, B, T] batch is mapped over its rank axis. The optimizer step
then runs once on the reduced gradient (`jax_impl.update.with_optimizer`).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from jax_impl.accumulate import RankGradients
from jax_impl.batch import Batch
from jax_impl.devices import check_rank_axis, require_devices
from jax_impl.update import (
    GradientsFn,
    ReducedGradients,
    StepConfig,
    SweepFn,
    UpdateFn,
    check_sweep,
    single_config,
    sweep_from,
    sweep_rank_gradients,
    with_optimizer,
)


def _on_rank0(x: jax.Array) -> jax.Array:
    """Rank 0's copy of a replicated pmap output (``out_axes=None``: every device holds the
    whole value), on rank 0's device only: the optimizer step then runs there, next to params
    committed to that device, not across all R devices. Picking a device's buffer is no
    computation; slicing a stacked [R, ...] output was one eager op per leaf."""
    return x.addressable_data(0)


def make_pmap_sweep(configs: Sequence[StepConfig], world_size: int) -> SweepFn:
    """sweep(params per config, batch [R, M, B, T]) -> one ReducedGradients per config.

    All configs run side by side in one pmapped program: a harness comparing schemes and
    strategies compiles once per batch shape, not once per (shape, config). Replicated
    outputs (``out_axes=None``) are taken from rank 0's device; per-rank metrics come back
    stacked to [R].
    """
    configs = check_sweep(configs)
    devices = require_devices(world_size)
    axis = configs[0].axis_name

    def per_rank(params, batch):
        return tuple(sweep_rank_gradients(configs, params, batch, axis))

    # The reduced gradient, D and L are the same on every rank (unmapped outputs); the
    # per-rank metrics are stacked to [R].
    replicated = RankGradients(None, 0, 0, None, None)  # type: ignore[arg-type]
    mapped = jax.pmap(
        per_rank,
        axis_name=axis,
        in_axes=(None, 0),
        out_axes=tuple(replicated for _ in configs),
        devices=devices,
    )

    def place(batch: Batch) -> Batch:
        check_rank_axis(batch, world_size, "pmap gradients")
        return batch

    def program(params, batch) -> tuple[ReducedGradients, ...]:
        return tuple(
            ReducedGradients(
                grads=jax.tree.map(_on_rank0, out.grads),
                rank_valid_tokens=out.local_valid_tokens,
                rank_loss_sums=out.local_loss_sum,
                global_denominator=_on_rank0(out.global_denominator),
                loss=_on_rank0(out.loss),
            )
            for out in mapped(params, batch)
        )

    return sweep_from(program, len(configs), place)


def make_pmap_gradients(config: StepConfig, world_size: int) -> GradientsFn:
    """gradients(params, batch [R, M, B, T]) -> ReducedGradients."""
    return single_config(make_pmap_sweep([config], world_size))


def make_pmap_update(config: StepConfig, world_size: int) -> UpdateFn:
    """update(params, opt_state, batch [R, M, B, T]) -> UpdateResult."""
    return with_optimizer(make_pmap_gradients(config, world_size), config)
