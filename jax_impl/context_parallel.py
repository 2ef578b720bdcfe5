r"""Context parallel: every row's positions split over C context ranks, on a 2-D mesh.

The layout (docs/contract.md#context-parallel): R data-parallel ranks times C context ranks,
process r C + c holding data-parallel rank r's rows at context rank c's positions, the M
microbatches of each accumulated in turn. ``contiguous`` gives context rank c the positions
[c T/C, (c+1) T/C); ``zigzag`` (Megatron-LM's and torchtitan's load-balanced order) cuts a row
into 2C chunks of T/(2C) and gives context rank c chunks c and 2C - 1 - c.

`lay_out_context_parallel` lays a global batch out as [R, C, M, B, T/C] (the row fields
[R, C, M, B], the same on every context rank of a data rank); `make_context_parallel_sweep`
runs the per-process update of `jax_impl.accumulate` under ``jax.shard_map`` over a mesh with
axes ("data", "context"), its collectives over both axes: every count of the spec's count
pre-pass and of D is the update's (a row's count gathered over the context axis, an id's
count summed over every process; `jax_impl.spec_counts`), and the gradient is the psum over
all R C processes. The objective does not depend on C or the order; on the bilinear model
tokens do not interact, so the split shows the counts only.
`make_context_parallel_global_sweep` is the same update as one global-view ``jax.jit`` over
the batch placed with NamedSharding on ("data", "context").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_impl.batch import Batch, lay_out_global_batch
from jax_impl.devices import require_devices
from jax_impl.global_step import auto_mesh, check_global_configs, global_sweep
from jax_impl.shard_map_step import replicate
from jax_impl.update import (
    GradientsFn,
    ReducedGradients,
    StepConfig,
    SweepFn,
    check_sweep,
    single_config,
    sweep_from,
    sweep_rank_gradients,
)

ORDERS = ("contiguous", "zigzag")
AXES = ("data", "context")


def context_positions(seq_len: int, context_size: int, order: str) -> np.ndarray:
    """[C, T/C]: the positions of a row each context rank holds, in increasing order."""
    if order not in ORDERS:
        raise ValueError(f"context order must be one of {', '.join(ORDERS)}, got {order!r}")
    chunks = context_size * (2 if order == "zigzag" else 1)
    if context_size < 1 or seq_len % chunks:
        raise ValueError(
            f"rows of {seq_len} positions cannot be split over {context_size} context ranks "
            f"({order}): {seq_len} is not divisible by {chunks}"
        )
    width = seq_len // chunks
    chunk_ranks = np.arange(chunks)
    if order == "zigzag":  # chunk k to rank k for k < C, to 2C - 1 - k after
        chunk_ranks = np.minimum(chunk_ranks, chunks - 1 - chunk_ranks)
    owner = np.repeat(chunk_ranks, width)
    return np.stack([np.flatnonzero(owner == c) for c in range(context_size)])


def lay_out_context_parallel(
    arrays: Mapping[str, np.ndarray],
    world_size: int,
    accum_steps: int,
    context_size: int,
    order: str = "contiguous",
    **kwargs,
) -> Batch:
    """A global batch checked and laid out as [R, C, M, B, T/C] (row fields [R, C, M, B]).

    `kwargs` go to `jax_impl.batch.lay_out_global_batch` (``vocab_size``, ``num_groups``,
    ...), which checks the batch and lays it out over (R, M) first."""
    batch = lay_out_global_batch(arrays, world_size, accum_steps, **kwargs)
    positions = context_positions(np.shape(batch.targets)[-1], context_size, order)
    return jax.tree.map(lambda x: split_over_context(x, positions), batch)


def split_over_context(x: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """One laid-out field split over the C context ranks holding `positions` [C, T/C]: a token
    field [R, M, B, T] becomes [R, C, M, B, T/C] (rank c's positions at [:, c]), a row field
    [R, M, B] is on every context rank, [R, C, M, B]."""
    x = np.asarray(x)
    if x.ndim == 4:
        return np.stack([x[..., p] for p in positions], axis=1)
    return np.repeat(x[:, None], len(positions), axis=1)


def context_mesh(
    world_size: int, context_size: int, devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """A ("data", "context") mesh of R x C devices, process r C + c at [r, c]."""
    devices = require_devices(world_size * context_size) if devices is None else list(devices)
    return jax.make_mesh(
        (world_size, context_size), AXES, axis_types=(AxisType.Auto,) * 2, devices=devices
    )


def make_context_parallel_sweep(configs: Sequence[StepConfig], mesh: Mesh) -> SweepFn:
    """sweep(params per config, batch [R, C, M, B, T/C]) -> one ReducedGradients per config.

    Each config's per-process update with its collectives over ("data", "context") (the
    configs' ``axis_name`` is not used); per-process fields come back as [R, C], the rest
    replicated. A config with its own per-rank gradient gets the same axes tuple.
    """
    configs = check_sweep(configs)
    if tuple(mesh.axis_names) != AXES:
        raise ValueError(f"context parallel: the mesh axes must be {AXES}, got {mesh.axis_names}")

    def per_process(params, batch):
        rank_batch = jax.tree.map(lambda x: x[0, 0], batch)  # [1, 1, M, B, T/C] -> [M, B, T/C]
        # This process's own copy of the params: grad then gives its own contribution, and
        # the step's psum over both axes is the only reduction (jax_impl.shard_map_step).
        own = jax.lax.pcast(params, AXES, to="varying")
        outs = sweep_rank_gradients(configs, own, rank_batch, AXES)
        return tuple(
            ReducedGradients(
                grads=out.grads,
                rank_valid_tokens=out.local_valid_tokens[None, None],
                rank_loss_sums=out.local_loss_sum[None, None],
                global_denominator=out.global_denominator,
                loss=out.loss,
            )
            for out in outs
        )

    out_spec = ReducedGradients(P(), P(*AXES), P(*AXES), P(), P())
    mapped = jax.jit(
        jax.shard_map(
            per_process,
            mesh=mesh,
            in_specs=(P(), P(*AXES)),
            out_specs=tuple(out_spec for _ in configs),
        )
    )

    def replicated(params, batch) -> tuple[ReducedGradients, ...]:
        return mapped(replicate(params, mesh), batch)

    return sweep_from(replicated, len(configs), context_placer(mesh))


def context_placer(mesh: Mesh) -> Callable[[Batch], Batch]:
    """place(batch): a numpy [R, C, M, B, T/C] batch checked against the mesh and sharded
    with NamedSharding(mesh, P("data", "context")); a placed one passes through."""
    grid = (mesh.shape["data"], mesh.shape["context"])

    def place(batch: Batch) -> Batch:
        if not isinstance(batch.targets, jax.Array):
            if np.shape(batch.targets)[:2] != grid:
                raise ValueError(
                    f"context-parallel gradients: the batch's leading axes are "
                    f"{np.shape(batch.targets)[:2]}, the mesh is (R, C) = {grid} "
                    "(lay_out_context_parallel)"
                )
            batch = jax.device_put(batch, NamedSharding(mesh, P(*AXES)))
        return batch

    return place


def make_context_parallel_global_sweep(configs: Sequence[StepConfig], mesh: Mesh) -> SweepFn:
    """sweep(params per config, batch [R, C, M, B, T/C]) -> one ReducedGradients per config,
    as one global-view ``jax.jit``: the program is written for the whole batch, placed with
    NamedSharding over ("data", "context"), and XLA inserts the reductions
    (`jax_impl.global_step`, its per-process counts under one vmap per mesh axis). Per-process
    fields come back as [R, C]; the configs take psum and no reduction factor, as there."""
    configs = check_global_configs(configs)
    models = [c.token_losses_fn for c in configs if c.token_losses_fn is not None]
    if models:
        # The global view treats every process's shard as rows of its own: right for the
        # bilinear model, whose tokens do not interact, wrong for one that attends across
        # positions. Such a model needs its context axis (shard_map).
        raise ValueError(
            "context-parallel global-view jit runs the bilinear model only: a token_losses_fn "
            "(a model whose tokens interact) needs the context axis; use "
            "make_context_parallel_sweep with context_parallel_token_losses"
        )
    if tuple(mesh.axis_names) != AXES:
        raise ValueError(f"context parallel: the mesh axes must be {AXES}, got {mesh.axis_names}")
    mesh = auto_mesh(mesh)
    grid = (mesh.shape["data"], mesh.shape["context"])

    def all_configs(params, batch):
        outs = global_sweep(configs, params, batch, AXES)
        return tuple(
            out._replace(
                rank_valid_tokens=out.rank_valid_tokens.reshape(grid),
                rank_loss_sums=out.rank_loss_sums.reshape(grid),
            )
            for out in outs
        )

    jitted = jax.jit(all_configs)

    def replicated(params, batch) -> tuple[ReducedGradients, ...]:
        return jitted(replicate(params, mesh), batch)

    return sweep_from(replicated, len(configs), context_placer(mesh))


def make_context_parallel_gradients(config: StepConfig, mesh: Mesh) -> GradientsFn:
    """gradients(params, batch [R, C, M, B, T/C]) -> ReducedGradients."""
    return single_config(make_context_parallel_sweep([config], mesh))
