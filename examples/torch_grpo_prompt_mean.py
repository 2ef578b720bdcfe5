r"""A GRPO-style prompt-group mean under DDP, counted over the whole update or per microbatch.

RL trainers for LLMs average over prompt groups: each prompt's n completions form a group,
each group's loss is the mean over its tokens, and the update is the mean over groups
(SkyRL's ``prompt_mean``; the DAPO group token mean asked for in verl#2776). The completions
of one prompt are rows of the batch, and a group's rows can land on several ranks and in
several accumulation microbatches, so its token count is a count over the whole update:

.. math::

    L = \frac{1}{G} \sum_g \frac{1}{n_g} \sum_{t \in g} l_t,
    \qquad n_g = \text{valid tokens of group } g \text{ over all ranks and microbatches}.

``step`` counts first: every rank adds up its rows' valid tokens per group id, one
``all_reduce`` of that vector gives every rank the global n_g and the number of non-empty
groups G, before any backward. Then each microbatch backpropagates
:math:`R \sum_t v_t l_t / n_{g(t)} / G` (R for DDP's average), under ``no_sync`` but the last.
``crosscheck verify examples.torch_grpo_prompt_mean:step --framework torch --scheme
group_token_mean`` passes it.

``step_microbatch_count`` counts each group inside the microbatch only, as a per-batch
implementation of the group mean does when the batch is split for accumulation: a group whose
rows are split gets two smaller counts, and its tokens weigh more. verify names it
``local-group-count``.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.functional import cross_entropy

Microbatches = list[dict[str, torch.Tensor]]


def _group_counts(microbatches: Microbatches, *, reduce: bool) -> torch.Tensor:
    """Valid tokens per group id over this rank's microbatches, summed over ranks if `reduce`."""
    size = torch.tensor([max(int(mb["group_ids"].max()) for mb in microbatches) + 1])
    dist.all_reduce(size, op=dist.ReduceOp.MAX)  # every rank needs the same vector length
    counts = torch.zeros(int(size), dtype=torch.int64)
    for mb in microbatches:
        counts.index_add_(0, mb["group_ids"], (mb["targets"] != -100).sum(dim=1))
    if reduce:
        dist.all_reduce(counts)
    return counts


def _backward(model: nn.Module, microbatches: Microbatches, counts_of) -> None:
    global_counts = _group_counts(microbatches, reduce=True)
    groups = int((global_counts > 0).sum())
    R = dist.get_world_size()
    for index, mb in enumerate(microbatches):
        last = index == len(microbatches) - 1
        with contextlib.nullcontext() if last else model.no_sync():
            logits = model(mb["inputs"])
            per_token = cross_entropy(
                logits.flatten(0, 1), mb["targets"].flatten(), reduction="none"
            ).view_as(mb["targets"])
            valid = mb["targets"] != -100
            n = counts_of(mb, global_counts).clamp(min=1)[mb["group_ids"]][:, None]
            loss = (per_token * valid / n).sum() / groups
            (loss * R).backward()


def step(model: nn.Module, microbatches: Microbatches) -> None:
    """The group mean with every group's count over the whole update (correct)."""
    _backward(model, microbatches, lambda mb, global_counts: global_counts)


def step_microbatch_count(model: nn.Module, microbatches: Microbatches) -> None:
    """Each group counted inside its microbatch (the local-group-count bug)."""

    def local(mb: dict[str, torch.Tensor], global_counts: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros_like(global_counts)
        return counts.index_add_(0, mb["group_ids"], (mb["targets"] != -100).sum(dim=1))

    _backward(model, microbatches, local)
