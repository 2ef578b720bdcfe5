r"""Hugging Face's causal-LM loss in a DDP accumulation loop: one correct step and four bugs.

Every step here computes its loss with the real ``transformers.loss.loss_utils.ForCausalLMLoss``
(the function a ``*ForCausalLM`` model's ``loss_function`` is), inside the loop the HF
``Trainer`` runs for one optimizer update (``Trainer._inner_training_loop`` and
``training_step`` in transformers 5.x):

* ``get_batch_samples`` fetches the M microbatches of the accumulation window and counts
  ``num_items_in_batch``, the valid labels of all of them; with
  ``average_tokens_across_devices`` (the default) it gathers that count from every rank and
  sums it, once, before the first backward;
* every microbatch but the last runs under ``accelerator.no_sync(model)``, so DDP
  all-reduces only on the last backward, and DDP *averages* the gradient over the R ranks;
* the model's loss divides the microbatch's summed cross-entropy by ``num_items_in_batch``,
  and the Trainer multiplies it by ``accelerator.num_processes`` (R) to cancel DDP's average.
  Without ``num_items_in_batch`` the loss is the microbatch's own token mean, and the Trainer
  divides it by the accumulation steps instead.

So token t weighs :math:`1 / D` with :math:`D = \sum_{r,m} n_{rm}`, the global token mean,
whatever the layout (R, M). ``ForCausalLMLoss`` upcasts the logits with ``logits.float()``:
the loss and the gradient flowing back into the logits are float32 even on the float64
analytic model, so ``crosscheck verify`` judges the steps at float32-level.

The steps (``crosscheck verify --framework torch --scheme token_mean``):

* ``step``: the Trainer's loop as above: PASSES at float32-level.
* ``step_microbatch_mean``: no ``num_items_in_batch`` (HF's mean per microbatch), divided by
  M, DDP averaging: microbatch-mean (transformers#34191).
* ``step_rank_count``: ``num_items_in_batch`` counted on this rank only
  (``average_tokens_across_devices=False``) and no factor R: rank-mean.
* ``step_extra_accum_divide``: the correct global count, but the loss divided by the
  accumulation steps once more, as a trainer that divides by ``gradient_accumulation_steps``
  on top of a ``num_items_in_batch`` normalization does: double-accum-divide (ms-swift#10117).
* ``step_averaged_grads``: the correct global count, but no factor R under DDP's averaging:
  missing-world-size (transformers#37474). It logs the global count as its denominator, which
  tells it apart from double-reduce-count (the same gradient, logging R D).

Each step logs the denominator it divides by with ``crosscheck.log_denominator``, where a
training loop would log it.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers.loss.loss_utils import ForCausalLMLoss

from crosscheck import log_denominator

IGNORE_INDEX = -100

Microbatch = dict[str, torch.Tensor]


def window_num_items(microbatches: list[Microbatch]) -> torch.Tensor:
    """This rank's valid labels over the whole accumulation window (``get_batch_samples``).

    The fixtures' ``targets`` are already the labels each position predicts (no shift), so
    every one of them counts; the Trainer counts ``shift_labels`` as they are too (and
    ``labels[..., 1:]`` when the loss shifts): the targets that get a loss.
    """
    return sum((batch["targets"] != IGNORE_INDEX).sum() for batch in microbatches)


def global_num_items(microbatches: list[Microbatch]) -> torch.Tensor:
    """The window's valid labels summed over every rank: one all-reduce, before any backward
    (the Trainer's ``accelerator.gather(num_items_in_batch).sum()``)."""
    count = torch.as_tensor(window_num_items(microbatches), dtype=torch.int64)
    dist.all_reduce(count, op=dist.ReduceOp.SUM)
    return count


def hf_loss(
    model: DistributedDataParallel,
    batch: Microbatch,
    num_items_in_batch: torch.Tensor | None,
) -> torch.Tensor:
    """One microbatch's loss, computed by Hugging Face's ``ForCausalLMLoss``.

    With ``num_items_in_batch`` it is the summed cross-entropy divided by it; without, the
    token mean of this microbatch. Either way in float32 (``logits.float()`` inside).
    """
    logits = model(batch["inputs"])
    return ForCausalLMLoss(
        logits,
        labels=batch["targets"],
        vocab_size=logits.size(-1),
        num_items_in_batch=num_items_in_batch,
        ignore_index=IGNORE_INDEX,
        # The fixtures' targets are already aligned with the inputs (position t's target is
        # the token position t predicts). Without shift_labels ForCausalLMLoss would shift
        # them by one again, as it does for HF `labels` equal to the inputs; passing them as
        # shift_labels (what padding-free collators do) uses them as they are.
        shift_labels=batch["targets"],
    )


def sync_context(
    model: DistributedDataParallel, index: int, accum_steps: int
) -> contextlib.AbstractContextManager:
    """``no_sync`` on every microbatch but the last: DDP all-reduces once per update."""
    return contextlib.nullcontext() if index == accum_steps - 1 else model.no_sync()


def step(model: DistributedDataParallel, microbatches: list[Microbatch]) -> None:
    """The Trainer's update: global ``num_items_in_batch``, loss times R, ``no_sync``."""
    num_items_in_batch = global_num_items(microbatches)
    log_denominator(num_items_in_batch)
    world_size = dist.get_world_size()
    for index, batch in enumerate(microbatches):
        with sync_context(model, index, len(microbatches)):
            loss = hf_loss(model, batch, num_items_in_batch)
            (loss * world_size).backward()  # cancels DDP's average over the R ranks


def step_microbatch_mean(model: DistributedDataParallel, microbatches: list[Microbatch]) -> None:
    """No ``num_items_in_batch``: each microbatch's token mean, divided by M (microbatch-mean)."""
    accum_steps = len(microbatches)
    for index, batch in enumerate(microbatches):
        # The denominator HF's mean divides this microbatch by.
        log_denominator((batch["targets"] != IGNORE_INDEX).sum())
        with sync_context(model, index, accum_steps):
            loss = hf_loss(model, batch, None)
            (loss / accum_steps).backward()  # the Trainer's loss / gradient_accumulation_steps


def step_rank_count(model: DistributedDataParallel, microbatches: list[Microbatch]) -> None:
    """``num_items_in_batch`` of this rank only, no factor R: DDP averages (rank-mean)."""
    num_items_in_batch = window_num_items(microbatches)  # not all-reduced
    log_denominator(num_items_in_batch)
    for index, batch in enumerate(microbatches):
        with sync_context(model, index, len(microbatches)):
            hf_loss(model, batch, num_items_in_batch).backward()


def step_extra_accum_divide(model: DistributedDataParallel, microbatches: list[Microbatch]) -> None:
    """The correct global count and factor R, then divided by M once more (double divide)."""
    num_items_in_batch = global_num_items(microbatches)
    log_denominator(num_items_in_batch)
    world_size = dist.get_world_size()
    accum_steps = len(microbatches)
    for index, batch in enumerate(microbatches):
        with sync_context(model, index, accum_steps):
            loss = hf_loss(model, batch, num_items_in_batch) * world_size
            # The bug: num_items_in_batch already covers the whole window.
            (loss / accum_steps).backward()


def step_averaged_grads(model: DistributedDataParallel, microbatches: list[Microbatch]) -> None:
    """The correct global count, but DDP's average over R is never cancelled."""
    num_items_in_batch = global_num_items(microbatches)
    log_denominator(num_items_in_batch)  # D, not R D: not double-reduce-count
    for index, batch in enumerate(microbatches):
        with sync_context(model, index, len(microbatches)):
            hf_loss(model, batch, num_items_in_batch).backward()  # the bug: no * world_size
