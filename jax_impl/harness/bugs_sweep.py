"""Running the buggy steps of `jax_impl.harness.bugs`: several windows, several steps per program.

A sweep runs a set of buggy steps side by side in one jitted ``jax.shard_map`` program over a
1-D mesh with axis ``"data"`` (one rank per device): the fixtures are tiny and compiling
dominates, so every step wanted for one batch shape shares one compile, and later batches of
the same shape (other fixtures, other skews) reuse it. The program runs one accumulation
window; the sweep calls it `num_windows` times on the same params and batch, carrying each
step's state (a counter, an optax state) from one window to the next, as a training loop
would with no optimizer step in between, and returns the last window's result.

Every device returns its own copy of each gradient, and the sweep checks they are identical:
a step whose ranks disagree would hand each rank's optimizer a different update.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_impl.batch import IGNORE_INDEX, Batch, lay_out_global_batch
from jax_impl.devices import check_rank_axis
from jax_impl.harness.bugs import BUG_STEPS
from jax_impl.harness.bugs_common import AXIS, StepContext, WindowOut
from jax_impl.model import Params, params_from_numpy
from jax_impl.shard_map_step import data_mesh, rank_varying


class BugResult(NamedTuple):
    """The last window of one buggy step."""

    grads: dict[str, np.ndarray]  # float64 numpy, the synchronized gradient (rank 0's copy)
    logged_denominator: float  # rank 0's


class RankMismatchError(RuntimeError):
    """A step's ranks ended a window holding different gradients."""


class RowInputs(NamedTuple):
    """Inputs a step may read beside the tokens, laid out by rank like the batch."""

    group_ids: np.ndarray  # [R, M, B] int32 prompt group of each row
    loss_weights: np.ndarray  # [R, M, B, T] float, 1.0 where the target carries a loss


#: sweep(params, batch [R, M, B, T], skew, group_ids [N]) -> {pattern: BugResult}
BugSweep = Callable[..., dict[str, BugResult]]


def check_patterns(patterns: Sequence[str]) -> tuple[str, ...]:
    """The patterns as a tuple; ValueError for none, a duplicate, or an unknown id."""
    patterns = tuple(patterns)
    if not patterns:
        raise ValueError("a bug sweep needs at least one pattern")
    unknown = [p for p in patterns if p not in BUG_STEPS]
    if unknown:
        raise ValueError(f"unknown bug pattern(s) {unknown}; known: {', '.join(BUG_STEPS)}")
    if len(set(patterns)) != len(patterns):
        raise ValueError(f"bug sweep patterns repeat: {list(patterns)}")
    return patterns


def check_world_size(world_size: int) -> None:
    """ValueError unless 1 <= world_size <= the number of devices."""
    available = jax.device_count()
    if not 1 <= world_size <= available:
        raise ValueError(
            f"world_size={world_size} needs 1 to {available} devices ({available} available); "
            f"on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N before importing jax"
        )


def make_bug_sweep(
    patterns: Sequence[str],
    world_size: int,
    *,
    clip_norm: float | None = None,
    num_windows: int = 2,
) -> BugSweep:
    """sweep(params, batch, skew=1.0) -> {pattern: BugResult} for `patterns` over R devices.

    `params` are jax arrays (their dtype is the compute dtype); `batch` is an [R, M, B, T]
    Batch from `jax_impl.lay_out_global_batch` with weights in that dtype. `clip_norm` is
    clip-per-microbatch's threshold (required when that pattern is in the sweep); `skew` is
    rank-skew's factor. Sweeps are cached: the same arguments return the same compiled program.
    """
    patterns = check_patterns(patterns)
    check_world_size(world_size)
    if num_windows < 1:
        raise ValueError(f"num_windows must be >= 1, got {num_windows}")
    if "clip-per-microbatch" in patterns and clip_norm is None:
        raise ValueError("clip-per-microbatch needs a clip_norm")
    return _cached_sweep(patterns, world_size, clip_norm, num_windows)


@functools.cache
def _cached_sweep(
    patterns: tuple[str, ...], world_size: int, clip_norm: float | None, num_windows: int
) -> BugSweep:
    steps = [BUG_STEPS[p] for p in patterns]
    mesh = data_mesh(world_size, AXIS)
    replicated, by_rank = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))

    def per_device(params: Params, batch: Batch, states: tuple, skew: jax.Array, rows: RowInputs):
        ctx = StepContext(
            AXIS, batch.targets.shape[1], clip_norm, skew, rows.group_ids[0], rows.loss_weights[0]
        )
        # Each step's own collectives must be the only reduction (see `rank_varying`).
        local_params = rank_varying(params, AXIS)
        rank_batch = jax.tree.map(lambda x: x[0], batch)  # [1, M, B, T] -> [M, B, T]
        outs = []
        for step, state in zip(steps, states, strict=True):
            out = step.window(local_params, rank_batch, state, ctx)
            # Every rank's copy comes back (stacked over the mesh) so the host can check them.
            grads = jax.tree.map(lambda g: g[None], out.grads)
            outs.append(WindowOut(grads, jnp.asarray(out.logged)[None], out.state))
        return tuple(outs)

    program = jax.jit(
        jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(P(), P(AXIS), P(), P(), P(AXIS)),
            out_specs=tuple(WindowOut(P(AXIS), P(AXIS), P()) for _ in steps),
        )
    )

    def sweep(
        params: Params, batch: Batch, skew: float = 1.0, group_ids: np.ndarray | None = None
    ) -> dict[str, BugResult]:
        check_rank_axis(batch, world_size, "bug sweep")
        rows = RowInputs(
            lay_out_group_ids(group_ids, np.shape(batch.targets)),
            # What a pipeline yields beside the tokens: 1.0 where a target carries a loss, in
            # the weights' (denominator) dtype.
            (np.asarray(batch.targets) != IGNORE_INDEX).astype(np.asarray(batch.weights).dtype),
        )
        dtype = jax.tree.leaves(params)[0].dtype
        host_ctx = StepContext(AXIS, int(np.shape(batch.targets)[1]), clip_norm, skew)
        states = tuple(step.init_state(params, host_ctx) for step in steps)
        # Everything placed as the program's outputs are: the second window's inputs then have
        # the first one's shardings, and the program compiles once, not twice.
        placed_params = jax.device_put(params, replicated)
        placed_batch = jax.device_put(batch, by_rank)
        placed_skew = jax.device_put(jnp.asarray(skew, dtype), replicated)
        placed_rows = jax.device_put(rows, by_rank)
        states = jax.device_put(states, replicated)
        for _ in range(num_windows):
            outs = program(placed_params, placed_batch, states, placed_skew, placed_rows)
            states = tuple(out.state for out in outs)
        return {p: _result(p, out) for p, out in zip(patterns, outs, strict=True)}

    return sweep


def lay_out_group_ids(group_ids: np.ndarray | None, shape: tuple[int, ...]) -> np.ndarray:
    """[N] group ids as [R, M, B] int32, like the batch's [R, M, B, T]; without them every row
    is its own group (contract v2's default, ``arange(N)``)."""
    R, M, B = shape[:3]
    if group_ids is None:
        group_ids = np.arange(R * M * B)
    group_ids = np.asarray(group_ids)
    if group_ids.shape != (R * M * B,) or not np.issubdtype(group_ids.dtype, np.integer):
        raise ValueError(f"group_ids must be {R * M * B} integers, got {group_ids.shape}")
    return group_ids.astype(np.int32).reshape(R, M, B)


def _result(pattern: str, out: WindowOut) -> BugResult:
    return result_of(pattern, out.grads, out.logged)


def result_of(pattern: str, stacked_grads: Mapping[str, Any], logged: Any) -> BugResult:
    """Rank 0's gradient as float64 numpy after checking every rank holds exactly the same
    (NaN where rank 0 has NaN counts as the same: zero-count-nan's all-reduced NaN is);
    `stacked_grads` hold every rank's copy along their first axis, `logged` every rank's
    denominator."""
    grads = {}
    for name, stacked in stacked_grads.items():
        stacked = np.asarray(stacked, dtype=np.float64)
        same = (stacked == stacked[0]) | (np.isnan(stacked) & np.isnan(stacked[0]))
        if not same.all():
            spread = np.nanmax(np.abs(stacked - stacked[0]))
            raise RankMismatchError(
                f"{pattern}: the ranks hold different {name} gradients after the window "
                f"(max difference {spread!r}, or NaN on some ranks only); a synchronized "
                "gradient is identical on all"
            )
        grads[name] = stacked[0]
    return BugResult(grads, float(np.asarray(logged)[0]))


def run_bug_step(
    pattern: str,
    batch: Mapping[str, np.ndarray],
    params: Mapping[str, np.ndarray],
    world_size: int,
    accum_steps: int,
    *,
    dtype: str = "float64",
    skew: float = 1.0,
    clip_norm: float | None = None,
    num_windows: int = 2,
) -> BugResult:
    """One buggy step on a global batch ([N, T] numpy arrays) laid out over (R, M).

    Rank r gets rows [r N/R, (r+1) N/R), split into M contiguous microbatches; an optional
    ``group_ids`` [N] array in `batch` gives each row's prompt group. float64 needs
    ``jax_enable_x64``. ValueError for an unknown pattern, R above the device count, or a
    layout that does not divide the rows.
    """
    check_patterns([pattern])
    check_world_size(world_size)
    jax_params = params_from_numpy(params, dtype)
    laid_out = lay_out_global_batch(
        batch,
        world_size,
        accum_steps,
        vocab_size=int(np.shape(params["embed"])[0]),
        weights_dtype=np.dtype(dtype),
    )
    sweep = make_bug_sweep([pattern], world_size, clip_norm=clip_norm, num_windows=num_windows)
    # Contract v2's group ids, when the batch carries them (local-group-count reads them).
    return sweep(jax_params, laid_out, skew, batch.get("group_ids"))[pattern]
