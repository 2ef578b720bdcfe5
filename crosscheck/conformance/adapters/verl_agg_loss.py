"""verl 0.9.1: ``agg_loss`` with the FSDP engine's counts, one verify step per ``loss_agg_mode``.

verl normalizes every actor loss term in ``agg_loss`` (verl/trainer/ppo/core_algos.py:1140-1206),
whose docstring promises "Aggregate the loss across global batch to ensure the loss is
invariant to fsdp/megatron parallelism" (core_algos.py:1149) and, for FSDP, "the loss is
directly used for backward" (core_algos.py:1152-1153). It takes the counts of the whole
mini-batch from the engine: ``FSDPEngine.forward_backward_batch``
(verl/workers/engine/fsdp/transformer_impl.py:724-777) sums ``data["loss_mask"]`` over the
rank's mini-batch and all-reduces it over the data-parallel group as ``batch_num_tokens``,
with ``dp_size`` the data-parallel size (transformer_impl.py:729-735); ``global_batch_size`` is
set by the trainer to ``ppo_mini_batch_size * rollout.n``, the rows of the mini-batch
(verl/trainer/ppo/ray_trainer.py:1352-1363); ``ppo_loss`` hands all three to ``agg_loss``
through ``config.global_batch_info`` (verl/workers/utils/losses.py:65-67, 124-126, 136-138).
The engine then splits the rank's mini-batch with ``prepare_micro_batches``
(verl/workers/engine/utils.py:92-130; ``use_dynamic_bsz=False``: ``micro_batch_size_per_gpu``
rows each) and runs forward and ``loss.backward()`` per micro-batch, deferring gradient
sync to the last one (``_gradient_sync_context``, transformer_impl.py:692-722); FSDP's
reduce-scatter averages the gradients over the ranks, which the ``* dp_size`` in
``agg_loss`` cancels.

The modes 0.9.1 ships (actor.yaml:85: "Loss aggregation mode: "token-mean", "token-sum",
"seq-mean-token-sum", "seq-mean-token-mean", or "seq-mean-token-sum-norm""), and the scheme
each promises over the global mini-batch:

* ``token-mean`` (core_algos.py:1170-1175): ``masked_sum / batch_num_tokens * dp_size``: the
  token mean of the mini-batch (``token_mean``).
* ``token-sum`` (core_algos.py:1176-1180): "Scaling each rank's local token sum by dp_size
  makes the reduced gradient equal to the sum over all valid tokens in the global batch"
  (``sum``).
* ``seq-mean-token-sum`` (core_algos.py:1181-1188): each row's token sum, summed and divided
  by ``global_batch_size``: ``configured_rows_sum:G``, G the rows of the mini-batch.
* ``seq-mean-token-mean`` (core_algos.py:1194-1202): each row's token mean over
  ``global_batch_size``: ``configured_rows_mean:G``.
* ``seq-mean-token-sum-norm`` (core_algos.py:1189-1193): ``seq-mean-token-sum`` divided by
  ``loss_scale_factor``, which defaults to ``loss_mask.shape[-1]`` (actor.yaml:88-90: "If
  null, uses response_length"): ``configured_rows_sum:G*T``.

What runs: verl's own ``agg_loss`` on each micro-batch's per-token ``-log p`` from verl's own
``logprobs_from_logits`` (verl/utils/torch_functional.py:73-108; its log-softmax-and-gather
path on CPU), with the engine's counts, split by verl's own ``prepare_micro_batches``. The
per-token loss is ``-log p``: the gradient of the vanilla PPO token loss ``-A * ratio`` at ratio
1 with unit advantages (``old_log_prob`` = the detached ``log_prob``), so the weighting under
test is unchanged.

Deviations (not run: the engine itself needs Ray workers and, at transformer_impl.py:730,
``get_device_id()``, which on this CPU-only torch calls ``torch.cuda`` and raises):

* the count glue of ``forward_backward_batch`` (transformer_impl.py:729-735) and its
  micro-batch loop (transformer_impl.py:749-767) are reproduced from the cited lines, the count
  all-reduced over verify's gloo group instead of the device's; ``global_batch_size`` is the
  rows of the update (summed over the ranks), what ``ppo_mini_batch_size * rollout.n`` names;
* ``DistributedDataParallel`` (gradient average over the ranks, ``no_sync`` but on the last
  micro-batch) stands for FSDP's reduce-scatter average (the same mean over ranks) on gloo;
* no gradient clipping (``optimizer_step`` clips with ``clip_grad``; off here), ``SGD(lr=1)``
  from verify instead of the configured AdamW, no loss scaler (float64 model, no AMP).

What ``crosscheck verify`` says (tiny Llama; packed, ragged; R in 1, 2; M in 1, 2): every mode
matches its scheme at float32-level (the Llama keeps its rotary cos / sin in float32; worst
relative error 6e-12). The row modes divide by every row of the mini-batch, the empty ones
included: against ``row_mean`` (the non-empty rows) ``seq-mean-token-mean`` on ragged is a
scale of 121 / 144 = 0.8403.

The step checks that verl's ``prepare_micro_batches`` split the rank's mini-batch into exactly
the harness's microbatches, in order (raises otherwise).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch.nn.parallel import DistributedDataParallel
from verl.trainer.ppo.core_algos import agg_loss
from verl.utils import tensordict_utils as tu
from verl.utils.torch_functional import logprobs_from_logits
from verl.workers.engine.utils import prepare_micro_batches

IGNORE_INDEX = -100

Microbatch = dict[str, torch.Tensor]


def rank_mini_batch(microbatches: list[Microbatch]) -> TensorDict:
    """This rank's share of the mini-batch, as the engine receives it: one TensorDict of rows."""
    inputs = torch.cat([batch["inputs"] for batch in microbatches])
    targets = torch.cat([batch["targets"] for batch in microbatches])
    data = TensorDict(
        {"input_ids": inputs, "targets": targets, "loss_mask": targets != IGNORE_INDEX},
        batch_size=[inputs.shape[0]],
    )
    # Fixed-size micro-batches (use_dynamic_bsz=False), one per harness microbatch.
    tu.assign_non_tensor(
        data, use_dynamic_bsz=False, micro_batch_size_per_gpu=microbatches[0]["inputs"].shape[0]
    )
    return data


def assign_global_counts(data: TensorDict) -> None:
    """The engine's counts (transformer_impl.py:729-735) and the trainer's global_batch_size
    (ray_trainer.py:1352-1363: the rows of the mini-batch on all ranks)."""
    batch_num_tokens = data["loss_mask"].sum()
    dist.all_reduce(batch_num_tokens, op=dist.ReduceOp.SUM)
    rows = torch.tensor(len(data), dtype=torch.int64)
    dist.all_reduce(rows, op=dist.ReduceOp.SUM)
    tu.assign_non_tensor(
        data,
        batch_num_tokens=batch_num_tokens.item(),
        dp_size=dist.get_world_size(),
        global_batch_size=int(rows.item()),
    )


def check_micro_batches(micro_batches: list[TensorDict], microbatches: list[Microbatch]) -> None:
    """Raise unless verl's split is the harness's microbatches, in order."""
    if len(micro_batches) != len(microbatches):
        raise AssertionError(
            f"verl made {len(micro_batches)} micro-batches, not {len(microbatches)}"
        )
    for m, (ours, theirs) in enumerate(zip(micro_batches, microbatches, strict=True)):
        same = torch.equal(ours["input_ids"], theirs["inputs"]) and torch.equal(
            ours["targets"], theirs["targets"]
        )
        if not same:
            raise AssertionError(f"verl's micro-batch {m} holds other rows than the harness's")


def micro_batch_loss(model: torch.nn.Module, micro_batch: TensorDict, mode: str) -> torch.Tensor:
    """verl's ``agg_loss`` of the micro-batch's ``-log p``, with the mini-batch's counts."""
    logits = model(input_ids=micro_batch["input_ids"]).logits
    loss_mask = micro_batch["loss_mask"]
    labels = torch.where(loss_mask, micro_batch["targets"], 0)
    log_probs = logprobs_from_logits(logits, labels)
    return agg_loss(
        loss_mat=-log_probs,
        loss_mask=loss_mask,
        loss_agg_mode=mode,
        dp_size=tu.get_non_tensor_data(micro_batch, "dp_size", None),
        batch_num_tokens=tu.get_non_tensor_data(micro_batch, "batch_num_tokens", None),
        global_batch_size=tu.get_non_tensor_data(micro_batch, "global_batch_size", None),
        loss_scale_factor=None,  # actor.yaml's default (null): loss_mask.shape[-1]
    )


def train_one_update(
    model_factory: Callable[[], torch.nn.Module],
    microbatches: list[Microbatch],
    optimizer: torch.optim.Optimizer,
    mode: str,
) -> torch.nn.Module:
    """One mini-batch update as ``forward_backward_batch`` runs it, then the optimizer."""
    model = DistributedDataParallel(model_factory())
    data = rank_mini_batch(microbatches)
    assign_global_counts(data)
    micro_batches, _ = prepare_micro_batches(
        data=data, dp_group=dist.group.WORLD, same_micro_num_in_dp=True
    )
    check_micro_batches(micro_batches, microbatches)
    optimizer.zero_grad()
    for index, micro_batch in enumerate(micro_batches):
        last = index == len(micro_batches) - 1
        # _gradient_sync_context: gradient sync only on the last micro-batch.
        with contextlib.nullcontext() if last else model.no_sync():
            micro_batch_loss(model, micro_batch, mode).backward()
    optimizer.step()
    return model.module


def step_token_mean(
    model_factory: Callable[[], torch.nn.Module],
    microbatches: list[Microbatch],
    optimizer: torch.optim.Optimizer,
) -> torch.nn.Module:
    """``loss_agg_mode=token-mean`` (actor.yaml's default)."""
    return train_one_update(model_factory, microbatches, optimizer, "token-mean")


def step_token_sum(
    model_factory: Callable[[], torch.nn.Module],
    microbatches: list[Microbatch],
    optimizer: torch.optim.Optimizer,
) -> torch.nn.Module:
    """``loss_agg_mode=token-sum``."""
    return train_one_update(model_factory, microbatches, optimizer, "token-sum")


def step_seq_mean_token_sum(
    model_factory: Callable[[], torch.nn.Module],
    microbatches: list[Microbatch],
    optimizer: torch.optim.Optimizer,
) -> torch.nn.Module:
    """``loss_agg_mode=seq-mean-token-sum``."""
    return train_one_update(model_factory, microbatches, optimizer, "seq-mean-token-sum")


def step_seq_mean_token_mean(
    model_factory: Callable[[], torch.nn.Module],
    microbatches: list[Microbatch],
    optimizer: torch.optim.Optimizer,
) -> torch.nn.Module:
    """``loss_agg_mode=seq-mean-token-mean``."""
    return train_one_update(model_factory, microbatches, optimizer, "seq-mean-token-mean")


def step_seq_mean_token_sum_norm(
    model_factory: Callable[[], torch.nn.Module],
    microbatches: list[Microbatch],
    optimizer: torch.optim.Optimizer,
) -> torch.nn.Module:
    """``loss_agg_mode=seq-mean-token-sum-norm``, ``loss_scale_factor`` null (T)."""
    return train_one_update(model_factory, microbatches, optimizer, "seq-mean-token-sum-norm")
