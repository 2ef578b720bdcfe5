r"""TRL's ``SFTTrainer`` for one optimizer update, as verify steps.

The same set-up as the Trainer's (`crosscheck.conformance.adapters.hf_trainer`: the global
batch sharded by accelerate, ``trainer.train()`` for one update, the harness's ``SGD(lr=1)``,
clipping off), with TRL's own ``SFTConfig``, collator (``DataCollatorForLanguageModeling``) and
``compute_loss``. At trl 1.16.0 (``trl/trainer/sft_trainer.py``):

* L1610-1618: the per-token loss is ``-outputs.log_probs`` (``dft`` multiplies it by the
  detached probability), summed and divided by ``num_items_in_batch`` (the Trainer's window
  count over every rank, ``transformers/trainer.py`` L2306-2360), or by the microbatch's own
  ``label_mask.sum()`` without it;
* L1623-1624: times ``num_processes`` when tokens are averaged across devices (DDP averages);
* L1625-1629: a MoE model's router aux loss is added divided by the accumulation steps, after
  the x ``num_processes``: the mean over the update's forwards (a second term, judged against
  a multi-term objective: setting ``sft-moe-aux``).

What the docs promise (``trl/trainer/sft_config.py`` L107-113): ``"nll"``: "standard negative
log-likelihood"; ``"dft"``: "Dynamic Fine-Tuning" (arXiv 2508.05629), each token's loss
weighted by its probability. With the Trainer's ``average_tokens_across_devices`` (on by
default, "for precise loss calculation") the intended objective of ``nll`` is the global token
mean (``token_mean``). ``dft``'s per-token loss is not the cross-entropy, so the verify
reference (the cross-entropy) cannot judge it: it is listed, not run.

The data: the fixtures' aligned targets become Hugging Face's shifted labels (``labels[t + 1] =
targets[t]``, ``labels[0] = -100``) with ``dataset_kwargs={"skip_prepare_dataset": True}``, as
TRL's docs show for prebuilt labels; the model's loss shifts them back onto the targets. That
needs every row's last target to be ignored (true of every built-in fixture: a document's last
target is), which the step checks.
"""

from __future__ import annotations

from collections.abc import Callable

import datasets
import torch
from torch import nn
from transformers import PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

from crosscheck.conformance.adapters.hf_trainer import Microbatch, train_one_update
from crosscheck.conformance.adapters.tiny_models import tokenizer

IGNORE_INDEX = -100


def shifted_row(batch: Microbatch, i: int) -> dict[str, list[int]]:
    """Row i with Hugging Face's labels: the loss predicts ``labels[t + 1]`` at position t."""
    targets = batch["targets"][i]
    if int(targets[-1]) != IGNORE_INDEX:
        raise ValueError(
            "a row whose last target is valid has no Hugging Face label position for it: "
            "run the SFTTrainer on fixtures whose rows end in an ignored target"
        )
    labels = torch.cat([torch.tensor([IGNORE_INDEX]), targets[:-1]])
    return {"input_ids": batch["inputs"][i].tolist(), "labels": labels.tolist()}


def sft_update(
    model_factory: Callable[[], nn.Module],
    microbatches: list[Microbatch],
    optimizer: torch.optim.Optimizer,
    **settings: object,
) -> nn.Module:
    """One ``SFTTrainer.train()`` update with the given ``SFTConfig`` settings."""
    processing: PreTrainedTokenizerFast = tokenizer()
    return train_one_update(
        model_factory(),
        microbatches,
        optimizer,
        trainer_class=SFTTrainer,
        make_args=SFTConfig,
        extra_args={"dataset_kwargs": {"skip_prepare_dataset": True}, **settings},
        trainer_kwargs={"processing_class": processing},
        make_dataset=datasets.Dataset.from_list,
        row_of=shifted_row,
    )


def step_nll(
    model_factory: Callable[[], nn.Module],
    microbatches: list[Microbatch],
    optimizer: torch.optim.Optimizer,
) -> nn.Module:
    """``loss_type="nll"`` (the default), every other setting at its default."""
    return sft_update(model_factory, microbatches, optimizer, loss_type="nll")


def step_nll_float32(
    model_factory: Callable[[], nn.Module],
    microbatches: list[Microbatch],
    optimizer: torch.optim.Optimizer,
) -> nn.Module:
    """``loss_type="nll"`` with ``bf16=False``: no autocast, so the arithmetic is the model's."""
    return sft_update(model_factory, microbatches, optimizer, loss_type="nll", bf16=False)


def step_nll_local_tokens(
    model_factory: Callable[[], nn.Module],
    microbatches: list[Microbatch],
    optimizer: torch.optim.Optimizer,
) -> nn.Module:
    """``loss_type="nll"`` with ``average_tokens_across_devices=False``."""
    return sft_update(
        model_factory,
        microbatches,
        optimizer,
        loss_type="nll",
        average_tokens_across_devices=False,
    )
