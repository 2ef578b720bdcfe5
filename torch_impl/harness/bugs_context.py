r"""The context-parallel loops of the bug catalogue in torch: counts taken in the wrong place.

Same conventions as ``torch_impl.harness.bugs_windows`` (one window on one DDP process, returns
the logged denominator, each loop wrong in exactly one place marked ``BUG``); the patterns'
wording is ``crosscheck.diagnosis.patterns``'s.

Under context parallel R data-parallel ranks each have C context ranks: process p = r C + c
holds context rank c's positions of data rank r's rows (``torch_impl.batch.
context_microbatches``, contiguous or zigzag), and DDP runs over all P = R C processes. On
the bilinear model a token's loss reads only its own position, so a shard's loss is the sum of
its own tokens' losses and the gradients of the C shards of a row add up to the row's. DDP
*averages* the P processes, so a correct loop backpropagates
:math:`P \sum_{t \in p} v_t l_t / D` with D the valid targets of the whole update, each
counted once: a sum of the shards' counts over all P processes (`window.world_size` is P
here). Each loop below deviates from that in one place.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from torch_impl.batch import TokenBatch
from torch_impl.harness.windows import (
    Window,
    accumulating,
    cross_entropy_of,
    global_sum,
    local_valid,
    scaled_sum_window,
)


def cp_local_count(model: nn.Module, microbatches: Sequence[TokenBatch], window: Window) -> float:
    r"""cp-local-count: each process divides by its own shard's count (Megatron-LM#7513).

    Backpropagates :math:`\sum_{t \in p} v_t l_t / \max(n_p, 1)` (Megatron clamps an empty
    shard's count to 1) and DDP averages the P processes: token t of process p weighs
    :math:`v_t / (R C\, n_p)`. Logs :math:`n_p`.
    """
    n_shard = local_valid(microbatches)  # BUG: the shard's own count, never all-reduced
    scaled_sum_window(model, microbatches, window, n_shard.clamp(min=1), 1.0)
    return float(n_shard)


def cp_count_over_replicas(
    model: nn.Module, microbatches: Sequence[TokenBatch], window: Window
) -> float:
    r"""cp-count-over-replicas: whole rows counted on every context rank, summed over all.

    Every context rank of a row holds the row's labels before the split
    (`window.unsplit`); the loop counts them and all-reduces over all P processes, so each
    row is counted C times: :math:`D' = C D`, and the gradient is :math:`g / C`.
    Upstream: verl#3691; prime-rl#2359 (review). Logs C D.
    """
    num_tokens = local_valid(window.unsplit)  # the labels before the context split
    num_tokens = global_sum(num_tokens)  # BUG: over data and context ranks: C copies of a row
    scaled_sum_window(model, microbatches, window, num_tokens, window.world_size)
    return float(num_tokens)


@functools.cache
def _data_groups(num_processes: int, context_size: int) -> tuple[dist.ProcessGroup, ...]:
    """One process group per context rank c: the R processes r C + c (every process creates
    every group, in the same order, as ``dist.new_group`` requires); cached for the process's
    life (a launch starts fresh processes: one default process group each)."""
    R = num_processes // context_size
    return tuple(
        dist.new_group([r * context_size + c for r in range(R)]) for c in range(context_size)
    )


def cp_count_over_dp_only(
    model: nn.Module, microbatches: Sequence[TokenBatch], window: Window
) -> float:
    r"""cp-count-over-dp-only: the shard counts are reduced over the data-parallel group only.

    Process r C + c all-reduces its shard's count over the processes of its own context rank,
    :math:`D_c = \sum_r n_{rc}`, and backpropagates :math:`P \sum_{t \in p} v_t l_t / D_c`:
    token t on context rank c weighs :math:`v_t / D_c`, about C times the intended weight.
    Upstream: verl#5993, verl#5983; prime-rl#2359. Logs :math:`D_c`.
    """
    groups = _data_groups(window.world_size, window.context_size)
    num_tokens = local_valid(microbatches)
    # BUG: the data-parallel group alone, while the data is also split over context ranks.
    dist.all_reduce(num_tokens, group=groups[window.rank % window.context_size])
    scaled_sum_window(model, microbatches, window, num_tokens, window.world_size)
    return float(num_tokens)


def missing_cp_compensation(
    model: nn.Module, microbatches: Sequence[TokenBatch], window: Window
) -> float:
    r"""missing-cp-compensation: the loss is scaled by R against an average over R C.

    The right global D, but the loop multiplies by the data-parallel size R only while DDP
    averages all P = R C processes: the gradient is :math:`g / C`.
    Upstream: slime#990; Megatron-LM#673. Logs D.
    """
    denominator = global_sum(local_valid(microbatches))
    data_parallel_size = window.world_size // window.context_size
    scaled_sum_window(model, microbatches, window, denominator, data_parallel_size)  # BUG: not P
    return float(denominator)


def _document_keys(batch: TokenBatch, width: int) -> torch.Tensor:
    """[B, T/C] a global id per (row, segment): row index x width + segment id."""
    rows = batch.first_row + torch.arange(batch.targets.shape[0])
    return rows[:, None] * width + batch.segment_ids


def cp_local_sequence_count(
    model: nn.Module, microbatches: Sequence[TokenBatch], window: Window
) -> float:
    r"""cp-local-sequence-count: a document's count is taken on this shard of its row only.

    Intended: sequence_mean, :math:`L = \frac{1}{D_S} \sum_t v_t l_t / n_{s(t)}` with
    :math:`n_s` the valid targets of document (row, segment) s and :math:`D_S` the documents
    with a valid target. The loop gets :math:`D_S` right (a presence vector of global
    document ids, all-reduced over all processes) but divides each token by
    :math:`n_{s(t)}^{p,m}`, its document's valid targets inside this process's shard of the
    microbatch. Upstream: verl (seq-mean-token-mean rejected under context parallel);
    verl#6836. Logs :math:`D_S`.
    """
    # Document ids every process indexes alike: the largest row and segment id over all.
    bounds = torch.tensor(
        [
            max(b.first_row + b.targets.shape[0] for b in microbatches),
            max(int(b.segment_ids.max()) for b in microbatches) + 1,
        ],
        dtype=torch.int64,
    )
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX)
    num_rows, width = (int(x) for x in bounds)
    present = torch.zeros(num_rows * width, dtype=torch.int64)
    for batch in microbatches:
        present[_document_keys(batch, width)[batch.valid]] = 1
    num_documents = (global_sum(present) > 0).sum()
    for step, batch in enumerate(microbatches):
        with accumulating(model, step, window.accum_steps):
            losses = cross_entropy_of(model, batch, "none")
            keys = _document_keys(batch, width)
            same = (keys[:, :, None] == keys[:, None, :]) & batch.valid[:, None, :]
            n_shard = same.sum(dim=2)  # BUG: the document's targets on this shard only
            per_token = torch.where(batch.valid, losses / n_shard.clamp(min=1), 0.0)
            (per_token.sum() * window.world_size / num_documents).backward()
    return float(num_documents)
