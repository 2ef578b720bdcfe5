r"""Measure what a wrapped model's gradient reduction does, so precount's s is not assumed.

A data-parallel wrapper turns the per-rank gradients :math:`g_r` into

.. math::

    g = \frac{1}{f} \sum_r g_r

with reduce factor f = R when it averages (DDP, FSDP's default, ``pmean``) and f = 1 when it
sums (a SUM comm hook, FSDP with ``set_gradient_divide_factor(1.0)``). precount backpropagates
:math:`(\sum_t a_t l_t)\, s / D`, which is right exactly when s = f. Frameworks differ and
wrappers stack (docs/bugs.md: missing-world-size, transformers#37474; double-world-size,
liquid-finetune#38 and transformers#48690), so the step takes s from this probe.

The probe runs one backward pass through the wrapper with the same inputs on every rank and
rank r's loss multiplied by :math:`c_r = r + 1`, so :math:`g_r = c_r G` for one gradient G,
which a plain (unwrapped) copy of the model computes locally. Then
:math:`f = (\sum_r c_r)\, G / g`. The unequal :math:`c_r` matter: a wrapper that does not
reduce at all would look like an average if every rank used the same loss; here it gives a
different f on every rank, and the probe reports it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from torch_impl.model import _full

#: Two reductions of the same gradient agree to float32 rounding (~1e-7 after a sum of R
#: terms and a division); a measured factor within this of an integer is that integer.
_SNAP_RTOL = 1e-5


class ProbeError(RuntimeError):
    """The probe could not measure a single reduce factor (see the message)."""


@dataclass(frozen=True, slots=True)
class ReductionPath:
    """What a gradient reduction does: g = (sum over ranks of g_r) / reduce_factor."""

    reduce_factor: float
    world_size: int

    @property
    def kind(self) -> str:
        """'sum' (f = 1; at R = 1 a mean is also a sum), 'mean' (f = R) or 'scaled'."""
        if self.reduce_factor == 1:
            return "sum"
        if self.reduce_factor == self.world_size:
            return "mean"
        return "scaled"

    def __str__(self) -> str:
        if self.kind == "sum":
            return "sum"
        factor = self.reduce_factor
        shown = int(factor) if float(factor).is_integer() else factor
        if self.kind == "mean":
            return f"mean, factor {shown}"
        return f"scaled, factor {shown}"


def _probe_loss(logits: torch.Tensor) -> torch.Tensor:
    # Any fixed function of the output with a gradient that is nonzero almost everywhere.
    pattern = torch.linspace(-1.0, 1.0, logits.shape[-1], dtype=logits.dtype)
    return (logits * pattern).sum()


def _grads(module: nn.Module) -> torch.Tensor:
    return torch.cat(
        [_full(p.grad).detach().to(torch.float64).flatten() for _, p in _sorted(module)]
    )


def _sorted(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return sorted((name.rsplit(".", 1)[-1], p) for name, p in module.named_parameters())


def probe_reduction(
    wrapped: nn.Module,
    reference: nn.Module,
    inputs: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
) -> ReductionPath:
    """The reduce factor of `wrapped`, measured against `reference` (an unwrapped module
    holding the same parameter values). Leaves every gradient of both set to None.

    Call on every rank with the same `inputs`; all ranks get the same answer or ProbeError.
    """
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    weight = float(rank + 1)
    weight_sum = world_size * (world_size + 1) / 2

    reference.zero_grad(set_to_none=True)
    (weight * _probe_loss(reference(inputs))).backward()
    local = _grads(reference) / weight  # G, the same on every rank
    reference.zero_grad(set_to_none=True)

    wrapped.zero_grad(set_to_none=True)
    (weight * _probe_loss(wrapped(inputs))).backward()
    reduced = _grads(wrapped)
    wrapped.zero_grad(set_to_none=True)

    expected_sum = weight_sum * local
    denom = float(torch.dot(expected_sum, reduced))
    if not float(torch.dot(local, local)) > 0 or denom == 0:
        raise ProbeError(
            f"rank {rank}: the probe gradient is zero; load nonzero parameters before probing"
        )
    factor = float(torch.dot(expected_sum, expected_sum)) / denom
    residual = float((reduced * factor - expected_sum).norm() / expected_sum.norm())
    if not residual <= _SNAP_RTOL:
        raise ProbeError(
            f"rank {rank}: the reduced gradient is not a multiple of the summed one "
            f"(relative residual {residual:.2e}); the reduction is not a scaled sum"
        )
    if abs(factor - round(factor)) <= _SNAP_RTOL * abs(factor):
        factor = float(round(factor))

    # Every rank must have measured the same f: a wrapper that does not reduce gives
    # f = sum(c) / c_r, different on every rank.
    extremes = torch.tensor([factor, -factor], dtype=torch.float64)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    high, low = float(extremes[0]), -float(extremes[1])
    if high != low:
        raise ProbeError(
            f"ranks measured different reduce factors ({low:g} to {high:g}): the gradients "
            "are not being reduced across ranks"
        )
    return ReductionPath(reduce_factor=factor, world_size=world_size)


def probe_ddp(ddp: nn.Module, inputs: torch.Tensor) -> ReductionPath:
    """`probe_reduction` for a DistributedDataParallel model, against a copy of ddp.module.

    The copy has fresh parameter tensors, so DDP's autograd hooks never see its backward.
    """
    reference = copy.deepcopy(ddp.module)
    return probe_reduction(ddp, reference, inputs, group=ddp.process_group)
