r"""A resumable update loop under ``jax.pmap``: stop between updates or inside a window, go on.

One update accumulates M microbatches per rank, reduces across the R ranks, normalizes by the
global denominator D, clips and steps the optimizer (as `jax_impl.accumulate` and
`jax_impl.update` do in one program). Here the window is split at microbatch j: microbatches
[0, j) are accumulated per rank without any gradient collective, the per-rank partial sums
can be checkpointed, and on resume [j, M) continue from those sums:

.. math::

    g_r = \sum_{m<j} \nabla(\textstyle\sum_t a_t l_t)\,c \;+\; \sum_{m \ge j} \nabla(\ldots)\,c,
    \qquad c = s/D \text{ (precount)},\ c = 1 \text{ (postnorm)}

The scan carry of the second part starts from the saved first-part sums, so the additions
happen in the same order as in an unsplit window; then the collective (pmean or psum), the
normalization, the clip and the optimizer run exactly as for an uninterrupted update.

- precount: D comes first from the labels of the whole window (one psum of the d channels,
  no gradients); it is saved with the partial sums and recomputed on resume as a check that
  the batch and layout are the ones the sums belong to.
- postnorm: the partial sums include each rank's d channels (count, weight sum) and loss sum
  of [0, j); after [j, M) one psum carries gradient sums, loss sums and d, then g / D.

Dtypes as in `jax_impl.denominators`: counts are int32 until D, the weight sums are
`ExactSum` pairs in the denominator dtype (float64 under x64, else float32) and are saved as
pairs, so that a window stopped and resumed sums its weights exactly as an unbroken one; the
loss sums and g / D are in that dtype too, the gradient sums in the params' dtype.

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
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_impl.accumulate import (
    Strategy,
    continue_accumulation,
    reduce_denominator,
    reduce_factor,
    reduce_postnorm,
    reduce_precount,
)
from jax_impl.checkpoint import (
    CheckpointError,
    CheckpointMeta,
    read_arrays,
    read_meta,
    save_checkpoint,
)
from jax_impl.denominators import ExactSum, add_exact, denominator_dtype, exact_sum
from jax_impl.devices import check_rank_axis, require_devices
from jax_impl.losses import Microbatch
from jax_impl.model import Params
from jax_impl.schemes import Scheme, safe_denominator, scheme_terms
from jax_impl.train_state import PartialWindow, TrainState, state_arrays, state_from_arrays
from jax_impl.update import ReducedGradients, StepConfig, apply_optimizer, scheme_index


class _Sums(NamedTuple):
    grad_sums: Params
    loss_sums: jax.Array
    counts: jax.Array
    weight_sums: ExactSum


def _window_denominator(window: Microbatch, scheme, normalizer, *, axis_name: str):
    """D of the whole window from labels only (`jax_impl.accumulate.reduce_denominator`)."""
    terms = scheme_terms(scheme, window.targets, window.segment_ids, window.weights)
    local_count = jnp.sum(terms.count, dtype=jnp.int32)
    return reduce_denominator(
        scheme, local_count, exact_sum(terms.weight_sum), normalizer, axis_name
    )


def _accumulate(params: Params, part: Microbatch, sums: _Sums, scale, scheme) -> _Sums:
    """Continue one rank's sums over the microbatches of `part` [k, B, T]; no collective."""
    terms = scheme_terms(scheme, part.targets, part.segment_ids, part.weights)
    grads, loss = continue_accumulation(
        params, part, terms.token_weights, scale, (sums.grad_sums, sums.loss_sums)
    )
    return _Sums(
        grads,
        loss,
        sums.counts + jnp.sum(terms.count, dtype=jnp.int32),
        add_exact(sums.weight_sums, exact_sum(terms.weight_sum)),
    )


def _finish(sums: _Sums, D, scheme, normalizer, *, axis_name: str, strategy, collective):
    """The collective and the normalization of a completed window, on one rank: the same
    reductions as an uninterrupted update (`jax_impl.accumulate.rank_gradients`)."""
    if strategy is Strategy.PRECOUNT:
        grads, total_loss = reduce_precount(sums.grad_sums, sums.loss_sums, collective, axis_name)
    else:
        grads, total_loss, D = reduce_postnorm(*sums, scheme, normalizer, axis_name)
    return grads, D, total_loss / safe_denominator(D)


def _rank0(x: jax.Array) -> jax.Array:
    return x.addressable_data(0)[0]


class ResumableLoop:
    """The update loop of one strategy at one layout (R, M); every program compiled once.

    `config` must describe the intended step (no `gradients`, no `reduce_factor` override):
    a reproduced bug has nothing to resume. The scheme is a traced index, so one loop
    serves every scheme.
    """

    def __init__(self, config: StepConfig, world_size: int, accum_steps: int) -> None:
        if config.gradients is not None or config.reduce_factor is not None:
            raise ValueError("ResumableLoop runs the intended step: no gradients/reduce_factor")
        self.config, self.world_size, self.accum_steps = config, world_size, accum_steps
        self.devices = require_devices(world_size)
        axis = config.axis_name
        pmap = functools.partial(jax.pmap, axis_name=axis, devices=self.devices)
        self._denominator = pmap(
            functools.partial(_window_denominator, axis_name=axis), in_axes=(0, None, None)
        )
        self._accumulate = pmap(_accumulate, in_axes=(None, 0, 0, None, None))
        self._finish = pmap(
            functools.partial(
                _finish, axis_name=axis, strategy=config.strategy, collective=config.collective
            ),
            in_axes=(0, None, None, None),
        )

    def init(self, params: Params) -> TrainState:
        """Update 0: params on rank 0's device and the optimizer's initial state."""
        params = jax.device_put(params, self.devices[0])
        return TrainState(params, jax.jit(self.config.optimizer.init)(params), 0)

    def _zero_sums(self, params: Params) -> _Sums:
        """Empty per-rank sums: gradients in the params' dtype, the rest in the denominator
        dtype (or int32)."""
        R, dtype = self.world_size, denominator_dtype()
        return _Sums(
            {k: np.zeros((R, *v.shape), v.dtype) for k, v in params.items()},
            np.zeros((R,), dtype),
            np.zeros((R,), np.int32),
            ExactSum(np.zeros((R,), dtype), np.zeros((R,), dtype)),
        )

    def run(
        self,
        state: TrainState,
        batch: Microbatch,
        scheme: Scheme | str | int,
        *,
        until_updates: int,
        then_microbatches: int = 0,
        constant_normalizer: float = 0.0,
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
            state = self._window(state, batch, scheme, stop, constant_normalizer)
        if (state.updates_done, state.partial.done if state.partial else 0) != target:
            raise ValueError(
                f"ResumableLoop: the state is past the requested stop {target} "
                f"(updates_done={state.updates_done}, partial={bool(state.partial)})"
            )
        return state

    def _window(self, state: TrainState, batch: Microbatch, scheme, stop: int, normalizer):
        """Accumulate the window's microbatches [done, stop); complete the update at M."""
        config, params = self.config, state.params
        index = scheme_index(scheme)
        dtype = denominator_dtype()
        normalizer = jnp.asarray(normalizer, dtype)  # C like D: not in the params' dtype
        start = state.partial.done if state.partial else 0
        if state.partial is None:
            sums = self._zero_sums(params)
        else:
            p = state.partial
            sums = _Sums(p.grad_sums, p.loss_sums, p.counts, p.weight_sums)
        if config.strategy is Strategy.PRECOUNT:
            D = _rank0(self._denominator(batch, index, normalizer))
            if state.partial is not None and not np.array_equal(D, state.partial.denominator):
                raise ValueError(
                    f"resume: the window's D is {float(D)!r} here but {float(p.denominator)!r} "
                    "in the saved partial window: not the batch, scheme or layout it was taken on"
                )
            s = reduce_factor(config.collective, self.world_size)
            scale = jnp.asarray(s, D.dtype) / safe_denominator(D)
        else:
            D = jnp.zeros((), dtype)
            scale = jnp.ones((), dtype)
        part = Microbatch(*(np.asarray(x)[:, start:stop] for x in batch))
        sums = self._accumulate(params, part, sums, scale, index)
        if stop < self.accum_steps:
            partial = PartialWindow(stop, sums.grad_sums, sums.loss_sums, sums.counts,
                                    sums.weight_sums, D)  # fmt: skip
            return state._replace(partial=partial)
        grads, D, loss = self._finish(sums, D, index, normalizer)
        reduced = ReducedGradients(
            grads=jax.tree.map(_rank0, grads),
            rank_valid_tokens=jnp.sum(np.asarray(batch.targets) != -100, axis=(1, 2, 3)),
            rank_loss_sums=sums.loss_sums,
            global_denominator=_rank0(D),
            loss=_rank0(loss),
        )
        out = apply_optimizer(reduced, params, state.opt_state, config)
        return TrainState(out.params, out.opt_state, state.updates_done + 1, None)


def save_train_state(
    directory: str | Path, loop: ResumableLoop, state: TrainState, scheme: str, fingerprint: str
) -> Path:
    """Checkpoint `state` of `loop` atomically (orbax) to `directory`; returns the path.

    `fingerprint` is `jax_impl.checkpoint.batch_fingerprint` of the global batch.
    """
    meta = CheckpointMeta(
        scheme=Scheme.from_name(scheme).label,
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
    directory: str | Path, loop: ResumableLoop, params: Params, scheme: str, fingerprint: str
) -> TrainState:
    """The state saved in `directory`, checked against this run, ready for `loop.run`.

    `params` are initial params of this run (they give shapes and dtype, not values). Raises
    CheckpointError naming the mismatch when the checkpoint is unfinalized, of another
    scheme, strategy, dtype or batch, or stopped mid-window at another layout than `loop`'s.
    """
    meta = read_meta(directory)
    template = loop.init(params)
    here = {
        "scheme": Scheme.from_name(scheme).label,
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
        zeros = loop._zero_sums(template.params)
        template = template._replace(
            partial=PartialWindow(meta.microbatches_done, *zeros, np.zeros((), zeros[1].dtype))
        )
    arrays = read_arrays(directory, state_arrays(template))
    return state_from_arrays(arrays, template, meta.updates_done, meta.microbatches_done)
