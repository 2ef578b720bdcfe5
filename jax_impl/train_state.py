"""The state of a resumable run (`jax_impl.resume`), and its array form: what a checkpoint stores.

`TrainState` is what a resumed run needs: replicated params and optax state, the number of
complete updates and, for a stop inside an accumulation window, the per-rank partial sums of
that window (`PartialWindow`). `state_arrays` and `state_from_arrays` turn it into a tree of
numpy arrays and back (`jax_impl.checkpoint` saves and reads that tree; the progress counters
go into the checkpoint's metadata).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

from jax_impl.model import Params


class PartialWindow(NamedTuple):
    """Per-rank sums over the first `done` microbatches of a window; array leaves are [R, ...].

    Nothing here has been through a collective: each rank's row is its own.
    """

    done: int  # microbatches of the window accumulated, 0 < done < M
    grad_sums: Params  # [R, ...]: sum over m < done of grad((sum_t a_t l_t) * grad_scale_m)
    loss_sums: jax.Array  # [R]: sum over m < done of (sum_t a_t l_t) * loss_scale_m
    denominator: jax.Array  # [R, M]: the window's D (or D_u) per microbatch; 0 until known


class TrainState(NamedTuple):
    """Everything a resumed run needs: replicated params and optax state, and progress."""

    params: Params
    opt_state: optax.OptState
    updates_done: int
    partial: PartialWindow | None = None


def state_arrays(state: TrainState) -> dict[str, Any]:
    """The array part of a state as a tree of numpy arrays (what a checkpoint stores)."""
    leaves = jax.tree.leaves(state.opt_state)
    arrays: dict[str, Any] = {
        "params": {k: np.asarray(v) for k, v in state.params.items()},
        "opt_state": {f"leaf_{i:03d}": np.asarray(x) for i, x in enumerate(leaves)},
    }
    if state.partial is not None:
        p = state.partial
        arrays["partial"] = {
            "grad_sums": {k: np.asarray(v) for k, v in p.grad_sums.items()},
            "loss_sums": np.asarray(p.loss_sums),
            "denominator": np.asarray(p.denominator),
        }
    return arrays


def state_from_arrays(
    arrays: Mapping[str, Any], template: TrainState, updates_done: int, microbatches_done: int
) -> TrainState:
    """Inverse of `state_arrays`: `template` (a state of this run) gives the optax tree."""
    treedef = jax.tree.structure(template.opt_state)
    opt_leaves = [arrays["opt_state"][f"leaf_{i:03d}"] for i in range(treedef.num_leaves)]
    device = jax.tree.leaves(template.params)[0].devices().pop()
    as_device = functools.partial(jax.device_put, device=device)
    partial = None
    if microbatches_done:
        p = arrays["partial"]
        partial = PartialWindow(
            microbatches_done,
            dict(p["grad_sums"]),
            p["loss_sums"],
            p["denominator"],
        )
    return TrainState(
        params={k: as_device(v) for k, v in arrays["params"].items()},
        opt_state=jax.tree.unflatten(treedef, [as_device(x) for x in opt_leaves]),
        updates_done=updates_done,
        partial=partial,
    )
