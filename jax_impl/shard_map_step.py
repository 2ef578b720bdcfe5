"""The update under ``jax.shard_map`` over a 1-D "data" mesh, single- or multi-process.

Each device holds one rank's [1, M, B, T] block of the [R, M, B, T] batch (placed with
``NamedSharding(mesh, P("data"))``) and runs the per-rank gradient of `jax_impl.accumulate`,
the same code as pmap; the optimizer step then runs on the replicated reduced gradient.
Params and optimizer state are replicated (``P()``); the collectives name the mesh axis. With
``jax.distributed`` the mesh spans processes and the same code runs unchanged; only the
placement of inputs differs (each process supplies its own rank's block).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_impl.batch import Batch
from jax_impl.devices import check_rank_axis, require_devices
from jax_impl.model import Params
from jax_impl.update import (
    GradientsFn,
    ReducedGradients,
    StepConfig,
    SweepFn,
    UpdateFn,
    UpdateResult,
    check_sweep,
    single_config,
    sweep_from,
    sweep_rank_gradients,
    with_optimizer,
)


def data_mesh(
    world_size: int, axis_name: str = "data", devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """A 1-D mesh of `world_size` devices (all processes' devices under jax.distributed)."""
    devices = require_devices(world_size) if devices is None else list(devices)
    if len(devices) != world_size:
        raise ValueError(f"data_mesh: world_size={world_size} but {len(devices)} devices given")
    return jax.make_mesh((world_size,), (axis_name,), axis_types=(AxisType.Auto,), devices=devices)


def _place(value: Any, sharding: NamedSharding, global_shape: tuple[int, ...] | None) -> Any:
    if isinstance(value, jax.Array) and value.sharding == sharding:
        return value
    if jax.process_count() == 1:
        return jax.device_put(value, sharding)
    # Multi-process: a process can only supply the blocks of its own devices.
    return jax.make_array_from_process_local_data(sharding, np.asarray(value), global_shape)


def replicate(tree: Any, mesh: Mesh) -> Any:
    """Place a pytree replicated on every device of `mesh` (every process passes the same)."""
    sharding = NamedSharding(mesh, P())
    return jax.tree.map(lambda x: _place(x, sharding, None), tree)


def shard_batch(batch: Batch, mesh: Mesh, axis_name: str = "data") -> Batch:
    """Place an [R, M, B, T] batch with its rank axis split over `axis_name`.

    Single process: the whole batch. Multi-process: this process's own ranks' rows only,
    [R_local, M, B, T] (see `jax_impl.batch.rank_slice`); the global shape has R = mesh size.
    """
    sharding = NamedSharding(mesh, P(axis_name))
    world_size = mesh.shape[axis_name]

    def place(x: np.ndarray) -> jax.Array:
        global_shape = (world_size, *np.shape(x)[1:])
        return _place(x, sharding, global_shape)

    # tree.map: the token fields [R, M, B, T] and the row fields [R, M, B] alike.
    return jax.tree.map(place, batch)


def rank_varying(params: Params, axis_name: str | tuple[str, ...]) -> Params:
    """The replicated params as this rank's own copy, inside a shard_map over `axis_name`.

    Under shard_map (check_vma) the params are axis-invariant, and autodiff transposes the
    implicit invariant -> varying cast into a psum: jax.grad would already return the sum over
    ranks, and the step's own collective would count every rank R times (R x the gradient; the
    double-reduce pattern of Megatron-LM#7481). Cast to varying, jax.grad returns this rank's
    own contribution, as under pmap or DDP, and the step's collective is the only reduction.
    """
    axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    return jax.lax.pcast(params, axes, to="varying")


def mesh_sweep(
    program: Callable[..., tuple[ReducedGradients, ...]],
    num_configs: int,
    mesh: Mesh,
    axis_name: str,
    what: str,
) -> SweepFn:
    """The sweep (`jax_impl.update.sweep_from`) of a jitted `program` over `mesh`.

    A numpy batch is checked (`what` names the front-end in the error) and placed with
    `shard_batch`; an already placed one (e.g. a multi-process global array) passes through.
    Params are replicated over the mesh before the program runs.
    """
    world_size = mesh.shape[axis_name]

    def place(batch: Batch) -> Batch:
        if not isinstance(batch.targets, jax.Array):
            check_rank_axis(batch, world_size, what)
            batch = shard_batch(batch, mesh, axis_name)
        return batch

    def replicated(params, batch) -> tuple[ReducedGradients, ...]:
        return program(replicate(params, mesh), batch)

    return sweep_from(replicated, num_configs, place)


def make_shard_map_sweep(
    configs: Sequence[StepConfig],
    mesh: Mesh,
    compile_with: Callable[[Callable], Callable] | None = None,
) -> SweepFn:
    """sweep(params per config, batch) -> one ReducedGradients per config.

    All configs run side by side in one jitted shard_map program (one compile per batch
    shape for a harness comparing schemes and strategies). `batch` is [R, M, B, T]: a numpy batch is
    placed with `shard_batch`; an already placed (e.g. multi-process global) array passes
    through. Per-rank metrics come back as [R] arrays sharded over the mesh; everything else
    is replicated. `compile_with`, when given, wraps the jitted program: how it is compiled
    (a multi-process worker has one process compile it for all,
    `jax_impl.harness.multiprocess_worker.CompiledByProcessZero`), not what it computes.
    """
    configs = check_sweep(configs)
    axis = configs[0].axis_name
    if axis not in mesh.axis_names:
        raise ValueError(f"shard_map update: axis {axis!r} is not in mesh axes {mesh.axis_names}")

    def per_rank(params, batch):
        rank_batch = jax.tree.map(lambda x: x[0], batch)  # [1, M, B, T] -> [M, B, T]
        outs = sweep_rank_gradients(configs, rank_varying(params, axis), rank_batch, axis)
        return tuple(
            ReducedGradients(
                grads=out.grads,
                rank_valid_tokens=out.local_valid_tokens[None],
                rank_loss_sums=out.local_loss_sum[None],
                global_denominator=out.global_denominator,
                loss=out.loss,
            )
            for out in outs
        )

    out_spec = ReducedGradients(P(), P(axis), P(axis), P(), P())
    mapped = jax.jit(
        jax.shard_map(
            per_rank,
            mesh=mesh,
            in_specs=(P(), P(axis)),
            out_specs=tuple(out_spec for _ in configs),
        )
    )
    program = mapped if compile_with is None else compile_with(mapped)
    return mesh_sweep(program, len(configs), mesh, axis, "shard_map gradients")


def make_shard_map_gradients(config: StepConfig, mesh: Mesh) -> GradientsFn:
    """gradients(params, batch) -> ReducedGradients."""
    return single_config(make_shard_map_sweep([config], mesh))


def make_shard_map_update(config: StepConfig, mesh: Mesh) -> UpdateFn:
    """update(params, opt_state, batch) over `mesh`.

    Params and optimizer state are replicated over the mesh before the first update (pass
    them through `replicate` yourself to avoid the copy on later ones).
    """
    return mesh_update(make_shard_map_gradients(config, mesh), config, mesh)


def mesh_update(gradients: GradientsFn, config: StepConfig, mesh: Mesh) -> UpdateFn:
    """`jax_impl.update.with_optimizer` with params and optimizer state replicated over `mesh`
    before every update (a no-op for state that already is)."""
    update = with_optimizer(gradients, config)

    def replicated_update(params, opt_state, batch) -> UpdateResult:
        return update(replicate(params, mesh), replicate(opt_state, mesh), batch)

    return replicated_update


def init_opt_state(optimizer: optax.GradientTransformation, params: Params) -> optax.OptState:
    """optimizer.init under jit, placed like the params (replicated over their mesh, or on
    their device), so multi-process global params work, and the optimizer step sees the
    same placement at the first update as at later ones (one compile, not two)."""
    leaf = jax.tree.leaves(params)[0]
    sharding = leaf.sharding if isinstance(leaf, jax.Array) else None
    if isinstance(sharding, NamedSharding):
        sharding = NamedSharding(sharding.mesh, P())
    return jax.jit(optimizer.init, out_shardings=sharding)(params)
