"""One optimizer update from a fully reduced gradient: clip by global norm, optimizer, metrics.

Every front-end computes the reduced gradient of the update in one program (compiled per batch
shape) and hands it to one optimizer program (compiled once per parameter shape): clipping and
the optimizer do not depend on the batch layout, so they are not recompiled with it. Clipping
applies to the gradient of the whole update, after accumulation over microbatches and
reduction over ranks, never per microbatch (clipping each microbatch is transformers#986 and
gpt-jax#2 with optax.apply_every).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jax_impl.accumulate import Collective, RankGradientsFn, Strategy, rank_gradients
from jax_impl.losses import Microbatch
from jax_impl.model import Params
from jax_impl.schemes import Scheme


@dataclass(frozen=True, kw_only=True, slots=True)
class StepConfig:
    """How one update is computed; strings are accepted for the two enums.

    `gradients` replaces the intended per-rank gradient (a reproduced bug such as
    ``jax_impl.accidental.rank_mean_gradients``); `reduce_factor` overrides s in precount.
    """

    optimizer: optax.GradientTransformation
    strategy: Strategy = Strategy.PRECOUNT
    collective: Collective = Collective.PSUM
    max_grad_norm: float | None = None
    reduce_factor: float | None = None
    axis_name: str = "data"
    gradients: RankGradientsFn | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "strategy", Strategy(self.strategy))
        object.__setattr__(self, "collective", Collective(self.collective))
        if self.strategy is Strategy.POSTNORM and (
            self.collective is not Collective.PSUM or self.reduce_factor is not None
        ):
            raise ValueError(
                "StepConfig: postnorm reduces unnormalized sums with one psum and divides by "
                f"D after; got collective={self.collective.value!r}, "
                f"reduce_factor={self.reduce_factor!r}"
            )
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"StepConfig: max_grad_norm must be > 0, got {self.max_grad_norm!r}")

    def rank_gradients_fn(self) -> RankGradientsFn:
        """The per-rank gradient function this config describes."""
        if self.gradients is not None:
            return self.gradients
        return functools.partial(
            rank_gradients,
            strategy=self.strategy,
            collective=self.collective,
            scale_override=self.reduce_factor,
        )


class ReducedGradients(NamedTuple):
    """A front-end's gradient of one update: per-rank fields are [R], the rest replicated."""

    grads: Params  # the fully reduced gradient of the objective, before clipping (params' dtype)
    rank_valid_tokens: jax.Array  # [R] int32
    rank_loss_sums: jax.Array  # [R], sum of a_t l_t per rank (denominator dtype)
    global_denominator: jax.Array  # D (denominator dtype: float64 under x64, else float32)
    loss: jax.Array  # the objective L (denominator dtype)


class UpdateMetrics(NamedTuple):
    """Per-update metrics. Per-rank fields are [R]; the rest are scalars."""

    rank_valid_tokens: jax.Array  # [R] int32
    rank_loss_sums: jax.Array  # [R], sum of a_t l_t per rank (denominator dtype)
    global_denominator: jax.Array  # D (denominator dtype)
    loss: jax.Array  # the objective L (denominator dtype)
    grad_norm: jax.Array  # global norm of the reduced gradient, before clipping
    clipped_grad_norm: jax.Array  # after clipping (equal when no clipping happened)


class UpdateResult(NamedTuple):
    """New params and optimizer state, the reduced gradient (before clipping) and metrics."""

    params: Params
    opt_state: optax.OptState
    grads: Params
    metrics: UpdateMetrics


def apply_clipped_update(
    params: Params,
    opt_state: optax.OptState,
    grads: Params,
    optimizer: optax.GradientTransformation,
    max_grad_norm: float | None,
) -> tuple[Params, optax.OptState, jax.Array, jax.Array]:
    """Clip the reduced gradient by its global norm, then step the optimizer.

    Returns (params, opt_state, norm before clipping, norm after clipping). The clip is kept
    out of the optimizer chain so that both norms can be reported; optax's rule is
    g if ||g|| < c else g c / ||g||.
    """
    grad_norm = optax.tree.norm(grads)
    if max_grad_norm is not None:
        clipped, _ = optax.clip_by_global_norm(max_grad_norm).update(grads, optax.EmptyState())
    else:
        clipped = grads
    updates, opt_state = optimizer.update(clipped, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, grad_norm, optax.tree.norm(clipped)


@functools.cache
def optimizer_step(
    optimizer: optax.GradientTransformation, max_grad_norm: float | None
) -> Callable[..., tuple[Params, optax.OptState, jax.Array, jax.Array]]:
    """`apply_clipped_update` jitted once per (optimizer, threshold), shared by front-ends."""
    return jax.jit(
        functools.partial(apply_clipped_update, optimizer=optimizer, max_grad_norm=max_grad_norm)
    )


GradientsFn = Callable[..., ReducedGradients]
SweepFn = Callable[..., tuple[ReducedGradients, ...]]
UpdateFn = Callable[..., UpdateResult]


def scheme_index(scheme: Scheme | str | int) -> jax.Array:
    """A scheme name, Scheme or int as the int32 array a compiled step takes (traced there)."""
    return jnp.asarray(int(Scheme.from_name(scheme)), dtype=jnp.int32)


def check_sweep(configs: Sequence[StepConfig]) -> tuple[StepConfig, ...]:
    """Configs computed side by side in one program must share the mapped axis."""
    configs = tuple(configs)
    if not configs:
        raise ValueError("a gradient sweep needs at least one StepConfig")
    axes = {c.axis_name for c in configs}
    if len(axes) != 1:
        raise ValueError(f"configs of one sweep must share axis_name, got {sorted(axes)}")
    return configs


def check_sweep_params(params: Sequence[Params], num_configs: int) -> tuple[Params, ...]:
    """A sweep takes one params tree per config (their updates diverge after the first)."""
    if isinstance(params, dict) or len(params) != num_configs:
        got = "one params dict" if isinstance(params, dict) else f"{len(params)} params trees"
        raise ValueError(f"a sweep of {num_configs} configs takes one params per config, got {got}")
    return tuple(params)


def apply_optimizer(
    reduced: ReducedGradients, params: Params, opt_state: optax.OptState, config: StepConfig
) -> UpdateResult:
    """Finish an update: clip and step `config`'s optimizer on a front-end's reduced gradient.

    The optimizer program runs wherever the gradient lives (one device, or replicated over a
    mesh that may span processes).
    """
    step = optimizer_step(config.optimizer, config.max_grad_norm)
    params, opt_state, grad_norm, clipped_norm = step(params, opt_state, reduced.grads)
    metrics = UpdateMetrics(
        rank_valid_tokens=reduced.rank_valid_tokens,
        rank_loss_sums=reduced.rank_loss_sums,
        global_denominator=reduced.global_denominator,
        loss=reduced.loss,
        grad_norm=grad_norm,
        clipped_grad_norm=clipped_norm,
    )
    return UpdateResult(params, opt_state, reduced.grads, metrics)


def single_config(sweep: SweepFn) -> GradientsFn:
    """gradients(params, ...) of a sweep built from one config: its only result."""

    def gradients(params: Params, *args, **kwargs) -> ReducedGradients:
        return sweep([params], *args, **kwargs)[0]

    return gradients


def with_optimizer(gradients: GradientsFn, config: StepConfig) -> UpdateFn:
    """update(params, opt_state, batch, scheme, constant_normalizer=0.0) -> UpdateResult.

    `gradients(params, batch, scheme, constant_normalizer)` is a front-end's reduced gradient.
    """

    def update(
        params: Params,
        opt_state: optax.OptState,
        batch: Microbatch,
        scheme: Scheme | str | int = Scheme.TOKEN_MEAN,
        constant_normalizer: float = 0.0,
    ) -> UpdateResult:
        reduced = gradients(params, batch, scheme, constant_normalizer)
        return apply_optimizer(reduced, params, opt_state, config)

    return update
