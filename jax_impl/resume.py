r"""A resumable update loop under ``jax.pmap``: stop between updates or inside a window, go on.

One update runs the three steps of `jax_impl.accumulate` under the config's scheme spec: the
labels-only plan of the window (a_t, the count pre-pass, each microbatch's scale c_m), the
accumulation over its M microbatches, and the collective with the normalization; then the
clip and the optimizer (`jax_impl.update`). Here the accumulation is split at microbatch j:
microbatches [0, j) are accumulated per rank without any gradient collective, the per-rank
partial sums can be checkpointed, and on resume [j, M) continue from those sums:

.. math::

    g_r = \sum_{m<j} \nabla(\textstyle\sum_t a_t l_t)\,c_m \;+\; \sum_{m \ge j}
    \nabla(\ldots)\,c_m

The scan carry of the second part starts from the saved first-part sums, so the additions
happen in the same order as in an unsplit window; the plan is recomputed from the window's
labels at every call (it reads labels only, and a_t of a group may depend on microbatches on
either side of j); then the collective, the normalization, the clip and the optimizer run
exactly as for an uninterrupted update. Every spec resumes inside its window, whatever its
grouping and scope.

The window's D (precount with U = update; D_u per microbatch for U = rank or microbatch) is
saved with the partial sums and recomputed on resume as a check that the batch and layout are
the ones the sums belong to. postnorm with U = update reduces D's channels with the gradient
sums at the end of the window, from the window's labels.

Dtypes as in `jax_impl.denominators`: the loss sums and g / D are in the denominator dtype,
the gradient sums in the params' dtype.

Why pmap rather than shard_map: the partial sums are per-rank, unreduced values, and pmap's
outputs are naturally stacked [R, ...] arrays that go to and come back from a checkpoint as
plain numpy without a mesh; params and optimizer state are replicated (taken from rank 0), so
a checkpoint taken between updates resumes at any other world size.

The state a run resumes from (`TrainState`, with its `PartialWindow`) and the arrays a checkpoint
stores of it are in `jax_impl.train_state`; `save_train_state` and `restore_train_state` write
and read them through `jax_impl.checkpoint`.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jax_impl.accumulate import RankPlan, continue_accumulation, finish_rank, rank_plan
from jax_impl.batch import IGNORE_INDEX, Batch
from jax_impl.checkpoint import (
    CheckpointError,
    CheckpointMeta,
    read_arrays,
    read_meta,
    save_checkpoint,
)
from jax_impl.denominators import denominator_dtype
from jax_impl.devices import check_rank_axis, require_devices
from jax_impl.model import Params
from jax_impl.spec import SchemeSpec
from jax_impl.train_state import PartialWindow, TrainState, state_arrays, state_from_arrays
from jax_impl.update import ReducedGradients, StepConfig, apply_optimizer


def _window_plan(window: Batch, *, config: StepConfig) -> tuple[RankPlan, jax.Array]:
    """The window's plan on one rank, and its D (or D_u) per microbatch [M] for the check."""
    plan = rank_plan(config.scheme, window, config.axis_name, config.strategy, config.collective)
    return plan, jnp.broadcast_to(plan.denominator, window.targets.shape[:1])


def _finish(plan: RankPlan, sums, window: Batch, *, config: StepConfig):
    """The collective and the normalization of a completed window, on one rank: the same
    reductions as an uninterrupted update (`jax_impl.accumulate.finish_rank`)."""
    return finish_rank(
        config.scheme, plan, sums, window, config.axis_name, config.strategy, config.collective
    )


def _rank0(x: jax.Array) -> jax.Array:
    return x.addressable_data(0)[0]


def _microbatches(tree, start: int, stop: int):
    """Microbatches [start, stop) of every [R, M, ...] leaf."""
    return jax.tree.map(lambda x: np.asarray(x)[:, start:stop], tree)


@functools.cache
def _window_accumulation(axis_name: str, devices: tuple[jax.Device, ...]):
    """The rest of a window from the saved sums (`continue_accumulation` under pmap): no
    collective, and it reads only a plan's a_t and scales, never the spec, so the loops of
    every spec and strategy on the same devices share it and its compiled programs (one per
    window shape) instead of compiling one each."""
    return jax.pmap(
        continue_accumulation, axis_name=axis_name, devices=devices, in_axes=(None, 0, 0, 0)
    )


def scheme_label(spec: SchemeSpec) -> str:
    """The spec as the checkpoint's metadata writes it: its JSON, keys sorted."""
    return json.dumps(spec.to_dict(), sort_keys=True)


class ResumableLoop:
    """The update loop of one scheme spec and strategy at one layout (R, M); every program
    compiled once.

    `config` must describe the intended step (no `gradients`, no `reduce_factor` override):
    a reproduced bug has nothing to resume.
    """

    def __init__(self, config: StepConfig, world_size: int, accum_steps: int) -> None:
        if config.gradients is not None or config.reduce_factor is not None:
            raise ValueError("ResumableLoop runs the intended step: no gradients/reduce_factor")
        self.config, self.world_size, self.accum_steps = config, world_size, accum_steps
        self.devices = require_devices(world_size)
        pmap = functools.partial(jax.pmap, axis_name=config.axis_name, devices=self.devices)
        self._plan = pmap(functools.partial(_window_plan, config=config))
        self._accumulate = _window_accumulation(config.axis_name, tuple(self.devices))
        self._finish = pmap(functools.partial(_finish, config=config))

    def init(self, params: Params) -> TrainState:
        """Update 0: params on rank 0's device and the optimizer's initial state."""
        params = jax.device_put(params, self.devices[0])
        return TrainState(params, jax.jit(self.config.optimizer.init)(params), 0)

    def zero_partial(self, params: Params, done: int) -> PartialWindow:
        """Empty per-rank sums after `done` microbatches: gradients in the params' dtype, the
        rest in the denominator dtype (the template a checkpoint is read into)."""
        R, M, dtype = self.world_size, self.accum_steps, denominator_dtype()
        return PartialWindow(
            done,
            {k: np.zeros((R, *v.shape), v.dtype) for k, v in params.items()},
            np.zeros((R,), dtype),
            np.zeros((R, M), dtype),
        )

    def run(
        self,
        state: TrainState,
        batch: Batch,
        *,
        until_updates: int,
        then_microbatches: int = 0,
    ) -> TrainState:
        """Run until `until_updates` updates are complete and, when `then_microbatches` > 0,
        that many microbatches of the next window are accumulated (a mid-window stop).

        `batch` is the laid-out global batch [R, M, B, T] (every update sees the same batch).
        """
        check_rank_axis(batch, self.world_size, "ResumableLoop")
        if np.shape(batch.targets)[1] != self.accum_steps:
            raise ValueError(
                f"ResumableLoop: batch has M={np.shape(batch.targets)[1]} microbatches per "
                f"rank, the loop was built for M={self.accum_steps}"
            )
        if not 0 <= then_microbatches < self.accum_steps:
            raise ValueError(f"then_microbatches must be in [0, {self.accum_steps})")
        target = (until_updates, then_microbatches)
        while (state.updates_done, state.partial.done if state.partial else 0) < target:
            stop = then_microbatches if state.updates_done == until_updates else self.accum_steps
            state = self._window(state, batch, stop)
        if (state.updates_done, state.partial.done if state.partial else 0) != target:
            raise ValueError(
                f"ResumableLoop: the state is past the requested stop {target} "
                f"(updates_done={state.updates_done}, partial={bool(state.partial)})"
            )
        return state

    def _window(self, state: TrainState, batch: Batch, stop: int) -> TrainState:
        """Accumulate the window's microbatches [done, stop); complete the update at M."""
        config, params = self.config, state.params
        plan, denominator = self._plan(batch)
        denominator = np.asarray(denominator)
        partial = state.partial or self.zero_partial(params, 0)
        if state.partial is not None and not np.array_equal(denominator, partial.denominator):
            raise ValueError(
                f"resume: the window's D is {denominator.tolist()!r} here but "
                f"{np.asarray(partial.denominator).tolist()!r} in the saved partial window: "
                "not the batch, scheme or layout it was taken on"
            )
        start = partial.done
        # The accumulation reads a_t and the scales only: without the spec's own parts of D
        # every spec hands it the same pytree, and one compiled program serves them all.
        part_plan = RankPlan(
            token_weights=_microbatches(plan.token_weights, start, stop),
            grad_scale=_microbatches(plan.grad_scale, start, stop),
            loss_scale=_microbatches(plan.loss_scale, start, stop),
            parts=None,  # type: ignore[arg-type]
            denominator=None,  # type: ignore[arg-type]
        )
        sums = self._accumulate(
            params, _microbatches(batch, start, stop), part_plan,
            (partial.grad_sums, partial.loss_sums),
        )  # fmt: skip
        if stop < self.accum_steps:
            return state._replace(partial=PartialWindow(stop, *sums, denominator))
        out = self._finish(plan, sums, batch)
        reduced = ReducedGradients(
            grads=jax.tree.map(_rank0, out.grads),
            rank_valid_tokens=jnp.sum(
                np.asarray(batch.targets) != IGNORE_INDEX, axis=(1, 2, 3), dtype=jnp.int32
            ),
            rank_loss_sums=out.local_loss_sum,
            global_denominator=_rank0(out.global_denominator),
            loss=_rank0(out.loss),
        )
        out = apply_optimizer(reduced, params, state.opt_state, config)
        return TrainState(out.params, out.opt_state, state.updates_done + 1, None)


def save_train_state(
    directory: str | Path, loop: ResumableLoop, state: TrainState, fingerprint: str
) -> Path:
    """Checkpoint `state` of `loop` atomically (orbax) to `directory`; returns the path.

    `fingerprint` is `jax_impl.checkpoint.batch_fingerprint` of the global batch.
    """
    meta = CheckpointMeta(
        scheme=scheme_label(loop.config.scheme),
        strategy=loop.config.strategy.value,
        collective=loop.config.collective.value,
        world_size=loop.world_size,
        accum_steps=loop.accum_steps,
        dtype=str(jax.tree.leaves(state.params)[0].dtype),
        batch_fingerprint=fingerprint,
        updates_done=state.updates_done,
        microbatches_done=state.partial.done if state.partial else 0,
    )
    return save_checkpoint(directory, state_arrays(state), meta)


def restore_train_state(
    directory: str | Path, loop: ResumableLoop, params: Params, fingerprint: str
) -> TrainState:
    """The state saved in `directory`, checked against this run, ready for `loop.run`.

    `params` are initial params of this run (they give shapes and dtype, not values). Raises
    CheckpointError naming the mismatch when the checkpoint is unfinalized, of another
    scheme spec, strategy, dtype or batch, or stopped mid-window at another layout than
    `loop`'s.
    """
    meta = read_meta(directory)
    template = loop.init(params)
    here = {
        "scheme": scheme_label(loop.config.scheme),
        "strategy": loop.config.strategy.value,
        "collective": loop.config.collective.value,
        "dtype": str(jax.tree.leaves(template.params)[0].dtype),
        "batch_fingerprint": fingerprint,
    }
    for field, value in here.items():
        if getattr(meta, field) != value:
            raise CheckpointError(
                f"{directory}: checkpoint has {field}={getattr(meta, field)!r}, this run "
                f"{field}={value!r}; a resume must continue the same objective"
            )
    layout, saved = (loop.world_size, loop.accum_steps), (meta.world_size, meta.accum_steps)
    if meta.microbatches_done and layout != saved:
        raise CheckpointError(
            f"{directory}: stopped inside update {meta.updates_done + 1} after "
            f"{meta.microbatches_done} of {meta.accum_steps} microbatches at R={saved[0]},"
            f"M={saved[1]}; its partial sums are per rank and per microbatch of that layout, "
            f"so it resumes only at R={saved[0]},M={saved[1]} (not R={layout[0]},M={layout[1]}). "
            "Change the layout at a checkpoint taken between updates."
        )
    if meta.microbatches_done:
        template = template._replace(
            partial=loop.zero_partial(template.params, meta.microbatches_done)
        )
    arrays = read_arrays(directory, state_arrays(template))
    return state_from_arrays(arrays, template, meta.updates_done, meta.microbatches_done)
