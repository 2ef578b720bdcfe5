r"""transformers' ``Trainer`` (with accelerate) for one optimizer update, as verify steps.

Each step builds a real ``transformers.Trainer`` around the model the harness hands it and
calls ``trainer.train()`` for one update (``max_steps=1``): the Trainer's own data loader
(accelerate's per-rank sharding), ``get_batch_samples`` / ``_get_num_items_in_batch`` (the
window's count), ``compute_loss`` (the model's own ``ForCausalLMLoss``), ``training_step`` and
the optimizer step run as they do in a user's job. The rank's gloo group is the one accelerate
uses (``use_cpu=True``, ``ddp_backend="gloo"``, with RANK / WORLD_SIZE / LOCAL_RANK set from
it, accelerate adopts an initialized process group).

Where the count and the scale come from, at transformers 5.24.0 (``transformers/trainer.py``):

* L2306-2360 ``_get_num_items_in_batch``: the window's valid labels (``shift_labels`` as the
  collator gives them, else ``labels[..., 1:]``), ``accelerator.gather(...).sum()`` over the
  ranks when ``average_tokens_across_devices``;
* L2167-2216 ``compute_loss``: ``num_items_in_batch`` goes into the model's forward when it
  ``accepts_loss_kwargs``, and the loss is multiplied by ``num_processes`` when tokens are
  averaged across devices (DDP then averages the ranks' gradients);
* L2110-2119 ``training_step``: the loss is divided by ``current_gradient_accumulation_steps``
  unless it was already normalized by ``num_items_in_batch``.

What the docs promise (``transformers/training_args.py``, ``average_tokens_across_devices``):
"Whether or not to average tokens across devices. If enabled, will use all_reduce to
synchronize num_tokens_in_batch for precise loss calculation." The intended objective of
every setting is therefore the global token mean of the update (``token_mean``).

Set-up choices, none of which touches the normalization:

* the data: every rank all-gathers the ranks' microbatches and hands the Trainer the global
  batch, ordered so that accelerate's ``BatchSamplerShard`` (batch i to rank i mod R, with the
  ``sequential`` sampling strategy) feeds rank r its microbatch m at accumulation step m; a
  forward pre-hook records what the model was fed, and the step raises unless it was exactly
  this rank's microbatches, in order;
* the fixtures' targets are already aligned with the inputs: they go in as ``labels`` and as
  ``shift_labels`` (as a padding-free collator gives them), so the loss shifts nothing and the
  count is of the same labels (``remove_unused_columns=False`` keeps ``shift_labels``, which
  the model takes through ``**kwargs``);
* the optimizer is the harness's ``SGD(lr=1)`` with a constant schedule, so the update read
  back is the gradient the optimizer took; ``max_grad_norm=0``: clipping off (it rescales the
  whole gradient and would hide the weighting).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import PrinterCallback, ProgressCallback, Trainer, TrainingArguments

from crosscheck.conformance.adapters.process_group import adopt_process_group
from crosscheck.conformance.adapters.tiny_models import quiet_transformers

quiet_transformers()


Microbatch = dict[str, torch.Tensor]

#: The keys a row carries into the Trainer: the model's input, the labels the Trainer counts,
#: and the labels the loss uses unshifted (the fixtures' targets are already aligned).
ROW_KEYS = ("input_ids", "labels", "shift_labels")


class RowDataset(torch.utils.data.Dataset):
    """The global batch as a map-style dataset of rows, in the order the sharding wants."""

    def __init__(self, rows: list[dict[str, torch.Tensor]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.rows[index]


#: One row of a microbatch as a dataset item: ``row_of(batch, i)``.
RowOf = Callable[[Microbatch, int], dict[str, Any]]


def aligned_row(batch: Microbatch, i: int) -> dict[str, torch.Tensor]:
    """Row i as the Trainer's item: the aligned targets as ``labels`` and ``shift_labels``."""
    return {
        "input_ids": batch["inputs"][i],
        "labels": batch["targets"][i],
        "shift_labels": batch["targets"][i],
    }


def global_rows(microbatches: list[Microbatch], row_of: RowOf = aligned_row) -> list[dict]:
    """Every rank's rows, ordered microbatch-major then rank: batch m R + r is rank r's m-th,
    which is what accelerate's ``BatchSamplerShard`` hands rank r at step m."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [{k: v.clone() for k, v in b.items()} for b in microbatches])
    return [
        row_of(rank_batches[m], i)
        for m in range(len(microbatches))
        for rank_batches in gathered
        for i in range(rank_batches[m]["inputs"].shape[0])
    ]


def record_inputs(model: nn.Module) -> list[torch.Tensor]:
    """A list that every forward of `model` appends its ``input_ids`` to."""
    seen: list[torch.Tensor] = []

    def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        seen.append((kwargs.get("input_ids", args[0] if args else None)).detach().clone())

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def check_fed(seen: list[torch.Tensor], microbatches: list[Microbatch]) -> None:
    """Raise unless the model was fed exactly this rank's microbatches, in order."""
    expected = [batch["inputs"] for batch in microbatches]
    same = len(seen) == len(expected) and all(
        a.shape == b.shape and torch.equal(a.cpu(), b) for a, b in zip(seen, expected, strict=True)
    )
    if not same:
        raise RuntimeError(
            f"rank {dist.get_rank()}: the Trainer fed {len(seen)} batches that are not this "
            f"rank's {len(expected)} microbatches in order: the adapter's data layout is wrong"
        )


def train_one_update(
    model: nn.Module,
    microbatches: list[Microbatch],
    optimizer: torch.optim.Optimizer,
    *,
    trainer_class: type[Trainer] = Trainer,
    extra_args: dict[str, Any] | None = None,
    trainer_kwargs: dict[str, Any] | None = None,
    make_args: Callable[..., TrainingArguments] = TrainingArguments,
    make_dataset: Callable[[list[dict]], Any] = RowDataset,
    row_of: RowOf = aligned_row,
) -> nn.Module:
    """One ``trainer.train()`` update of `model` on this rank's microbatches; returns `model`.

    `trainer_class`, `make_args`, `make_dataset` and `row_of` let a subclass of the Trainer
    (TRL's SFTTrainer) run through the same set-up with its own config and dataset;
    `extra_args` are the settings under test.
    """
    adopt_process_group()
    seen = record_inputs(model)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    with tempfile.TemporaryDirectory() as output_dir:
        args = make_args(
            output_dir=output_dir,
            per_device_train_batch_size=microbatches[0]["inputs"].shape[0],
            gradient_accumulation_steps=len(microbatches),
            max_steps=1,
            max_grad_norm=0.0,  # clipping off: it rescales the gradient and hides the weighting
            use_cpu=True,
            ddp_backend="gloo",
            train_sampling_strategy="sequential",
            dataloader_drop_last=False,
            report_to="none",
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            # The Trainer sets transformers' log level on every rank: errors only.
            log_level="error",
            log_level_replica="error",
            # ``shift_labels`` is no named parameter of the model's forward (it rides in
            # ``**kwargs``): the default column filter would drop it and the loss would shift
            # the aligned targets once more.
            remove_unused_columns=False,
            ddp_find_unused_parameters=False,  # every parameter gets a gradient
            **(extra_args or {}),
        )
        trainer = trainer_class(
            model=model,
            args=args,
            train_dataset=make_dataset(global_rows(microbatches, row_of)),
            optimizers=(optimizer, schedule),
            **(trainer_kwargs or {}),
        )
        # The ranks' stdout is the verify run's: no per-log prints or progress bars.
        for callback in (PrinterCallback, ProgressCallback):
            trainer.remove_callback(callback)
        trainer.train()
    check_fed(seen, microbatches)
    return model


def step_default(
    model_factory: Callable[[], nn.Module],
    microbatches: list[Microbatch],
    optimizer: torch.optim.Optimizer,
) -> nn.Module:
    """The defaults: ``average_tokens_across_devices=True``, a model accepting loss kwargs."""
    return train_one_update(model_factory(), microbatches, optimizer)


def step_local_tokens(
    model_factory: Callable[[], nn.Module],
    microbatches: list[Microbatch],
    optimizer: torch.optim.Optimizer,
) -> nn.Module:
    """``average_tokens_across_devices=False``: each rank counts its own window's tokens."""
    return train_one_update(
        model_factory(),
        microbatches,
        optimizer,
        extra_args={"average_tokens_across_devices": False},
    )


def step_no_loss_kwargs(
    model_factory: Callable[[], nn.Module],
    microbatches: list[Microbatch],
    optimizer: torch.optim.Optimizer,
) -> nn.Module:
    """A model whose ``accepts_loss_kwargs`` is False (as a custom model's forward without
    ``**kwargs`` is): no ``num_items_in_batch``, the model's own per-microbatch mean, divided by
    the accumulation steps."""
    model = model_factory()
    model.accepts_loss_kwargs = False
    return train_one_update(model, microbatches, optimizer)
