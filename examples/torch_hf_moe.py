r"""A tiny Hugging Face Mixtral with its router loss on, in two real loss arrangements.

``crosscheck verify --framework torch --model examples.torch_hf_moe:model --objective
examples.torch_hf_moe:OBJECTIVE --step examples.torch_hf_moe:step_trainer``: the step is handed
this model (wrapped in DDP) and judged, term by term, against the objective it means,

.. math::

    \text{total} = \frac{1}{n} \sum_t v_t\, \mathrm{ce}_t
      + \lambda \frac{1}{R M} \sum_{u} A(u), \qquad \lambda = 0.02,

n the update's valid labels and A(u) the model's own router load-balancing loss of the forward
over microbatch u (transformers' ``load_balancing_loss_func``: Switch's E sum_e f_e P_e over
the forward's tokens and layers): the per-forward mean, ``moe_lb`` at ``microbatch`` scope
(docs/verify.md, "Multi-term objectives"). The reference is the same model's own gradients,
in float32 (its experts run through ``grouped_mm``, which refuses float64).

* ``step_trainer``: transformers 5.24's ``Trainer`` for one update: the model's loss with
  ``labels`` and ``num_items_in_batch`` already holds ``router_aux_loss_coef * aux_loss``
  (modeling_mixtral.py:633), the whole loss is multiplied by R (trainer.py:2215), and with
  ``num_items_in_batch`` it is not divided by the accumulation steps (trainer.py:2116-2119):
  the router loss is summed over the update's R M forwards, R M times the objective's.
  FAILS: aux-summed-over-microbatches(moe_lb), scale R M.
* ``step_sft``: TRL 1.16.0's ``SFTTrainer`` (sft_trainer.py:1615-1629): the summed
  cross-entropy over ``num_items_in_batch`` times R, then ``router_aux_loss_coef *
  aux_loss`` divided by the accumulation steps and added after the x R: DDP's average over R
  leaves the mean over the R M forwards. PASSES at float32-level.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.functional import cross_entropy
from torch.nn.parallel import DistributedDataParallel
from transformers import MixtralConfig, MixtralForCausalLM

from examples.torch_hf_model import (
    IGNORE_INDEX,
    TINY,
    Microbatch,
    global_num_items,
    model_loss,
    sync_context,
)

ROUTER_AUX_LOSS_COEF = 0.02
#: What the steps mean: the token mean of the cross-entropy over the update, plus the router
#: loss at its coefficient as the mean over the update's forwards.
OBJECTIVE = [
    {"kind": "ce"},
    {"kind": "moe_lb", "coefficient": ROUTER_AUX_LOSS_COEF, "top_k": 2, "scope": "microbatch"},
]


def model() -> MixtralForCausalLM:
    """A tiny Mixtral (4 experts, top 2) with its router loss on, the same every call; its
    experts run through ``grouped_mm``, transformers' default."""
    torch.manual_seed(0)
    config = MixtralConfig(
        **TINY,
        num_local_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=ROUTER_AUX_LOSS_COEF,
    )
    return MixtralForCausalLM(config)


def step_trainer(ddp_model: DistributedDataParallel, microbatches: list[Microbatch]) -> None:
    """The Trainer's update: the model's own loss (cross-entropy over the window's
    ``num_items_in_batch`` plus the router loss), times R, ``no_sync`` but the last."""
    num_items = global_num_items(microbatches)
    world_size = dist.get_world_size()
    for index, batch in enumerate(microbatches):
        with sync_context(ddp_model, index, len(microbatches)):
            (model_loss(ddp_model, batch, num_items) * world_size).backward()


def step_sft(ddp_model: DistributedDataParallel, microbatches: list[Microbatch]) -> None:
    """SFTTrainer's update: the summed token losses over ``num_items_in_batch`` times R, and
    the router loss divided by the accumulation steps added after that factor."""
    num_items = global_num_items(microbatches)
    world_size = dist.get_world_size()
    steps = len(microbatches)
    for index, batch in enumerate(microbatches):
        with sync_context(ddp_model, index, steps):
            out = ddp_model(input_ids=batch["inputs"], output_router_logits=True)
            logits = out.logits.float()  # as the model's own loss upcasts
            summed = cross_entropy(
                logits.reshape(-1, logits.shape[-1]),
                batch["targets"].reshape(-1),
                ignore_index=IGNORE_INDEX,
                reduction="sum",
            )
            loss = summed / num_items * world_size
            loss = loss + ROUTER_AUX_LOSS_COEF * out.aux_loss / steps
            loss.backward()
