"""One optimizer update from a fully reduced gradient: clip by global norm, optimizer, metrics.

Every front-end computes the reduced gradient of the update in one program (compiled per batch
shape) and hands it to one optimizer program (compiled once per parameter shape): clipping and
the optimizer do not depend on the batch layout, so they are not recompiled with it. Clipping
applies to the gradient of the whole update, after accumulation over microbatches and
reduction over ranks, never per microbatch (clipping each microbatch is transformers#986 and
gpt-jax#2 with optax.apply_every).

Inside a compiled step nothing can raise, so a NaN or inf is looked for after it, outside jit
(`check_finite`): one ``isfinite`` reduction over the reduced gradient and a look at the [R]
per-rank loss sums, per update. Only when one is not finite does a diagnosis pass recompute
each (rank, microbatch)'s loss sum and local gradient (`accumulate.microbatch_finiteness`) to
name where it first appeared; `NonFiniteError` says so. The ready-made update (`with_optimizer`)
runs the check before the optimizer step unless ``StepConfig(check_finite=False)``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_impl.accumulate import (
    AxisName,
    Collective,
    RankGradients,
    RankGradientsFn,
    Strategy,
    accumulate_microbatches,
    finish_rank,
    microbatch_finiteness,
    rank_plan,
    spec_terms_once,
)
from jax_impl.batch import Batch
from jax_impl.losses import TokenLossesFn
from jax_impl.model import Params
from jax_impl.spec import SchemeSpec, parse_spec


@dataclass(frozen=True, kw_only=True, slots=True)
class StepConfig:
    """How one update is computed: the scheme spec, the strategy, the collective, the optimizer.

    `scheme` is a `SchemeSpec`, its JSON form or a name of docs/schemes-as-data.md's table
    (``"token_mean"``, ``"rank_mean"``, ``"constant:4096"``, ...); strings are accepted for
    the two enums. `gradients` replaces the intended per-rank gradient (a reproduced bug, a
    `RankGradientsFn`); `reduce_factor` overrides s in precount. `token_losses_fn` is the
    model's l_t (None: the bilinear model). `check_finite`: the ready-made update raises
    `NonFiniteError` (naming the rank and microbatch) instead of stepping the optimizer on a
    NaN or inf; it costs one host sync per update (turn it off to keep updates dispatching
    asynchronously).
    """

    optimizer: optax.GradientTransformation
    scheme: SchemeSpec = field(default_factory=lambda: parse_spec("token_mean"))
    strategy: Strategy = Strategy.PRECOUNT
    collective: Collective = Collective.PSUM
    max_grad_norm: float | None = None
    reduce_factor: float | None = None
    axis_name: str = "data"
    gradients: RankGradientsFn | None = None
    token_losses_fn: TokenLossesFn | None = None
    check_finite: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "scheme", parse_spec(self.scheme))
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


def over_configs(
    fn: Callable[..., Any], params: Sequence[Params], batch: Batch, *per_config: Sequence[jax.Array]
) -> list[Any]:
    """[fn(params[k], batch, *(xs[k] for xs in per_config)) for every config k], computed as
    one call of ``vmap(fn)`` over the configs (the batch is shared): the program holds `fn`
    once, batched, instead of once per config."""
    stacked = [jnp.stack(xs) for xs in per_config]
    out = jax.vmap(fn, in_axes=(0, None, *(0 for _ in stacked)))(
        jax.tree.map(lambda *xs: jnp.stack(xs), *params), batch, *stacked
    )
    return [jax.tree.map(lambda x, k=k: x[k], out) for k in range(len(params))]


def sweep_rank_gradients(
    configs: Sequence[StepConfig],
    params: Sequence[Params],
    rank_batch: Batch,
    axis_name: AxisName,
) -> list[RankGradients]:
    """Every config's reduced gradient, as one rank sees it; call inside `axis_name`'s mapping.

    The intended configs (no `gradients`) that train the same model (`token_losses_fn`) share
    one accumulation: each config's plan is computed from the labels (`rank_plan`), then one
    ``lax.scan`` runs every config's microbatches at once, batched over the configs with
    ``vmap`` (each its own params, a_t and scales), then each config's collective and
    normalization (`finish_rank`). Per config these are the sums of `rank_gradients` (the
    batched reductions may round differently in the last bit); the program holds one forward
    and backward instead of one per config, which halves the compile time of a sweep of
    every v1 scheme in three variants. A config with its own `gradients` (a reproduced bug)
    runs alone.
    """
    out: list[RankGradients | None] = [None] * len(configs)
    families: dict[object, list[int]] = {}
    for i, config in enumerate(configs):
        if config.gradients is not None:
            out[i] = config.gradients(params[i], rank_batch, axis_name)
        else:
            families.setdefault(config.token_losses_fn, []).append(i)

    for token_losses_fn, members in families.items():
        terms = spec_terms_once(
            [(configs[i].scheme, configs[i].strategy) for i in members], rank_batch, axis_name
        )
        plans = [
            rank_plan(
                configs[i].scheme,
                rank_batch,
                axis_name,
                configs[i].strategy,
                configs[i].collective,
                configs[i].reduce_factor,
                terms=terms[configs[i].scheme],
            )
            for i in members
        ]
        sums = over_configs(
            functools.partial(accumulate_microbatches, token_losses_fn=token_losses_fn),
            [params[i] for i in members],
            rank_batch,
            [plan.token_weights for plan in plans],
            [plan.grad_scale for plan in plans],
            [plan.loss_scale for plan in plans],
        )
        for i, plan, own in zip(members, plans, sums, strict=True):
            config = configs[i]
            out[i] = finish_rank(
                config.scheme, plan, own, rank_batch, axis_name, config.strategy,
                config.collective,
            )  # fmt: skip
    return out  # type: ignore[return-value]


class ReducedGradients(NamedTuple):
    """A front-end's gradient of one update: per-rank fields are [R], the rest replicated."""

    grads: Params  # the fully reduced gradient of the objective, before clipping (params' dtype)
    rank_valid_tokens: jax.Array  # [R] int32
    rank_loss_sums: jax.Array  # [R], a rank's loss sum (`jax_impl.accumulate.RankGradients`)
    global_denominator: jax.Array  # D, or K for U = rank / microbatch (denominator dtype)
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


def sweep_from(
    program: Callable[..., tuple[ReducedGradients, ...]],
    num_configs: int,
    place_batch: Callable[[Batch], Batch],
) -> SweepFn:
    """The sweep a front-end hands out: sweep(params per config, batch).

    `place_batch` checks the [R, M, B, T] batch and puts it where the front-end's program wants
    it; the params must be one tree per config. Then ``program(params, batch)`` computes every
    config, each with its own scheme spec (static: one compile per batch shape serves every
    config of the sweep).
    """

    def sweep(params: Sequence[Params], batch: Batch) -> tuple[ReducedGradients, ...]:
        batch = place_batch(batch)
        params = check_sweep_params(params, num_configs)
        return program(params, batch)

    return sweep


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


class NonFiniteError(FloatingPointError):
    """A NaN or inf in an update's loss or gradient; the message names the rank and microbatch
    where it first appeared (the microbatches run in order, every rank at once)."""


@jax.jit
def _tree_finite(tree: Params) -> jax.Array:
    """One bool: every leaf of `tree` is finite (one reduction, one host sync to read it)."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def _to_host(x: jax.Array) -> np.ndarray:
    """A (possibly multi-process) array as numpy; every process must call this together."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _params_hint(params: Params) -> str:
    bad = [name for name, value in params.items() if not bool(_tree_finite({name: value}))]
    if bad:
        return f"the params hold NaN or inf in {', '.join(sorted(bad))}"
    return "the params are finite, so a logit or a loss overflowed (params too large?)"


def describe_non_finite(
    reduced: ReducedGradients, params: Params, batch: Batch, spec: SchemeSpec
) -> str:
    """Where a non-finite update's NaN or inf first appeared, in words (the diagnosis pass)."""
    loss_ok, grad_ok = (_to_host(x) for x in microbatch_finiteness(params, batch, spec))
    R, M = loss_ok.shape
    # Time order: microbatch m runs on every rank before microbatch m + 1 anywhere.
    bad = [(r, m) for m in range(M) for r in range(R) if not (loss_ok[r, m] and grad_ok[r, m])]
    hint = _params_hint(params)
    if not bad:
        D = _to_host(reduced.global_denominator)
        return (
            "the update's gradient or loss holds NaN or inf, but every microbatch's loss sum "
            "and local gradient is finite: it appeared when they were summed over microbatches "
            f"and ranks, or divided by D = {D.item()!r}; {hint}"
        )
    r, m = bad[0]
    what = "loss sum" if not loss_ok[r, m] else "gradient (local, before any reduction)"
    listing = ", ".join(f"rank {r2} microbatch {m2}" for r2, m2 in bad[:8])
    more = f" and {len(bad) - 8} more" if len(bad) > 8 else ""
    return (
        f"non-finite {what} first at rank {r}, microbatch {m} (of R={R} ranks x M={M} "
        f"microbatches; affected: {listing}{more}); {hint}"
    )


def check_finite(reduced: ReducedGradients, params: Params, batch: Batch, spec: SchemeSpec) -> None:
    """Raise NonFiniteError when an update's gradient, loss or per-rank loss sums hold a NaN or
    inf, naming the rank and microbatch where it first appeared; call outside jit.

    The happy path costs one ``isfinite`` reduction over the gradient and reading R + 1
    scalars; the diagnosis pass (`describe_non_finite`) runs only when something is wrong.
    `params` and `batch` are the ones the update was given ([R, M, B, T]).
    """
    finite = bool(_tree_finite(reduced.grads)) and bool(
        np.isfinite(_to_host(reduced.rank_loss_sums)).all()
        and np.isfinite(_to_host(reduced.loss)).all()
    )
    if not finite:
        raise NonFiniteError(describe_non_finite(reduced, params, batch, spec))


def single_config(sweep: SweepFn) -> GradientsFn:
    """gradients(params, ...) of a sweep built from one config: its only result."""

    def gradients(params: Params, *args, **kwargs) -> ReducedGradients:
        return sweep([params], *args, **kwargs)[0]

    return gradients


def with_optimizer(gradients: GradientsFn, config: StepConfig) -> UpdateFn:
    """update(params, opt_state, batch) -> UpdateResult, under `config`'s scheme spec.

    `gradients(params, batch)` is a front-end's reduced gradient. With ``config.check_finite``
    a NaN or inf raises NonFiniteError before the optimizer step.
    """

    def update(params: Params, opt_state: optax.OptState, batch: Batch) -> UpdateResult:
        reduced = gradients(params, batch)
        if config.check_finite:
            check_finite(reduced, params, batch, config.scheme)
        return apply_optimizer(reduced, params, opt_state, config)

    return update
