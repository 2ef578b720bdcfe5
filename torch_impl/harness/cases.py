"""Run many update cases on one process group: the per-rank side of a cross-check.

Starting a process group costs seconds, so one launch per world size runs every case of that
size: each case names a global batch, params, scheme, strategy, accumulation steps, dtype and
optimizer, and every rank returns plain numpy results (reduced gradients, updated params,
metrics) for the caller to compare with the oracle. Wrapped models are built once per
(shape, dtype, front-end, reduction) and reused: loading a case's params copies into the same
tensors, so DDP's buckets and comm hooks stay valid. Each wrapper's reduce factor is probed once.

A case can also stop partway and save a checkpoint (``save_to``: after some updates, or inside
an update's accumulation window), or start from one (``resume_from``) and continue: run the
stop in one launch and the resume in a fresh one, possibly of another world size, and the
resumed run's params can be compared with an uninterrupted run's (``torch_impl.checkpoint``,
``torch_impl.resume``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from torch_impl.batch import TokenBatch, rank_microbatches
from torch_impl.checkpoint import save_checkpoint
from torch_impl.comm_hooks import PostnormState, sum_and_carry_hook
from torch_impl.harness.jobs import BatchJob
from torch_impl.mean_loss import accumulate_mean_loss
from torch_impl.model import (
    BilinearLM,
    load_numpy_params,
    local_grads,
    local_params,
    numpy_full,
)
from torch_impl.optimizer_step import UpdateMetrics, clip_and_step, metrics
from torch_impl.optimizers import OptimizerSpec, make_optimizer
from torch_impl.partial import PartialAccumulation
from torch_impl.probe import ReductionPath, probe_ddp, probe_reduction
from torch_impl.resume import load_checkpoint, restore
from torch_impl.spec import get_spec
from torch_impl.spec_counts import IdBounds
from torch_impl.update import accumulate_partial, accumulate_postnorm, accumulate_precount

CaseStrategy = Literal["precount", "postnorm", "mean_loss"]
FrontEnd = Literal["ddp", "fsdp2"]
#: The params' dtype of a case. bfloat16 is the real thing: the model, its gradients, DDP's
#: buckets (all-reduced in bf16 on gloo) and the optimizer state are bf16; only the per-token
#: cross-entropy (float32, from upcast logits) and every count, weight sum and division by D
#: (float64) are wider (``torch_impl.losses.accumulation_dtype``).
DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
}
#: The dtype whose wrapper measures a bf16 wrapper's reduce factor (see ``_WrapperCache``).
PROBE_DTYPE = "float32"


def check_case_choices(case: Any, strategies: tuple[str, ...]) -> None:
    """Refuse a case whose strategy, front-end or dtype is not one it runs, naming the case;
    postnorm needs DDP's comm hook (FSDP2 runs precount)."""
    choices = {"strategy": strategies, "front_end": ("ddp", "fsdp2"), "dtype": tuple(DTYPES)}
    for name, allowed in choices.items():
        if getattr(case, name) not in allowed:
            raise ValueError(
                f"case {case.label!r}: {name} must be one of {allowed}, got {getattr(case, name)!r}"
            )
    if case.strategy == "postnorm" and case.front_end != "ddp":
        raise ValueError(
            f"case {case.label!r}: postnorm needs a DDP comm hook; FSDP2 runs precount"
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class UpdateCase(BatchJob):
    """One cross-check case: `num_updates` consecutive updates on the same global batch."""

    #: A scheme spec: its catalogue name (``token_mean``, ``group_token_mean``) or its dict;
    #: ignored by ``mean_loss``, which is its own (accidental) weighting.
    scheme: str | Mapping[str, Any]
    strategy: CaseStrategy
    accum_steps: int
    optimizer: OptimizerSpec
    dtype: Literal["float64", "float32", "bfloat16"] = "float64"
    front_end: FrontEnd = "ddp"
    #: FSDP2 only: None keeps its default (divide by R), 1.0 sums.
    fsdp_divide_factor: float | None = None
    num_updates: int = 1
    max_grad_norm: float | None = None
    #: precount's s; None takes the probed reduce factor. Set it to show a wrong s is caught.
    reduce_factor: float | None = None
    #: A checkpoint directory to start from instead of `params`; the run continues from the
    #: saved position (possibly inside an update) to `num_updates`.
    resume_from: str | None = None
    #: Stop after this many complete updates, plus `stop_after_microbatches` (< accum_steps) of
    #: the next one, and save a checkpoint to `save_to`. None: run to `num_updates`.
    stop_after_updates: int | None = None
    stop_after_microbatches: int = 0
    save_to: str | None = None
    #: Hand the ranks the id bounds of the global batch; False: they agree on them in a
    #: collective of their own, as a loop that only holds its own rows must.
    pass_id_bounds: bool = True

    def __post_init__(self) -> None:
        get_spec(self.scheme)  # a bad spec fails here, in the caller, with its key named
        check_case_choices(self, ("precount", "postnorm", "mean_loss"))
        self._check_stop()

    @property
    def scheme_key(self) -> str:
        """The spec's JSON form: a checkpoint records it, and refuses another on resume (two
        specs under one name, or two names for one spec, are different schemes there)."""
        return json.dumps(get_spec(self.scheme).to_dict(), sort_keys=True)

    def _check_stop(self) -> None:
        stops = self.stop_after_updates is not None
        if stops != (self.save_to is not None):
            raise ValueError(f"case {self.label!r}: stop_after_updates and save_to go together")
        if (stops or self.resume_from is not None) and (
            self.strategy == "mean_loss" or self.front_end != "ddp"
        ):
            raise ValueError(
                f"case {self.label!r}: checkpoint resume is implemented for precount and "
                "postnorm under DDP"
            )
        if not stops:
            if self.stop_after_microbatches:
                raise ValueError(f"case {self.label!r}: stop_after_microbatches needs a stop")
            return
        if not 0 <= self.stop_after_microbatches < self.accum_steps:
            raise ValueError(
                f"case {self.label!r}: stop_after_microbatches must be in [0, {self.accum_steps})"
            )
        # A stop inside an update needs that update to be part of the run.
        last = self.num_updates - (1 if self.stop_after_microbatches else 0)
        if not 0 <= self.stop_after_updates <= last:
            raise ValueError(f"case {self.label!r}: stop_after_updates must be in [0, {last}]")


@dataclass(frozen=True, slots=True)
class UpdateOutput:
    """One update on one rank: reduced gradient before clipping, params after the step."""

    grads: dict[str, np.ndarray]
    params: dict[str, np.ndarray]
    #: None for ``mean_loss``, which has no (a_t, d) to report.
    metrics: UpdateMetrics | None
    #: ``mean_loss`` only: this rank's per-microbatch mean losses (NaN where a microbatch
    #: has no valid target).
    mean_losses: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class RankOutput:
    """One rank's outcome of one case (`crosscheck.contract.cases.CaseOutput` is the case's,
    gathered over every rank by the harness)."""

    label: str
    rank: int
    #: What the wrapper's gradient reduction measured as (see torch_impl.probe).
    reduction: ReductionPath
    #: The s precount used (the probed factor unless the case overrode it).
    reduce_factor: float
    #: The updates this launch ran, in order.
    updates: list[UpdateOutput] = field(default_factory=list)
    #: How many updates were complete before `updates[0]` (a resumed run starts past 0).
    first_update: int = 0


@dataclass(slots=True)
class _Wrapped:
    model: nn.Module
    reduction: ReductionPath
    hook_state: PostnormState | None


class _WrapperCache:
    """One wrapped model per (V, H, dtype, front-end, reduction), built and probed once."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self._cache: dict[tuple, _Wrapped] = {}

    def get(self, case: UpdateCase) -> _Wrapped:
        vocab_size, hidden_size = np.asarray(case.params["embed"]).shape
        hooked = case.strategy == "postnorm"
        key = (vocab_size, hidden_size, case.dtype, case.front_end, hooked, case.fsdp_divide_factor)
        if key not in self._cache:
            self._cache[key] = self._build(case, hooked)
        return self._cache[key]

    def _build(self, case: UpdateCase, hooked: bool) -> _Wrapped:
        dtype = DTYPES[case.dtype]
        module = BilinearLM.from_numpy(case.params, dtype)
        probe_inputs = torch.arange(module.vocab_size).view(1, -1)
        # The probe (torch_impl.probe) snaps the measured factor at a relative residual of
        # 1e-5, float32-sized; a bf16 gradient is rounded to 2^-9, so a bf16 wrapper cannot be
        # measured by it. Its factor is measured on the same wrapper (front-end, comm hook,
        # divide factor) built in float32, which every rank builds in the same order.
        measure = case.dtype == "bfloat16"
        if case.front_end == "fsdp2":
            from torch_impl.fsdp import shard_fsdp2

            model = shard_fsdp2(
                module, world_size=self.world_size, divide_factor=case.fsdp_divide_factor
            )
            if measure:
                return _Wrapped(model, self._probed_twin(case), None)
            reference = BilinearLM.from_numpy(case.params, dtype)
            return _Wrapped(model, probe_reduction(model, reference, probe_inputs), None)
        model = DistributedDataParallel(module)
        state = None
        if hooked:
            state = PostnormState(rank=self.rank, world_size=self.world_size)
            model.register_comm_hook(state, sum_and_carry_hook)
        if measure:
            return _Wrapped(model, self._probed_twin(case), state)
        return _Wrapped(model, probe_ddp(model, probe_inputs), state)

    def _probed_twin(self, case: UpdateCase) -> ReductionPath:
        """The reduce factor of `case`'s wrapper built in PROBE_DTYPE (cached like any other)."""
        return self.get(dataclasses.replace(case, dtype=PROBE_DTYPE)).reduction


def id_bounds(batch: Mapping[str, np.ndarray]) -> IdBounds:
    """The pre-pass vector lengths from the global batch, which every rank holds whole."""

    def bound(key: str) -> int:
        array = batch.get(key)
        return 0 if array is None or not np.size(array) else int(np.max(array)) + 1

    return IdBounds(bound("group_ids"), bound("document_ids"))


def run_case(case: UpdateCase, wrapped: _Wrapped, rank: int, world_size: int) -> RankOutput:
    """Every update of one case on this rank (from a checkpoint, to a stop, when it says so)."""
    model = wrapped.model
    # A reused wrapper starts clean: no gradient left over from an earlier case's stop.
    model.zero_grad(set_to_none=True)
    load_numpy_params(model, case.params)
    optimizer = make_optimizer(model.parameters(), case.optimizer)
    microbatches = rank_microbatches(case.batch, rank, world_size, case.accum_steps)
    vocab_size = int(np.asarray(case.params["embed"]).shape[0])
    bounds = id_bounds(case.batch) if case.pass_id_bounds else None
    s = wrapped.reduction.reduce_factor if case.reduce_factor is None else case.reduce_factor
    first_update, partial = 0, None
    if case.resume_from is not None:
        state = load_checkpoint(
            case.resume_from,
            rank=rank,
            world_size=world_size,
            accum_steps=case.accum_steps,
            strategy=case.strategy,
            scheme=case.scheme_key,
            dtype=case.dtype,
        )
        partial = restore(state, model, optimizer)
        first_update = state.manifest.updates_done
    stop = case.num_updates if case.stop_after_updates is None else case.stop_after_updates
    resumed_at = (first_update, 0 if partial is None else partial.microbatches_done)
    if (stop, case.stop_after_microbatches) < resumed_at:
        raise ValueError(
            f"case {case.label!r}: the stop comes before the checkpoint's position {resumed_at}"
        )
    output = RankOutput(case.label, rank, wrapped.reduction, s, first_update=first_update)
    for _ in range(first_update, stop):
        mean_losses: list[float] = []
        common = dict(vocab_size=vocab_size, resume=partial, id_bounds=bounds)
        if case.strategy == "precount":
            accumulated = accumulate_precount(
                model, microbatches, case.scheme, reduce_factor=s, **common
            )
        elif case.strategy == "postnorm":
            accumulated = accumulate_postnorm(
                model, microbatches, case.scheme, hook_state=wrapped.hook_state, **common
            )
        else:
            mean_losses = accumulate_mean_loss(model, microbatches, vocab_size=vocab_size)
            accumulated = None
        partial = None
        # The gradient before clipping (which scales it in place), made whole with the params
        # after the step: under FSDP2 one all-gather per update brings both.
        grads = local_grads(model)
        norm, clipped = clip_and_step(model, optimizer, case.max_grad_norm)
        params = local_params(model)
        whole = numpy_full({**{f"grads.{k}": v for k, v in grads.items()}, **params})
        record = None
        if accumulated is not None:
            record = metrics(
                accumulated,
                rank=rank,
                accum_steps=case.accum_steps,
                strategy=case.strategy,
                grad_norm=norm,
                clipped_grad_norm=clipped,
            )
        output.updates.append(
            UpdateOutput(
                {key: whole[f"grads.{key}"] for key in grads},
                {key: whole[key] for key in params},
                record,
                tuple(mean_losses),
            )
        )
    if case.save_to is not None:
        _stop_and_save(case, model, optimizer, microbatches, bounds, s, partial)
    return output


def _stop_and_save(
    case: UpdateCase,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    microbatches: list[TokenBatch],
    bounds: IdBounds | None,
    reduce_factor: float,
    partial: PartialAccumulation | None,
) -> None:
    """Run the stop's first microbatches of the next update (if any), then checkpoint."""
    if case.stop_after_microbatches:
        partial = accumulate_partial(
            model,
            microbatches,
            case.scheme,
            strategy=case.strategy,
            vocab_size=int(np.asarray(case.params["embed"]).shape[0]),
            num_microbatches=case.stop_after_microbatches,
            reduce_factor=reduce_factor,
            resume=partial,
            id_bounds=bounds,
        )
    save_checkpoint(
        case.save_to,
        model,
        optimizer,
        updates_done=case.stop_after_updates,
        accum_steps=case.accum_steps,
        strategy=case.strategy,
        scheme=case.scheme_key,
        partial=partial,
    )
    # The run ends here; its partial gradient is in the checkpoint, not for the next case.
    model.zero_grad(set_to_none=True)


def run_cases(rank: int, world_size: int, cases: Sequence[UpdateCase]) -> list[RankOutput]:
    """Run `cases` in order on this rank of an initialized process group (a launcher target).

    Every rank must receive the same cases: each one runs collectives.
    """
    if not dist.is_initialized():
        raise RuntimeError(f"rank {rank}: run_cases needs an initialized process group")
    torch.manual_seed(0)
    wrappers = _WrapperCache(rank, world_size)
    return [run_case(case, wrappers.get(case), rank, world_size) for case in cases]
