"""Context-parallel cases on one process group: a ``launch`` target.

The world is R x C processes; process r C + c holds data rank r's rows at context rank c's positions
(``torch_impl.batch.context_microbatches``). Every process runs each `ContextCase` as one precount
update of ``torch_impl.update`` on a `BilinearLM` holding the case's params (one wrapped model per
wrapper and layout, reused by its cases), wrapped in DDP over all the processes or sharded by FSDP2
over the flattened dimensions of a 2-D ("dp", "cp") DeviceMesh (both average: the reduction factor
is R C), and returns the reduced gradient (float64 numpy, gathered whole) and its own valid targets.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from torch_impl.batch import context_microbatches
from torch_impl.fsdp import context_parallel_mesh, shard_fsdp2
from torch_impl.model import BilinearLM, load_numpy_params, numpy_grads
from torch_impl.spec_counts import IdBounds
from torch_impl.update import accumulate_precount


@dataclass(frozen=True, kw_only=True, slots=True)
class ContextCase:
    """One scheme at one context-parallel layout: the global batch, the params and (R, M, C,
    order)."""

    label: str
    batch: Mapping[str, np.ndarray]
    params: Mapping[str, np.ndarray]
    scheme: str
    #: "ddp" over every process, or "fsdp2" over the flattened ("dp", "cp") dimensions of a
    #: 2-D DeviceMesh (`torch_impl.fsdp.context_parallel_mesh`), the counts over its group.
    wrapper: str
    world_size: int
    accum_steps: int
    context_size: int
    context_order: str
    vocab_size: int


@dataclass(frozen=True, slots=True)
class ContextCaseOutput:
    label: str
    grads: dict[str, np.ndarray]
    #: This process's valid targets (its shard of its rows, all its microbatches).
    valid_tokens: int


@functools.cache
def _flattened_mesh(data_parallel: int, context_parallel: int):
    """The flattened ("dp", "cp") mesh, built once per process and layout (every process
    builds it at the same case: the cases run in the same order everywhere)."""
    return context_parallel_mesh(data_parallel, context_parallel)[1]


def _wrapped(case: ContextCase, processes: int, cache: dict) -> tuple[nn.Module, object]:
    """The case's wrapped model and the group its counts are reduced over, built once per
    (wrapper, R, C, params' shapes) on every process and reused: building a DDP wrapper
    costs collectives of its own (the parameters' shapes checked across processes, rank 0's
    values broadcast), and loading a case's params copies into the same tensors, as
    `torch_impl.harness.cases` does."""
    R, C = case.world_size, case.context_size
    shapes = tuple(np.shape(case.params[name]) for name in sorted(case.params))
    key = (case.wrapper, R, C, shapes)
    if key not in cache:
        module = BilinearLM.from_numpy(dict(case.params))
        if case.wrapper == "fsdp2":
            dp_cp = _flattened_mesh(R, C)
            model = shard_fsdp2(module, world_size=processes, mesh=dp_cp)
            cache[key] = model, dp_cp.get_group()
        else:
            cache[key] = DistributedDataParallel(module), None
    model, group = cache[key]
    model.zero_grad(set_to_none=True)
    load_numpy_params(model, case.params)
    return model, group


def run_context_cases(
    process: int, processes: int, cases: Sequence[ContextCase]
) -> list[ContextCaseOutput]:
    """On each process: every case, in order (a ``torch_impl.harness.launcher.launch``
    target). A case whose R C is not the world's is a ValueError on every process alike."""
    out = []
    models: dict = {}
    for case in cases:
        R, C = case.world_size, case.context_size
        if processes != R * C:
            raise ValueError(f"{case.label}: R x C = {R * C} processes, the world has {processes}")
        microbatches = context_microbatches(
            dict(case.batch), process, R, C, case.accum_steps, case.context_order
        )
        model, group = _wrapped(case, processes, models)
        # Both average the summed gradients over the R C processes: s = R C. Every process
        # holds the global batch, so it reads the id bounds (rows and segments included:
        # they cross processes under context parallel) off the whole batch instead of
        # agreeing on them in a collective.
        whole = context_microbatches(dict(case.batch), 0, 1, 1, 1)
        result = accumulate_precount(
            model,
            microbatches,
            case.scheme,
            vocab_size=case.vocab_size,
            reduce_factor=float(processes),
            group=group,
            id_bounds=IdBounds.of(whole),
        )
        out.append(
            ContextCaseOutput(case.label, numpy_grads(model), result.rank_valid_tokens[process])
        )
    return out
