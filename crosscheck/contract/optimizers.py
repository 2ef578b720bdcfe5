r"""The oracle's update math: clipping by global norm, SGD and AdamW, in numpy float64.

Written from the optax and torch.optim definitions so that a full update, not only a
gradient, can be compared. Both libraries agree on the AdamW algebra,

.. math::

    m \leftarrow \beta_1 m + (1-\beta_1) g, \quad
    v \leftarrow \beta_2 v + (1-\beta_2) g^2, \quad
    \theta \leftarrow \theta - \eta \Big(
        \frac{m / (1-\beta_1^k)}{\sqrt{v / (1-\beta_2^k)} + \epsilon} + \lambda \theta \Big),

(torch applies the decay :math:`\theta (1 - \eta\lambda)` first, which is the same number), but
they clip differently: optax scales by :math:`c / \lVert g \rVert` only when
:math:`\lVert g \rVert > c`; torch's ``clip_grad_norm_`` always multiplies by
:math:`\min(1, c / (\lVert g \rVert + 10^{-6}))`. That 1e-6 is far above float64 tolerance, so
the convention is a parameter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from crosscheck.contract.fixture import Fixture
from crosscheck.contract.oracle import OracleResult, Params, loss_and_grad
from crosscheck.contract.spec import SchemeSpec

ClipConvention = Literal["optax", "torch"]
TORCH_CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_ adds this to the norm


def global_norm(grads: Params) -> float:
    """sqrt of the sum of squares over every parameter (correctly rounded inner sum)."""
    return math.sqrt(math.fsum(float(np.sum(g * g)) for g in grads.values()))


def clip_by_global_norm(
    grads: Params, max_norm: float, convention: ClipConvention = "optax"
) -> tuple[Params, float]:
    """Clip the fully reduced gradient; returns (clipped grads, norm before clipping)."""
    norm = global_norm(grads)
    if convention == "optax":
        # optax.clip_by_global_norm: g if norm < c else g / norm * c
        if norm < max_norm:
            return {k: g.copy() for k, g in grads.items()}, norm
        return {k: (g / norm) * max_norm for k, g in grads.items()}, norm
    if convention == "torch":
        coef = min(max_norm / (norm + TORCH_CLIP_EPS), 1.0)
        return {k: g * coef for k, g in grads.items()}, norm
    raise ValueError(f"clip convention must be 'optax' or 'torch', got {convention!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class SGDConfig:
    """theta <- theta - lr * g (optax.sgd / torch.optim.SGD without momentum)."""

    learning_rate: float = 0.1


@dataclass(frozen=True, kw_only=True, slots=True)
class AdamWConfig:
    """Hyperparameters of optax.adamw / torch.optim.AdamW, passed explicitly to both.

    eps defaults to 1e-6 rather than 1e-8: an update direction m / (sqrt(v) + eps) is
    sensitive to gradient noise of size ~eps, and float32 gradients carry ~1e-7 relative noise,
    so a tiny eps would turn float32 rounding into O(lr) parameter differences.
    """

    learning_rate: float = 1e-2
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-6
    weight_decay: float = 1e-2


OptimizerConfig = SGDConfig | AdamWConfig


@dataclass(slots=True)
class OptimizerState:
    """Step count and AdamW moments (empty for SGD)."""

    step: int = 0
    mu: Params = field(default_factory=dict)
    nu: Params = field(default_factory=dict)


def apply_update(
    params: Params, grads: Params, config: OptimizerConfig, state: OptimizerState
) -> tuple[Params, OptimizerState]:
    """One optimizer step on float64 params; returns new params and state (inputs untouched)."""
    step = state.step + 1
    if isinstance(config, SGDConfig):
        new = {k: params[k] - config.learning_rate * grads[k] for k in params}
        return new, OptimizerState(step=step)
    mu, nu, new = {}, {}, {}
    for k, g in grads.items():
        mu[k] = config.b1 * state.mu.get(k, np.zeros_like(g)) + (1.0 - config.b1) * g
        nu[k] = config.b2 * state.nu.get(k, np.zeros_like(g)) + (1.0 - config.b2) * g * g
        mu_hat = mu[k] / (1.0 - config.b1**step)
        nu_hat = nu[k] / (1.0 - config.b2**step)
        direction = mu_hat / (np.sqrt(nu_hat) + config.eps)
        new[k] = params[k] - config.learning_rate * (direction + config.weight_decay * params[k])
    return new, OptimizerState(step=step, mu=mu, nu=nu)


@dataclass(frozen=True, slots=True)
class UpdateRecord:
    """One optimizer update of the oracle: its objective, gradient norms and new params."""

    result: OracleResult
    grad_norm: float
    clipped_grad_norm: float
    params: Params


def train(
    fixture: Fixture,
    scheme: str | SchemeSpec,
    world_size: int = 1,
    accum_steps: int = 1,
    *,
    num_updates: int = 2,
    optimizer: OptimizerConfig | None = None,
    max_grad_norm: float | None = None,
    clip_convention: ClipConvention = "optax",
    params: Params | None = None,
) -> list[UpdateRecord]:
    """`num_updates` consecutive updates on the same global batch; one record per update.

    Clipping (when `max_grad_norm` is set) applies to the full gradient of each update,
    after accumulation and reduction, never per microbatch.
    """
    config = optimizer if optimizer is not None else AdamWConfig()
    params = fixture.params() if params is None else {k: v.copy() for k, v in params.items()}
    state = OptimizerState()
    records = []
    for _ in range(num_updates):
        result = loss_and_grad(fixture, scheme, world_size, accum_steps, params=params)
        grads, norm = result.grads, global_norm(result.grads)
        if max_grad_norm is not None:
            grads, norm = clip_by_global_norm(grads, max_grad_norm, clip_convention)
        params, state = apply_update(params, grads, config, state)
        records.append(UpdateRecord(result, norm, global_norm(grads), params))
    return records
