r"""One accumulation window on one DDP rank: the pieces every loop of the bug catalogue uses.

A window is one optimizer update's backward passes over this rank's M microbatches
(`Window`: where it runs, and what a loop keeps between windows). The intended token mean is
:math:`g = \nabla \sum_t v_t l_t / D`; DDP *averages* the R ranks' gradients, so a correct
loop backpropagates :math:`R \sum_{t \in (r, m)} v_t l_t / D` on every microbatch, syncing
only the last (`scaled_sum_window` with scale R and the global D). The buggy loops of
``torch_impl.harness.bugs_windows`` are built from these pieces and each deviates from that
loop in one place.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.functional import cross_entropy

from torch_impl.batch import IGNORE_INDEX, TokenBatch


@dataclass(kw_only=True, slots=True)
class Window:
    """Where a window runs, and what its loop keeps from one window to the next."""

    #: This process and the number of processes DDP averages over: R, or R C under context
    #: parallel (process r C + c is data rank r's context rank c).
    rank: int
    world_size: int
    accum_steps: int
    #: Context-parallel ranks per data rank (1: none), and this data rank's microbatches
    #: before the context split (the labels every context rank of a row holds).
    context_size: int = 1
    unsplit: Sequence[TokenBatch] = ()
    #: rank-skew only: rank 0's loss is multiplied by this.
    skew: float = 1.0
    #: clip-per-microbatch only: each microbatch gradient's max global norm.
    clip_norm: float = 0.15
    #: State living outside the window loop (a trainer attribute); only stale-count uses it.
    carry: dict[str, torch.Tensor] = field(default_factory=dict)


#: One window of a buggy loop: (model, this rank's M microbatches, window) -> logged denominator.
WindowStep = Callable[[nn.Module, Sequence[TokenBatch], Window], float]


# --- the pieces every loop is made of --------------------------------------------------------


def accumulating(
    model: nn.Module, step: int, accum_steps: int
) -> contextlib.AbstractContextManager:
    """``model.no_sync()`` for all but the window's last microbatch: DDP then reduces once."""
    return model.no_sync() if step < accum_steps - 1 else contextlib.nullcontext()


def cross_entropy_of(model: nn.Module, batch: TokenBatch, reduction: str) -> torch.Tensor:
    """``F.cross_entropy`` of the model's logits; ignored targets (-100) carry no loss.

    bf16 logits are upcast to float32 first, as Hugging Face's ``logits.float()`` does, so the
    loss, and any count it is divided by, is never rounded to 8 bits (float64 and float32
    logits are left as they are)."""
    logits = model(batch.inputs)
    if logits.dtype == torch.bfloat16:
        logits = logits.float()
    losses = cross_entropy(
        logits.flatten(0, 1),
        batch.targets.flatten(),
        ignore_index=IGNORE_INDEX,
        reduction=reduction,
    )
    return losses.view(batch.targets.shape) if reduction == "none" else losses


def global_sum(local: torch.Tensor) -> torch.Tensor:
    """Sum a per-rank count over ranks (in place, as loops do, and returned)."""
    dist.all_reduce(local, op=dist.ReduceOp.SUM)
    return local


def local_valid(microbatches: Sequence[TokenBatch]) -> torch.Tensor:
    """n_r: this rank's valid targets over its M microbatches, an int64 tensor."""
    return sum((batch.valid.sum() for batch in microbatches), torch.zeros((), dtype=torch.int64))


def scaled_sum_window(
    model: nn.Module,
    microbatches: Sequence[TokenBatch],
    window: Window,
    denominator: torch.Tensor | float,
    scale: float,
) -> None:
    """Backpropagate ``sum_t l_t * scale / denominator`` on every microbatch; sync the last."""
    for step, batch in enumerate(microbatches):
        with accumulating(model, step, window.accum_steps):
            (cross_entropy_of(model, batch, "sum") * scale / denominator).backward()


def token_mean_with_count(
    model: nn.Module,
    microbatches: Sequence[TokenBatch],
    window: Window,
    count: Callable[[TokenBatch], torch.Tensor],
) -> float:
    r"""A token-mean loop whose global denominator C sums `count` over every microbatch.

    Backpropagates :math:`R \sum_t v_t l_t / C`: the loss sums are right, so the gradient is
    :math:`\frac{D}{C}\, g`. Returns C.
    """
    local = sum((count(b) for b in microbatches), torch.zeros((), dtype=torch.int64))
    denominator = global_sum(local)
    scaled_sum_window(model, microbatches, window, denominator, window.world_size)
    return float(denominator)
