r"""The contract-v2 loops of the bug catalogue in torch: a local group count, and a local 0/0.

Same conventions as ``torch_impl.harness.bugs_windows`` (one window on one DDP rank, returns
the logged denominator, each loop wrong in exactly one place marked ``BUG``); the patterns'
wording is ``crosscheck.diagnosis.patterns``'s.

Notation: R ranks, M microbatches, :math:`v_t` valid target, :math:`g(t)` the prompt group of
t's row (``group_ids``; without them every row is its own group), :math:`n_g` the valid targets
of group g over the whole update, and :math:`D_G` the number of groups with a valid target.
The intended ``group_token_mean`` is the mean over groups of each group's token mean,

.. math:: L = \frac{1}{D_G} \sum_t \frac{v_t}{n_{g(t)}} l_t,

so a correct DDP loop needs :math:`n_g` and :math:`D_G` of the whole update before the first
backward (one all-reduce of a per-group count vector), and backpropagates R times its part
(DDP averages the R ranks).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.functional import cross_entropy

from torch_impl.batch import TokenBatch
from torch_impl.harness.windows import Window, accumulating, cross_entropy_of, global_sum


def row_groups(batch: TokenBatch) -> torch.Tensor:
    """[B] prompt group of each row: ``group_ids``, or the global row index without them."""
    if batch.group_ids is not None:
        return batch.group_ids
    return batch.first_row + torch.arange(batch.targets.shape[0])


def group_bound(microbatches: Sequence[TokenBatch]) -> int:
    """Largest group id of the update + 1, the same on every rank (an all-reduce MAX): the
    length of a per-group count vector every rank indexes alike."""
    local = max(int(row_groups(batch).max()) + 1 for batch in microbatches)
    bound = torch.tensor(local, dtype=torch.int64)
    dist.all_reduce(bound, op=dist.ReduceOp.MAX)
    return int(bound)


def group_counts(batch: TokenBatch, bound: int) -> torch.Tensor:
    """[bound] valid targets of each group among this microbatch's rows (int64)."""
    per_row = batch.valid.sum(dim=1)
    return torch.zeros(bound, dtype=torch.int64).index_add_(0, row_groups(batch), per_row)


def local_group_count(
    model: nn.Module, microbatches: Sequence[TokenBatch], window: Window
) -> float:
    r"""local-group-count: each microbatch counts a group's tokens on its own rows only.

    Token t of microbatch (r, m) weighs :math:`v_t / (n_{g(t)}^{rm} D_G)`, with
    :math:`n_g^{rm}` the group's valid targets inside (r, m): a group split over microbatches or
    ranks has each part averaged on its own, so its parts weigh alike whatever their sizes.
    :math:`D_G` (non-empty groups of the update) is right. Upstream: slime per-rollout means;
    verl#2776; SkyRL prompt_mean computed per microbatch. Logs :math:`D_G`.
    """
    bound = group_bound(microbatches)
    totals = sum(
        (group_counts(b, bound) for b in microbatches), torch.zeros(bound, dtype=torch.int64)
    )
    num_groups = global_sum(totals).gt(0).sum()  # D_G from the global counts: right
    for step, batch in enumerate(microbatches):
        with accumulating(model, step, window.accum_steps):
            losses = cross_entropy_of(model, batch, "none")
            # BUG: the group count of this microbatch's rows, not the update's (the vector
            # was never summed over microbatches and all-reduced before it was used).
            n_local = group_counts(batch, bound)[row_groups(batch)]
            # A row of a group with no valid target has a zero loss sum: clamp keeps it 0
            # (0/0 is zero-count-nan, not this bug).
            a = batch.valid / n_local.clamp(min=1)[:, None].to(losses.dtype)
            ((losses * a).sum() * window.world_size / num_groups).backward()
    return float(num_groups)


def unmasked_token_losses(model: nn.Module, batch: TokenBatch) -> torch.Tensor:
    """[B, T] cross-entropy of every position, Megatron's way: the labels carry no -100 (an
    ignored target is read as token 0) and a separate loss mask zeroes what does not count.

    Unlike ``ignore_index``, whose backward writes 0 at ignored positions whatever flows in,
    the mask multiplies the incoming gradient: 0 x inf is NaN, which is how a 0/0 upstream
    reaches the parameters in real loops. bf16 logits are upcast as in ``cross_entropy_of``.
    """
    logits = model(batch.inputs)
    if logits.dtype == torch.bfloat16:
        logits = logits.float()
    labels = torch.where(batch.valid, batch.targets, 0)
    losses = cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    return losses.view(batch.targets.shape)


def zero_count_nan(model: nn.Module, microbatches: Sequence[TokenBatch], window: Window) -> float:
    r"""zero-count-nan: a per-microbatch token mean, Megatron-style, with no guard for 0 tokens.

    Each microbatch backpropagates :math:`\sum_t m_t l_t / (M \sum_t m_t)` with the loss mask
    :math:`m_t = v_t`; DDP averages the ranks. On a microbatch without a valid target the
    forward is 0/0 = NaN and the backward :math:`m_t / 0 = 0 \cdot \infty` = NaN for every
    token, which the all-reduce spreads to every entry of every rank. (With no empty
    microbatch it is microbatch-mean.) Upstream: mcore-bridge#104; Megatron-LM#3396;
    verl#6464; prime-rl#808; NeMo-RL#212. Logs :math:`n_{rm}` of this rank's last microbatch.
    """
    for step, batch in enumerate(microbatches):
        with accumulating(model, step, window.accum_steps):
            losses = unmasked_token_losses(model, batch)
            loss_mask = batch.valid.to(losses.dtype)
            # BUG: loss_mask.sum() is 0 on an empty microbatch: no clamp, no skip.
            loss = (losses * loss_mask).sum() / loss_mask.sum()
            (loss / window.accum_steps).backward()
    return float(microbatches[-1].valid.sum())
