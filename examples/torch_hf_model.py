r"""A tiny Hugging Face Llama, trained through its own loss path: one correct step and two bugs.

``crosscheck verify --framework torch --model examples.torch_hf_model:model --step
examples.torch_hf_model:step --scheme token_mean``: the step is handed this model (wrapped in
DDP) instead of the analytic one, and is judged against the intended gradient that the same
model gives, in float64 (docs/verify.md, "Bring your own model").

The model is built from a config, no download: ``LlamaForCausalLM`` with vocab 40 (the
fixtures' vocabulary), hidden size 32, two layers, grouped-query attention; ``model()`` seeds
torch first, so every call returns the same initial weights, as ``--model`` requires.

The loss is the model's own: ``model(input_ids=..., labels=..., num_items_in_batch=...)``
runs ``ForCausalLMLoss`` (``logits.float()``, the summed cross-entropy divided by
``num_items_in_batch``, or the token mean without it), inside the loop the HF ``Trainer``
runs for one update: the window's ``num_items_in_batch`` gathered from every rank before the
first backward, ``no_sync`` on every microbatch but the last, the loss times R to cancel DDP's
average. The fixtures' targets are already aligned with the inputs, so they go in as
``shift_labels`` too (transformers 5 passes it through the model's ``**kwargs`` to the loss,
which then does not shift the labels again).

* ``step``: the Trainer's loop, stepping the optimizer it is given: PASSES at float32-level
  (the loss is float32).
* ``step_microbatch_mean``: no ``num_items_in_batch``, each microbatch's mean divided by M:
  microbatch-mean (transformers#34191).
* ``step_rank_count``: a ``model_factory`` step that wraps DDP itself, with
  ``num_items_in_batch`` of this rank only and no factor R: rank-mean.

``logits`` is what the reference computes its float64 token losses from, written out as a
``--forward``: the model's logits of ``input_ids``, as the default forward takes them (a model
trained with packed position ids would pass them here too).

``moe_model`` is a tiny Mixtral whose experts run through ``grouped_mm`` (transformers'
default), a kernel that refuses float64: ``--model examples.torch_hf_model:moe_model`` runs
its reference, and the step, in float32, and the report says so.

``model_unseeded`` is the factory without its ``torch.manual_seed``: every call draws other
weights, so the step and the reference would start from different models; ``--model`` refuses
it as a set-up error (exit 2), before any step runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

IGNORE_INDEX = -100

Microbatch = dict[str, torch.Tensor]


def model() -> LlamaForCausalLM:
    """A fresh two-layer Llama over the fixtures' 40-token vocabulary, the same every call."""
    torch.manual_seed(0)
    return model_unseeded()


#: The tiny decoder's sizes (the fixtures' 40-token vocabulary), with the plain attention: the
#: same arithmetic in float64 as in float32.
TINY = {
    "vocab_size": 40,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "attn_implementation": "eager",
}


def model_unseeded() -> LlamaForCausalLM:
    """The same Llama with whatever weights torch's generator gives: another model each call."""
    return LlamaForCausalLM(LlamaConfig(**TINY))


def moe_model() -> MixtralForCausalLM:
    """A tiny Mixtral (4 experts, top 2), as transformers builds it from a config: its experts
    run through ``grouped_mm``, which refuses float64, so ``--model`` runs its reference (and
    hands the step the model) in float32 and says so. The router's aux loss is off
    (``output_router_logits=False``): the objective is the cross-entropy alone."""
    torch.manual_seed(0)
    config = MixtralConfig(
        **TINY, num_local_experts=4, num_experts_per_tok=2, output_router_logits=False
    )
    return MixtralForCausalLM(config)


def logits(llama: LlamaForCausalLM, microbatch: Microbatch) -> torch.Tensor:
    """The logits [B, T, V] the reference's token losses come from (``--forward``)."""
    return llama(input_ids=microbatch["inputs"]).logits


def window_num_items(microbatches: list[Microbatch]) -> torch.Tensor:
    """This rank's valid labels over the accumulation window (``get_batch_samples``)."""
    return sum((batch["targets"] != IGNORE_INDEX).sum() for batch in microbatches)


def global_num_items(microbatches: list[Microbatch]) -> torch.Tensor:
    """The window's valid labels on every rank: one all-reduce before any backward."""
    count = torch.as_tensor(window_num_items(microbatches), dtype=torch.int64)
    dist.all_reduce(count, op=dist.ReduceOp.SUM)
    return count


def model_loss(
    ddp_model: DistributedDataParallel, batch: Microbatch, num_items: torch.Tensor | None
) -> torch.Tensor:
    """The model's own loss on one microbatch (``ForCausalLMLoss`` inside its forward)."""
    return ddp_model(
        input_ids=batch["inputs"],
        labels=batch["targets"],
        shift_labels=batch["targets"],  # already aligned: no second shift
        num_items_in_batch=num_items,
    ).loss


def sync_context(
    ddp_model: DistributedDataParallel, index: int, accum_steps: int
) -> contextlib.AbstractContextManager:
    """``no_sync`` on every microbatch but the last: DDP all-reduces once per update."""
    return contextlib.nullcontext() if index == accum_steps - 1 else ddp_model.no_sync()


def step(
    ddp_model: DistributedDataParallel,
    microbatches: list[Microbatch],
    optimizer: torch.optim.Optimizer,
) -> None:
    """The Trainer's update: global ``num_items_in_batch``, loss times R, ``no_sync``, then
    the optimizer's step (the harness reads the update it applied)."""
    num_items = global_num_items(microbatches)
    world_size = dist.get_world_size()
    for index, batch in enumerate(microbatches):
        with sync_context(ddp_model, index, len(microbatches)):
            (model_loss(ddp_model, batch, num_items) * world_size).backward()
    optimizer.step()


def step_microbatch_mean(
    ddp_model: DistributedDataParallel, microbatches: list[Microbatch]
) -> None:
    """No ``num_items_in_batch``: each microbatch's token mean, divided by M."""
    accum_steps = len(microbatches)
    for index, batch in enumerate(microbatches):
        with sync_context(ddp_model, index, accum_steps):
            (model_loss(ddp_model, batch, None) / accum_steps).backward()


def step_rank_count(
    model_factory: Callable[[], LlamaForCausalLM], microbatches: list[Microbatch]
) -> DistributedDataParallel:
    """Wraps the model itself (as the Trainer's ``accelerator.prepare`` does), then
    ``num_items_in_batch`` of this rank only and no factor R: DDP averages per-rank means."""
    ddp_model = DistributedDataParallel(model_factory())
    num_items = window_num_items(microbatches)  # the bug: not all-reduced
    for index, batch in enumerate(microbatches):
        with sync_context(ddp_model, index, len(microbatches)):
            model_loss(ddp_model, batch, num_items).backward()
    return ddp_model
