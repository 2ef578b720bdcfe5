"""Spec cases (contract v2) on one process group, beside v1's update cases.

A `SpecCase` names a global batch (with contract v2's optional fields ``group_ids``,
``document_ids``, ``row_weights``, ``sample_mask`` when it has them), params, a scheme spec
(its dict or name), a strategy, M, a dtype and a front-end; every rank runs one update of it
(``torch_impl.spec_update``) and returns the reduced gradient before any clipping or step.
`run_mixed_cases` runs spec cases and ``UpdateCase``s in one launch on one set of wrapped
models (``cases._WrapperCache``: built and probed once per shape, dtype, front-end and
reduction), so a test compares the spec path with the v1 path without a second launch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist

from torch_impl.batch import rank_microbatches
from torch_impl.harness.cases import (
    FrontEnd,
    RankOutput,
    UpdateCase,
    _Wrapped,
    _WrapperCache,
    check_case_choices,
    run_case,
)
from torch_impl.harness.jobs import BatchJob
from torch_impl.model import load_numpy_params, numpy_grads
from torch_impl.spec import get_spec
from torch_impl.spec_counts import IdBounds
from torch_impl.spec_update import (
    SpecAccumulated,
    accumulate_spec_postnorm,
    accumulate_spec_precount,
)


@dataclass(frozen=True, kw_only=True, slots=True)
class SpecCase(BatchJob):
    """One update of a spec on the global batch; the attributes `_WrapperCache` reads are
    named as on ``UpdateCase`` (strategy, dtype, front_end, fsdp_divide_factor, params)."""

    spec: str | Mapping[str, Any]
    strategy: Literal["precount", "postnorm"]
    accum_steps: int
    dtype: Literal["float64", "float32", "bfloat16"] = "float64"
    front_end: FrontEnd = "ddp"
    #: FSDP2 only: None keeps its default (divide by R), 1.0 sums.
    fsdp_divide_factor: float | None = None
    #: Hand the ranks the id bounds of the global batch; False: they agree on them in a
    #: collective of their own, as a loop that only holds its own rows must.
    pass_id_bounds: bool = True

    def __post_init__(self) -> None:
        get_spec(self.spec)  # a bad spec fails here, in the caller, with its key named
        check_case_choices(self, ("precount", "postnorm"))


@dataclass(frozen=True, slots=True)
class SpecOutput:
    """One rank's result: the reduced float64 gradient and what the update computed."""

    label: str
    rank: int
    reduce_factor: float
    grads: dict[str, np.ndarray]
    accumulated: SpecAccumulated


def id_bounds(batch: Mapping[str, np.ndarray]) -> IdBounds:
    """The pre-pass vector lengths from the global batch, which every rank holds whole."""

    def bound(key: str) -> int:
        array = batch.get(key)
        return 0 if array is None or not np.size(array) else int(np.max(array)) + 1

    return IdBounds(bound("group_ids"), bound("document_ids"))


def run_spec_case(case: SpecCase, wrapped: _Wrapped, rank: int, world_size: int) -> SpecOutput:
    """One update of `case` on this rank; the wrapper is left without gradients."""
    model = wrapped.model
    model.zero_grad(set_to_none=True)
    load_numpy_params(model, case.params)
    microbatches = rank_microbatches(case.batch, rank, world_size, case.accum_steps)
    vocab_size = int(np.asarray(case.params["embed"]).shape[0])
    s = wrapped.reduction.reduce_factor
    bounds = id_bounds(case.batch) if case.pass_id_bounds else None
    common = dict(vocab_size=vocab_size, id_bounds=bounds)
    if case.strategy == "precount":
        accumulated = accumulate_spec_precount(
            model, microbatches, case.spec, reduce_factor=s, **common
        )
    else:
        accumulated = accumulate_spec_postnorm(
            model, microbatches, case.spec, hook_state=wrapped.hook_state, **common
        )
    grads = numpy_grads(model)
    model.zero_grad(set_to_none=True)
    return SpecOutput(case.label, rank, s, grads, accumulated)


def run_mixed_cases(
    rank: int, world_size: int, cases: Sequence[SpecCase | UpdateCase]
) -> list[SpecOutput | RankOutput]:
    """Run spec and update cases in order on this rank (a launcher target; same cases on
    every rank: each one runs collectives)."""
    if not dist.is_initialized():
        raise RuntimeError(f"rank {rank}: run_mixed_cases needs an initialized process group")
    torch.manual_seed(0)
    wrappers = _WrapperCache(rank, world_size)
    out: list[SpecOutput | RankOutput] = []
    for case in cases:
        # _WrapperCache reads only the attributes both case types share (see SpecCase).
        wrapped = wrappers.get(case)  # type: ignore[arg-type]
        if isinstance(case, SpecCase):
            out.append(run_spec_case(case, wrapped, rank, world_size))
        else:
            out.append(run_case(case, wrapped, rank, world_size))
    return out
