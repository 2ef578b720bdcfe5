r"""A trainer that wraps its own model and steps its optimizer: verify's two torch variants.

Mirrors the common hand-written trainer that owns its setup: it builds the model, wraps it in
``DistributedDataParallel`` and ends the update with ``optimizer.step()``. The protocol serves
it through the signature: a first parameter named ``model_factory`` gets a factory of fresh
unwrapped models (the step returns the wrapped one), and an ``optimizer`` parameter gets
``torch.optim.SGD(params, lr=1.0)`` over the first model's parameters, so the harness reads
the update SGD applied (the ``.grad`` it stepped with, checked against params before minus
params after): the gradient itself. (A wrapper that replaces
the parameters, as FSDP2's ``fully_shard`` does, needs an optimizer built after wrapping: such
a step builds its own and takes no ``optimizer``; the harness then reads ``.grad``.)

The loss is torchtitan's (``examples.torch_torchtitan``): per-microbatch summed cross-entropy
over the valid-token count of the whole window on every rank, times R for DDP's average. So
``crosscheck verify`` with the token_mean scheme PASSES it, exactly as the plain step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from examples.torch_torchtitan import accumulate


def step(
    model_factory: Callable[[], nn.Module],
    microbatches: list[dict[str, torch.Tensor]],
    optimizer: torch.optim.Optimizer,
) -> nn.Module:
    """Wrap a fresh model in DDP, accumulate the update's gradient, apply it; return the model."""
    model = DistributedDataParallel(model_factory())
    optimizer.zero_grad(set_to_none=True)
    accumulate(model, microbatches)
    optimizer.step()
    return model
