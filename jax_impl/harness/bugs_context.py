r"""The context-parallel steps of the bug catalogue in JAX, and the sweep that runs them.

Each step is written for one device of a ``jax.shard_map`` over the ("data", "context") mesh
of `jax_impl.context_parallel` (R x C devices, process r C + c at [r, c]): it sees its own
[M, B, T/C] share of its data rank's rows (context rank c's positions, contiguous or zigzag),
its own copy of the params, and the collectives over either axis or both. On the bilinear
model a token's loss reads only its own position, so a shard's loss is its own tokens'.

A correct step psums each shard's valid count over both axes (D, every target once), divides
its shard's summed loss by D and psums the gradient over both axes. Each step below deviates
from that in one place, marked ``BUG``; the patterns' wording is
``crosscheck.diagnosis.patterns``'s, and the torch loops (``torch_impl.harness.bugs_context``)
are written apart, on purpose. Like `jax_impl.harness.bugs_sweep`, a sweep runs every step
wanted for one batch shape in one compiled program, two windows each, and checks that every
device holds the same gradient.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_impl.batch import IGNORE_INDEX, Batch
from jax_impl.context_parallel import AXES, context_mesh, lay_out_context_parallel
from jax_impl.harness.bugs_common import accumulate, count, dtype_of, token_loss_sum, valid
from jax_impl.harness.bugs_sweep import BugResult, result_of
from jax_impl.model import Params, params_from_numpy

DATA, CONTEXT = AXES


class ContextInputs(NamedTuple):
    """What a step reads beside its shard, laid out [R, C, M, B] like the batch's rows."""

    #: Valid targets of each whole row, before the context split (what a loader hands every
    #: context rank of the row).
    row_valid: jax.Array
    #: Each row's global index (document ids must be the same on every process).
    row_ids: jax.Array


class ContextStepContext(NamedTuple):
    """Static facts of a step: the mesh's sizes and the batch's id bounds."""

    world_size: int  # R
    context_size: int  # C
    num_rows: int  # N
    num_segments: int  # the largest segment id + 1


class ContextOut(NamedTuple):
    """One window's result on one device."""

    grads: Params
    logged: jax.Array


ContextStep = Callable[[Params, Batch, ContextInputs, ContextStepContext], ContextOut]


def _summed_grads(params: Params, batch: Batch, denominator: jax.Array, scale=1) -> Params:
    """sum over this shard's microbatches of grad(scale sum_t l_t / denominator)."""
    dtype = dtype_of(params)

    def loss_fn(p: Params, mb: Batch) -> jax.Array:
        return token_loss_sum(p, mb) / denominator.astype(dtype) * scale

    return accumulate(loss_fn, params, batch)[1]


def cp_local_count(
    params: Params, batch: Batch, rows: ContextInputs, ctx: ContextStepContext
) -> ContextOut:
    r"""Each process divides by its own shard's count (Megatron-LM#7513); the gradient is
    pmean'd over both axes: token t of process p weighs :math:`v_t / (R C\, n_p)`.
    Logs :math:`n_p`; an empty shard divides by 1, as Megatron's clamp does."""
    n_shard = count(valid(batch))  # BUG: never meets a collective
    grads = _summed_grads(params, batch, jnp.maximum(n_shard, 1))
    return ContextOut(lax.pmean(grads, AXES), n_shard)


def cp_count_over_replicas(
    params: Params, batch: Batch, rows: ContextInputs, ctx: ContextStepContext
) -> ContextOut:
    r"""Every context rank counts its whole rows (the labels before the split) and psums that
    over both axes: each row counted C times, :math:`D' = C D`; the gradient is g / C
    (verl#3691; prime-rl#2359). Logs C D."""
    whole_rows = jnp.sum(rows.row_valid, dtype=jnp.int32)
    num_tokens = lax.psum(whole_rows, AXES)  # BUG: the context ranks hold replicas of a row
    return ContextOut(lax.psum(_summed_grads(params, batch, num_tokens), AXES), num_tokens)


def cp_count_over_dp_only(
    params: Params, batch: Batch, rows: ContextInputs, ctx: ContextStepContext
) -> ContextOut:
    r"""Each shard's count is psum'd over the data axis only, :math:`D_c = \sum_r n_{rc}`:
    token t on context rank c weighs :math:`v_t / D_c` (verl#5993, verl#5983; prime-rl#2359).
    Logs :math:`D_c`."""
    num_tokens = lax.psum(count(valid(batch)), DATA)  # BUG: the context axis is left out
    return ContextOut(lax.psum(_summed_grads(params, batch, num_tokens), AXES), num_tokens)


def missing_cp_compensation(
    params: Params, batch: Batch, rows: ContextInputs, ctx: ContextStepContext
) -> ContextOut:
    r"""The right D, the loss scaled by R against a pmean over both axes (R C): the gradient is
    g / C (slime#990; Megatron-LM#673). Logs D."""
    denominator = lax.psum(count(valid(batch)), AXES)
    grads = _summed_grads(params, batch, denominator, scale=ctx.world_size)  # BUG: not R C
    return ContextOut(lax.pmean(grads, AXES), denominator)


def cp_local_sequence_count(
    params: Params, batch: Batch, rows: ContextInputs, ctx: ContextStepContext
) -> ContextOut:
    r"""sequence_mean intended; each document's count is taken on this shard of its row:
    token t weighs :math:`v_t / (n^{p,m}_{s(t)} D_S)` (verl's seq-mean-token-mean refusal under
    context parallel; verl#6836). :math:`D_S`, the documents with a valid target, is right: a
    presence vector over global (row, segment) ids, psum'd over both axes. Logs D_S."""
    width = ctx.num_segments
    keys = rows.row_ids[..., None] * width + batch.segment_ids  # [M, B, T/C] global ids
    is_valid = valid(batch)
    present = (
        jnp.zeros(ctx.num_rows * width, jnp.int32)
        .at[keys.ravel()]
        .max(is_valid.ravel().astype(jnp.int32))
    )
    num_documents = jnp.sum(lax.psum(present, AXES) > 0, dtype=jnp.int32)
    dtype = dtype_of(params)

    def loss_fn(p: Params, part: tuple[Batch, jax.Array]) -> jax.Array:
        mb, mb_keys = part
        mb_valid = valid(mb)
        same = (mb_keys[:, :, None] == mb_keys[:, None, :]) & mb_valid[:, None, :]
        n_shard = jnp.sum(same, axis=-1)  # BUG: the document's targets on this shard only
        a = jnp.where(mb_valid, 1.0 / jnp.maximum(n_shard, 1), 0.0).astype(dtype)
        return token_loss_sum(p, mb, a) / num_documents.astype(dtype)

    value_and_grad = jax.value_and_grad(loss_fn)

    def micro_step(grads_acc, part):
        _, grads = value_and_grad(params, part)
        return jax.tree.map(jnp.add, grads_acc, grads), None

    grads, _ = lax.scan(micro_step, jax.tree.map(jnp.zeros_like, params), (batch, keys))
    return ContextOut(lax.psum(grads, AXES), num_documents)


#: Pattern id (crosscheck.diagnosis.patterns.PATTERNS) -> its context-parallel step.
CONTEXT_BUG_STEPS: dict[str, ContextStep] = {
    "cp-local-count": cp_local_count,
    "cp-count-over-replicas": cp_count_over_replicas,
    "cp-count-over-dp-only": cp_count_over_dp_only,
    "missing-cp-compensation": missing_cp_compensation,
    "cp-local-sequence-count": cp_local_sequence_count,
}

#: sweep(params, batch [R, C, M, B, T/C], inputs) -> {pattern: BugResult}
ContextSweep = Callable[[Params, Batch, ContextInputs], dict[str, BugResult]]


def make_context_bug_sweep(
    patterns: Sequence[str],
    world_size: int,
    context_size: int,
    num_rows: int,
    num_segments: int,
    num_windows: int = 2,
) -> ContextSweep:
    """The context-parallel steps of `patterns` over an R x C mesh, in one cached program."""
    patterns = tuple(patterns)
    unknown = [p for p in patterns if p not in CONTEXT_BUG_STEPS]
    if not patterns or unknown or len(set(patterns)) != len(patterns):
        raise ValueError(
            f"context-parallel bug patterns must be distinct ids of "
            f"{', '.join(CONTEXT_BUG_STEPS)}, got {list(patterns)}"
        )
    if num_windows < 1:
        raise ValueError(f"num_windows must be >= 1, got {num_windows}")
    ctx = ContextStepContext(world_size, context_size, num_rows, num_segments)
    return _cached_sweep(patterns, ctx, num_windows)


@functools.cache
def _cached_sweep(
    patterns: tuple[str, ...], ctx: ContextStepContext, num_windows: int
) -> ContextSweep:
    mesh = context_mesh(ctx.world_size, ctx.context_size)
    steps = [CONTEXT_BUG_STEPS[p] for p in patterns]

    def per_process(params: Params, batch: Batch, inputs: ContextInputs):
        shard = jax.tree.map(lambda x: x[0, 0], batch)  # [1, 1, M, B, T/C] -> [M, B, T/C]
        rows = jax.tree.map(lambda x: x[0, 0], inputs)
        # This process's own copy: grad gives its own share, the step's collective reduces.
        own = lax.pcast(params, AXES, to="varying")
        outs = []
        for step in steps:
            out = step(own, shard, rows, ctx)
            # Every process's copy comes back, so the host can check they are the same.
            outs.append(
                ContextOut(
                    jax.tree.map(lambda g: g[None, None], out.grads),
                    jnp.asarray(out.logged)[None, None],
                )
            )
        return tuple(outs)

    program = jax.jit(
        jax.shard_map(
            per_process,
            mesh=mesh,
            in_specs=(P(), P(*AXES), P(*AXES)),
            out_specs=tuple(ContextOut(P(*AXES), P(*AXES)) for _ in steps),
        )
    )
    by_process = NamedSharding(mesh, P(*AXES))

    def sweep(params: Params, batch: Batch, inputs: ContextInputs) -> dict[str, BugResult]:
        placed = (
            jax.device_put(params, NamedSharding(mesh, P())),
            jax.device_put(batch, by_process),
            jax.device_put(inputs, by_process),
        )
        for _ in range(num_windows):  # no state: every window is the same computation
            outs = program(*placed)
        flat = {}
        for pattern, out in zip(patterns, outs, strict=True):
            # [R, C, ...] -> [R C, ...]: process r C + c's copy in row r C + c.
            grads = jax.tree.map(lambda g: np.asarray(g).reshape(-1, *np.shape(g)[2:]), out.grads)
            flat[pattern] = result_of(pattern, grads, np.asarray(out.logged).reshape(-1))
        return flat

    return sweep


def run_context_bug_steps(
    patterns: Sequence[str],
    batch: Mapping[str, np.ndarray],
    params: Mapping[str, np.ndarray],
    world_size: int,
    accum_steps: int,
    context_size: int,
    context_order: str = "contiguous",
    *,
    dtype: str = "float64",
    num_windows: int = 2,
) -> dict[str, BugResult]:
    """The context-parallel steps of `patterns` on a global batch ([N, T] numpy arrays) laid
    out over (R, M) and split over C context ranks in `context_order`."""
    targets = np.asarray(batch["targets"])
    num_rows = targets.shape[0]
    laid_out = lay_out_context_parallel(
        batch,
        world_size,
        accum_steps,
        context_size,
        context_order,
        vocab_size=int(np.shape(params["embed"])[0]),
    )
    B = num_rows // (world_size * accum_steps)
    row_valid = (targets != IGNORE_INDEX).sum(axis=1).reshape(world_size, 1, accum_steps, B)
    row_ids = np.arange(num_rows).reshape(world_size, 1, accum_steps, B)
    inputs = ContextInputs(
        *(np.repeat(x, context_size, axis=1).astype(np.int32) for x in (row_valid, row_ids))
    )
    num_segments = int(np.max(batch["segment_ids"], initial=0)) + 1
    sweep = make_context_bug_sweep(
        patterns, world_size, context_size, num_rows, num_segments, num_windows
    )
    return sweep(params_from_numpy(params, dtype), laid_out, inputs)
