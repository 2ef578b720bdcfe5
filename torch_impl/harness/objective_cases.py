"""Multi-term objective cases on one process group: a ``launch`` target.

Every rank runs each `ObjectiveCase` as one update of ``torch_impl.objective`` on a fresh
DDP-wrapped `ObjectiveLM` holding the case's params, over its own rows of the global batch in
M microbatches, and returns the reduced gradient of every trained param (float64 numpy) and
the update log (every term's loss, count and denominators).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from torch_impl.batch import rank_microbatches
from torch_impl.objective import (
    ObjectiveLM,
    ObjectiveLog,
    objective_update,
    trained_grads,
    wrap_ddp,
)


@dataclass(frozen=True, kw_only=True, slots=True)
class ObjectiveCase:
    """One objective at one layout: the global batch, the params, the terms and M."""

    label: str
    batch: Mapping[str, np.ndarray]
    params: Mapping[str, np.ndarray]
    terms: Sequence[Mapping[str, Any]]
    accum_steps: int
    vocab_size: int


@dataclass(frozen=True, slots=True)
class ObjectiveCaseOutput:
    label: str
    grads: dict[str, np.ndarray]
    log: ObjectiveLog


def run_objective_cases(
    rank: int, world_size: int, cases: Sequence[ObjectiveCase]
) -> list[ObjectiveCaseOutput]:
    """On each rank: every case, in order (a ``torch_impl.harness.launcher.launch`` target)."""
    out = []
    for case in cases:
        module = ObjectiveLM(dict(case.params), dtype=torch.float64)
        ddp = wrap_ddp(module, case.terms)
        microbatches = rank_microbatches(dict(case.batch), rank, world_size, case.accum_steps)
        log = objective_update(ddp, microbatches, case.terms, vocab_size=case.vocab_size)
        out.append(ObjectiveCaseOutput(case.label, trained_grads(module), log))
    return out
