r"""Pipeline parallel on the bilinear model in JAX: two stages on a ("data", "stage") mesh.

The model :math:`z_t = E[x_t]\, U` is cut after the embedding, as `torch_impl.pipeline` cuts
it (written again here, on purpose): the device at [r, 0] is stage 0 of data rank r's pipeline
and computes :math:`h = E[x]`; ``lax.ppermute`` over the "stage" axis hands h to the device at
[r, 1], stage 1, which holds the labels and the loss. The microbatches go through a
``lax.scan``: all forwards, then autodiff runs the backwards in reverse order and transposes
the ``ppermute``, sending each microbatch's activation gradient back to stage 0 (a
GPipe-shaped schedule). Each stage's gradient is its own parameter's; the other parameter of a
device gets none.

The counts come from the labels on the last stage, through the count pre-pass of
`jax_impl.accumulate.rank_plan` over the "data" axis (the R devices of a stage). precount
scales each microbatch's :math:`\sum_t a_t l_t` before the backward, so the scale travels back
with the activations' gradients; postnorm (a spec of update scope) backpropagates the
unnormalized sums and divides afterwards, the last stage sending D to stage 0 with a
``ppermute``. Each stage's gradient is then summed over the "data" axis. With
``count_to_first_stage=False`` D never leaves the last stage: stage 0's gradient stays the
unnormalized sum (the bug of torchtitan#4194's shape).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_impl.accumulate import Collective, Strategy, rank_plan
from jax_impl.batch import Batch
from jax_impl.devices import require_devices
from jax_impl.losses import token_losses
from jax_impl.model import Params
from jax_impl.shard_map_step import replicate
from jax_impl.spec import SchemeSpec, parse_spec

AXES = ("data", "stage")
#: Each stage's parameter, in pipeline order.
STAGE_PARAMS = ("embed", "unembed")
NUM_STAGES = len(STAGE_PARAMS)


def pipeline_mesh(data_parallel_size: int) -> Mesh:
    """A ("data", "stage") mesh of R x 2 devices: data rank r's stage s at [r, s]."""
    devices = require_devices(data_parallel_size * NUM_STAGES)
    return jax.make_mesh(
        (data_parallel_size, NUM_STAGES), AXES, axis_types=(AxisType.Auto,) * 2, devices=devices
    )


def _stage_gradients(
    params: Params, rank_batch: Batch, spec: SchemeSpec, strategy: Strategy, carry_count: bool
) -> tuple[Params, jax.Array]:
    """One device's part of the update: its stage's gradient (zeros for the other
    parameter), summed over "data", and D as this stage knows it (0 where it was never told)."""
    stage = lax.axis_index("stage")
    last = stage == NUM_STAGES - 1
    # Every device reads the labels it was given; only the last stage's plan is used.
    plan = rank_plan(spec, rank_batch, "data", Strategy.PRECOUNT, Collective.PSUM)
    precount = strategy is Strategy.PRECOUNT
    scale = plan.grad_scale if precount else jnp.ones_like(plan.grad_scale)

    def pipeline_loss(p: Params) -> jax.Array:
        def micro_step(total, xs):
            microbatch, a, s = xs
            hidden = jnp.take(p["embed"], microbatch.inputs, axis=0)  # stage 0's forward
            # Stage 0 -> stage 1; stage 0 receives nothing (zeros) and its loss is masked.
            hidden = lax.ppermute(hidden, "stage", perm=[(0, 1)])
            losses = token_losses(hidden @ p["unembed"], microbatch.targets)
            term = jnp.sum(a.astype(losses.dtype) * losses) * s.astype(losses.dtype)
            return total + jnp.where(last, term, jnp.zeros_like(term)), None

        # The carry varies over both axes, as the terms added to it do.
        zero = jnp.zeros_like(
            p["unembed"], shape=(), dtype=jnp.promote_types(p["unembed"].dtype, jnp.float32)
        )
        total, _ = lax.scan(micro_step, zero, (rank_batch, plan.token_weights, scale))
        return total

    own = lax.pcast(params, AXES, to="varying")  # this device's own share of the gradient
    grads = jax.grad(pipeline_loss)(own)
    D = jnp.where(last, plan.denominator, jnp.zeros_like(plan.denominator))
    if not precount:
        if carry_count:  # the last stage sends D down to stage 0 of its pipeline
            D = D + lax.ppermute(D, "stage", perm=[(1, 0)])
        # 1 / D where D is known (0 when D = 0: nothing to learn, never NaN); a stage that
        # was never told D keeps its unnormalized sum.
        inverse = jnp.where(D > 0, 1.0 / jnp.where(D > 0, D, 1.0), 0.0)
        factor = jnp.where(last | carry_count, inverse, 1.0)
        grads = jax.tree.map(lambda g: g * factor.astype(g.dtype), grads)
    return lax.psum(grads, "data"), D


class PipelineConfig(NamedTuple):
    """One update of a pipeline sweep: the spec, precount or postnorm, and whether the last
    stage sends D to stage 0 (postnorm; False is the bug)."""

    spec: SchemeSpec
    strategy: Strategy = Strategy.PRECOUNT
    count_to_first_stage: bool = True


def pipeline_config(
    spec: str | SchemeSpec, strategy: str = "precount", *, count_to_first_stage: bool = True
) -> PipelineConfig:
    """A checked `PipelineConfig`: postnorm needs a spec of update scope (a local scope
    divides where its sums are formed), and only postnorm has a count to send."""
    parsed = parse_spec(spec)
    chosen = Strategy(strategy)
    if chosen is Strategy.POSTNORM and parsed.scope != "update":
        raise ValueError(
            f"pipeline postnorm postpones the update's D; {spec!r} has scope {parsed.scope!r}, "
            "whose units divide where their sums are formed: use precount"
        )
    if not count_to_first_stage and chosen is not Strategy.POSTNORM:
        raise ValueError("count_to_first_stage=False is postnorm's bug: precount never sends D")
    return PipelineConfig(parsed, chosen, count_to_first_stage)


#: sweep(params, batch [R, M, B, T]) -> per config {"embed", "unembed", "denominators"}.
PipelineSweep = Callable[[Params, Batch], list[dict[str, jax.Array]]]


def make_pipeline_sweep(configs: Sequence[PipelineConfig], mesh: Mesh) -> PipelineSweep:
    """Every config's update through the pipeline of `mesh`, side by side in one program:
    each config's synchronized gradient of every stage, and D as each device knows it
    ([R, 2]: 0 where it was never sent)."""
    if tuple(mesh.axis_names) != AXES:
        raise ValueError(f"pipeline: the mesh axes must be {AXES}, got {mesh.axis_names}")
    return _cached(tuple(configs), mesh)


@functools.cache
def _cached(configs: tuple[PipelineConfig, ...], mesh: Mesh) -> PipelineSweep:
    def per_device(params: Params, batch: Batch):
        rank_batch = jax.tree.map(lambda x: x[0], batch)  # [1, M, B, T] -> [M, B, T]
        outs = []
        for spec, strategy, carry_count in configs:
            grads, D = _stage_gradients(params, rank_batch, spec, strategy, carry_count)
            # The other stage's parameter got zeros here: the sum over stages is every stage's.
            outs.append((lax.psum(grads, "stage"), D[None, None]))
        return tuple(outs)

    program = jax.jit(
        jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(P(), P("data")),  # a data rank's rows on both of its stages
            out_specs=tuple((P(), P(*AXES)) for _ in configs),
        )
    )

    def sweep(params: Params, batch: Batch) -> list[dict[str, jax.Array]]:
        placed = jax.device_put(batch, NamedSharding(mesh, P("data")))
        outs = program(replicate(dict(params), mesh), placed)
        return [{**grads, "denominators": denominators} for grads, denominators in outs]

    return sweep
