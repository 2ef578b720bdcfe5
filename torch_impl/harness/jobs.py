"""What every rank of a launch is handed for one job: a global batch and the params.

A job names itself in every message (`label`), holds the global [N, T] batch that each rank
lays out for itself (``torch_impl.batch.rank_microbatches``: its M microbatches of the
global batch) and the float64 params every rank starts from. The per-rank case loop
(``torch_impl.harness.cases.UpdateCase``) and a user's step (``torch_impl.harness.user_step.
UserStepJob``) add what they run on top.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchJob:
    """A global batch and the params to start from, named."""

    label: str
    #: Global [N, T] arrays: inputs, targets, segment_ids, weights.
    batch: Mapping[str, np.ndarray]
    #: float64 ``embed`` [V, H] and ``unembed`` [H, V].
    params: Mapping[str, np.ndarray]
