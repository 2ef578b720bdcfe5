"""torch.optim SGD and AdamW built from explicit hyperparameters.

Every hyperparameter is passed explicitly, never left to a library default, so the torch
update and the oracle's (``crosscheck.contract.optimizers``) use the same numbers by construction.
torch's AdamW applies decoupled weight decay as theta * (1 - lr * wd) before the Adam step,
which is the same number as the oracle's theta - lr * (direction + wd * theta).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerSpec:
    """Which optimizer and all of its hyperparameters (b1, b2, eps, weight_decay: AdamW only)."""

    name: Literal["sgd", "adamw"]
    learning_rate: float
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-6
    weight_decay: float = 0.0


def make_optimizer(params: Iterable[torch.Tensor], spec: OptimizerSpec) -> torch.optim.Optimizer:
    """A fresh optimizer (step 0, no moments) for `params`."""
    params = list(params)
    if spec.name == "sgd":
        return torch.optim.SGD(params, lr=spec.learning_rate, momentum=0.0, weight_decay=0.0)
    if spec.name == "adamw":
        return torch.optim.AdamW(
            params,
            lr=spec.learning_rate,
            betas=(spec.b1, spec.b2),
            eps=spec.eps,
            weight_decay=spec.weight_decay,
        )
    raise ValueError(f"optimizer must be 'sgd' or 'adamw', got {spec.name!r}")
