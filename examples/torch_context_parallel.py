r"""A context-parallel loop in torch: every row's positions split over C context ranks.

Mirrors torchtitan's and Megatron-LM's context parallel: the R x C processes form a 2-D
("dp", "cp") mesh, each process holds one context rank's shard of its data rank's rows (a
contiguous slice of every row, or two chunks of it in the load-balanced zigzag order), and the
gradient is reduced over all R C processes (DDP over the world, as torchtitan's FSDP over its
flattened ``dp_shard_cp`` mesh). The step gets ``context`` (its ``ContextGroup``: size, rank,
order, positions, mesh, and the ``group`` / ``data_group`` process groups) beside the model
and its microbatches, and the count it divides by must cover every data *and* context rank:

.. math::  \frac{1}{D} \sum_{r,c,m} \sum_{t \in \text{shard}} v_t \nabla l_t,
    \qquad D = \sum_{r,c,m} n_{rcm},

which is the global token mean of the rows without the split. ``step`` counts the window's
valid targets over the whole world before the first backward and multiplies by R C for DDP's
averaging: ``crosscheck verify`` PASSES it against token_mean.

The variants are the bugs the context split brings, each named by the diagnosis:

* ``step_local_count`` divides by the shard's own count and lets DDP average (Megatron-LM#7513:
  with one valid token per shard CP=2 halves the gradient): ``cp-local-count``;
* ``step_count_over_dp_only`` reduces the count over ``context.data_group`` only, the data
  ranks at its context rank (verl#5993, prime-rl#2359): ``cp-count-over-dp-only``;
* ``step_missing_cp_compensation`` counts over the world but multiplies by R alone, as a
  data-parallel loop does, so that DDP's division by R C leaves 1/C (slime#990):
  ``missing-cp-compensation``.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.functional import cross_entropy

from crosscheck import log_denominator

IGNORE_INDEX = -100


def valid_tokens(
    microbatches: list[dict[str, torch.Tensor]], group: dist.ProcessGroup | None = None
) -> int:
    """Valid targets of this process's shards in the window, summed over `group` (None: every
    process, data and context ranks alike)."""
    count = sum((batch["targets"] != IGNORE_INDEX).sum() for batch in microbatches)
    count = torch.as_tensor(count, dtype=torch.int64)
    if group is not None or dist.get_world_size() > 1:
        dist.all_reduce(count, op=dist.ReduceOp.SUM, group=group)
    return max(int(count), 1)  # a window without a valid target adds nothing


def accumulate(
    model: nn.Module, microbatches: list[dict[str, torch.Tensor]], denominator: int, factor: int
) -> None:
    """Every microbatch's backward: the shard's summed token losses / `denominator` times
    `factor` (what cancels DDP's averaging over the world). The bilinear model's tokens do
    not interact, so a shard's logits are its positions' logits; a transformer would gather
    keys and values over ``context.group`` here (torchtitan's ring attention)."""
    log_denominator(denominator)  # the D the loop divides by, where a loop would log it
    for index, batch in enumerate(microbatches):
        last = index == len(microbatches) - 1
        with contextlib.nullcontext() if last else model.no_sync():
            logits = model(batch["inputs"])
            loss_sum = cross_entropy(
                logits.reshape(-1, logits.size(-1)),
                batch["targets"].reshape(-1),
                ignore_index=IGNORE_INDEX,
                reduction="sum",
            )
            (loss_sum / denominator * factor).backward()


def step(model: nn.Module, microbatches: list[dict[str, torch.Tensor]], context) -> None:
    """The global token count over data x context ranks; loss x R C for DDP's averaging."""
    accumulate(model, microbatches, valid_tokens(microbatches), dist.get_world_size())


def step_local_count(model: nn.Module, microbatches: list[dict[str, torch.Tensor]], context):
    """Bug: each process divides by its own shard's count, and DDP averages the R C
    processes' per-shard means (cp-local-count)."""
    count = max(int(sum((b["targets"] != IGNORE_INDEX).sum() for b in microbatches)), 1)
    accumulate(model, microbatches, count, 1)


def step_count_over_dp_only(
    model: nn.Module, microbatches: list[dict[str, torch.Tensor]], context
) -> None:
    """Bug: the count is reduced over the data ranks at this context rank only
    (cp-count-over-dp-only)."""
    count = valid_tokens(microbatches, context.data_group)
    accumulate(model, microbatches, count, dist.get_world_size())


def step_missing_cp_compensation(
    model: nn.Module, microbatches: list[dict[str, torch.Tensor]], context
) -> None:
    """Bug: the loss is scaled by the data-parallel size R only, as without context parallel,
    while DDP averages over R C (missing-cp-compensation)."""
    data_parallel = dist.get_world_size() // context.size
    accumulate(model, microbatches, valid_tokens(microbatches), data_parallel)
