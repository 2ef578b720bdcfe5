"""The end of an update: clip the reduced gradient by its global norm, step, and record it.

After accumulation (``torch_impl.update``) every rank holds the fully reduced gradient.
Clipping is by its global norm, never per microbatch (docs/bugs.md clip-per-microbatch,
transformers#986), and in float64 whatever the params' dtype: the norm and the clip factor
never take a bf16 or float32 rounding. `metrics` is the update's record on one rank
(`UpdateMetrics`: counts, loss sums and D of every rank, the objective, the norms).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from torch_impl.losses import accumulation_dtype
from torch_impl.model import _full
from torch_impl.update import Accumulated


@dataclass(frozen=True, kw_only=True, slots=True)
class UpdateMetrics:
    """What one update computed, as seen from one rank (the per-rank tuples are global)."""

    rank: int
    world_size: int
    accum_steps: int
    scheme: str
    strategy: str
    #: Valid targets of every rank over its M microbatches, [R].
    rank_valid_tokens: tuple[int, ...]
    #: sum_t a_t l_t of every rank over its M microbatches, [R].
    rank_loss_sums: tuple[float, ...]
    #: Every rank's share of D (scope update, D additive over ranks); 0 otherwise, [R].
    rank_denominators: tuple[float, ...]
    #: What the summed gradient is divided by: D (scope update) or K (local scopes).
    global_denominator: float
    #: K: units of the spec's scope (1, R or R M), and D of this rank's units.
    num_units: int
    unit_denominators: tuple[float, ...]
    #: L = sum of the loss sums / D (0 when D = 0: no token carries weight).
    objective: float
    #: Global L2 norm of the reduced gradient, before and after clipping.
    grad_norm: float
    clipped_grad_norm: float

    @property
    def local_valid_tokens(self) -> int:
        return self.rank_valid_tokens[self.rank]

    @property
    def global_valid_tokens(self) -> int:
        return sum(self.rank_valid_tokens)


def _parameters(model: nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


def global_grad_norm(model: nn.Module) -> float:
    r"""L2 norm over every parameter's (reduced) gradient, :math:`\sqrt{\sum_p \|g_p\|^2}`.

    Accumulated in ``accumulation_dtype`` (float64 on CPU): ``get_total_norm`` on bf16
    gradients would return a bf16 norm, 8 significant bits, for the log and the clip factor.
    Sharded (FSDP2) gradients stay DTensors through the upcast; their norm is all-reduced.
    """
    grads = [p.grad for p in _parameters(model) if p.grad is not None]
    if not grads:
        return 0.0
    acc = accumulation_dtype(grads[0].device)
    return float(_full(torch.nn.utils.get_total_norm([g.detach().to(acc) for g in grads])))


def clip_and_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float | None
) -> tuple[float, float]:
    r"""Clip the reduced gradient by its global norm (torch convention), then step.

    The factor is ``clip_grad_norm_``'s, :math:`\min(1, c / (\|g\| + 10^{-6}))`, unlike
    optax, which scales only when :math:`\|g\| > c`; crosscheck's ``clip_convention="torch"``
    models this one. The norm and the factor are float64 (``global_grad_norm``) and the factor
    multiplies each gradient in the gradient's own dtype (torch keeps a Python scalar in
    float32 for a bf16 tensor), so a bf16 model is not clipped by a bf16-rounded norm. For
    float64 gradients this is ``clip_grad_norm_``'s arithmetic, bit for bit.
    Returns (norm before clipping, norm after).
    """
    norm = clipped = global_grad_norm(model)
    if max_grad_norm is not None:
        # Written as clip_grad_norm_ computes it (Tensor.__rtruediv__ is a reciprocal, then a
        # product), so float64 gradients are clipped bit for bit as torch clips them.
        factor = max_grad_norm * (1.0 / (norm + 1e-6))
        # `not factor >= 1` also multiplies by a NaN factor: a NaN norm must not pass silently.
        if not factor >= 1.0:
            with torch.no_grad():
                for param in _parameters(model):
                    if param.grad is not None:
                        param.grad.mul_(factor)
            # Measured again, not derived: the norm of what the optimizer receives. An
            # unclipped gradient is unchanged, and so is its norm (under FSDP2 the second
            # norm would be a second collective of every update).
            clipped = global_grad_norm(model)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm, clipped


def metrics(
    accumulated: Accumulated,
    *,
    rank: int,
    accum_steps: int,
    strategy: str,
    grad_norm: float,
    clipped_grad_norm: float,
) -> UpdateMetrics:
    """The per-update record of one rank."""
    return UpdateMetrics(
        rank=rank,
        world_size=len(accumulated.rank_valid_tokens),
        accum_steps=accum_steps,
        scheme=accumulated.spec,
        strategy=strategy,
        rank_valid_tokens=accumulated.rank_valid_tokens,
        rank_loss_sums=accumulated.rank_loss_sums,
        rank_denominators=accumulated.rank_denominators,
        global_denominator=accumulated.global_denominator,
        num_units=accumulated.num_units,
        unit_denominators=accumulated.unit_denominators,
        objective=accumulated.objective,
        grad_norm=grad_norm,
        clipped_grad_norm=clipped_grad_norm,
    )
