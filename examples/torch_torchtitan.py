r"""torchtitan's global token count: a step that ``crosscheck verify`` passes for token_mean.

Mirrors torchtitan's trainer (its train step hands ``forward_backward_step`` a
``global_valid_tokens``): before any backward it counts the valid targets of every microbatch
of the accumulation window, sums that count over the data-parallel ranks once, and divides
each microbatch's *summed* cross-entropy by it. The update's gradient is then

.. math::  \frac{1}{D} \sum_{r,m} \sum_t v_t \nabla l_t, \qquad D = \sum_{r,m} n_{rm},

the global token mean, whatever the layout (R, M) and however unevenly the valid targets fall
between ranks and microbatches. torchtitan runs under FSDP2 and switches FSDP's gradient
division off; under DDP, which averages gradients over the R ranks, the loss is multiplied by
R instead (below). ``crosscheck verify`` with the token_mean scheme PASSES it.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.functional import cross_entropy

IGNORE_INDEX = -100


def global_valid_tokens(microbatches: list[dict[str, torch.Tensor]]) -> int:
    """Valid targets in this accumulation window, summed over every rank (one all-reduce)."""
    count = sum((batch["targets"] != IGNORE_INDEX).sum() for batch in microbatches)
    count = torch.as_tensor(count, dtype=torch.int64)
    dist.all_reduce(count, op=dist.ReduceOp.SUM)
    # A window without a single valid target adds nothing (and must not divide by zero).
    return max(int(count), 1)


def accumulate(model: nn.Module, microbatches: list[dict[str, torch.Tensor]]) -> None:
    """Every microbatch's backward: sum of token losses / the global count, times R.

    `model` is DDP-wrapped: it all-reduces on the last microbatch only and divides the sum by
    R. Multiplying the loss by R cancels that division, so the gradient is the plain sum of
    every rank's (sum / global count): the global token mean. Exact in float64 for R a power
    of two, within one rounding otherwise.
    """
    denominator = global_valid_tokens(microbatches)  # before any backward: the whole window
    world_size = dist.get_world_size()
    for index, batch in enumerate(microbatches):
        last = index == len(microbatches) - 1
        with contextlib.nullcontext() if last else model.no_sync():
            logits = model(batch["inputs"])
            loss_sum = cross_entropy(
                logits.view(-1, logits.size(-1)),
                batch["targets"].view(-1),
                ignore_index=IGNORE_INDEX,
                reduction="sum",
            )
            (loss_sum / denominator * world_size).backward()


def step(model: nn.Module, microbatches: list[dict[str, torch.Tensor]]) -> None:
    """One update's backward passes with the global token count (a DDP-wrapped model)."""
    accumulate(model, microbatches)
