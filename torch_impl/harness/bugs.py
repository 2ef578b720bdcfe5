r"""The buggy training steps of docs/bugs.md on one rank: the torch side of the bug catalogue.

A :class:`BugStep` names a pattern of ``crosscheck.diagnosis.patterns`` (or ``RANK_SKEW``), a global
batch of [N, T] numpy arrays, float64 params, the accumulation steps M, a dtype and, for
rank-skew, a skew. :func:`run_bug_steps` is a ``torch_impl.harness.launcher.launch`` target: on
every
rank of a gloo group it runs each step as a real loop would,

* a fresh ``DistributedDataParallel``-wrapped ``BilinearLM`` holding the step's params (float64,
  or float32 or bfloat16 when the step says so: the loop computes in that dtype throughout, as
  a plain bf16 loop does);
* rank r's rows [r N/R, (r+1) N/R) in M contiguous microbatches (``crosscheck.contract.layout``),
  or under context parallel (C > 1, a world of R C processes) process r C + c's share of
  them: context rank c's positions of rank r's rows (``torch_impl.batch.context_microbatches``);
* `num_windows` accumulation windows on that same batch with the same params, gradients zeroed
  between windows and no optimizer step (only stale-count makes the windows differ); each
  window is the pattern's loop of ``torch_impl.harness.bugs_windows``;

and returns the second window's synchronized gradient (float64 numpy, what the optimizer would
receive) with the denominator the loop logs. The caller checks that every rank holds the same
gradient (:func:`check_ranks_agree`) and reports rank 0's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from torch_impl.batch import (
    BATCH_KEYS,
    OPTIONAL_KEYS,
    TokenBatch,
    context_microbatches,
    rank_microbatches,
)
from torch_impl.harness.bugs_windows import PIPELINE_STEPS, RANK_SKEW, WINDOW_STEPS, Window
from torch_impl.model import PARAM_NAMES, BilinearLM, numpy_grads
from torch_impl.pipeline import NUM_STAGES, STAGE_PARAMS, PipelinePosition, Stage

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
}


@dataclass(frozen=True, kw_only=True, slots=True)
class BugStep:
    """One buggy step to run on every rank of the launched world."""

    #: Names the step in every message (the harness uses BugRun.describe()).
    label: str
    #: A ``crosscheck.diagnosis.patterns.PATTERNS`` id, or ``RANK_SKEW``.
    pattern: str
    #: Global [N, T] arrays: inputs, targets, segment_ids, weights; and optionally contract
    #: v2's group_ids / row_weights / sample_mask [N] and document_ids [N, T].
    batch: Mapping[str, np.ndarray]
    #: float64 ``embed`` [V, H] and ``unembed`` [H, V].
    params: Mapping[str, np.ndarray]
    accum_steps: int
    dtype: str = "float64"
    #: rank-skew only: rank 0's loss is multiplied by it.
    skew: float = 1.0
    #: Windows run on the same batch and params; the last one is reported (the harness
    #: passes crosscheck.diagnosis.patterns.NUM_WINDOWS: torch_impl does not import the harness).
    num_windows: int = 2
    #: clip-per-microbatch only: the max norm of each microbatch's gradient.
    clip_norm: float = 0.15
    #: Context parallel: C context ranks per data rank, splitting every row in this order
    #: (1: none). The launched world is then R C processes, process r C + c.
    context_size: int = 1
    context_order: str = "contiguous"
    #: Pipeline: the model cut into this many stages (``torch_impl.pipeline``: 2), the world
    #: R x stages processes, process r S + s holding stage s of data rank r (1: none).
    pipeline_stages: int = 1


@dataclass(frozen=True, slots=True)
class BugStepResult:
    """What one rank holds after the step's second window."""

    label: str
    rank: int
    #: The synchronized gradient, float64 numpy: ``embed`` [V, H], ``unembed`` [H, V].
    grads: dict[str, np.ndarray]
    #: What the loop logs as its denominator for the second window (this rank's).
    logged_denominator: float


class RankDisagreementError(AssertionError):
    """Ranks ended a step with different gradients: the synchronization itself is broken."""

    def __init__(self, label: str, rank: int, detail: str) -> None:
        super().__init__(f"{label}: rank {rank} {detail}")
        self.rank = rank


def validate_step(step: BugStep, rank: int, world_size: int) -> list[TokenBatch]:
    """This rank's M microbatches, once the step is known to run on every rank.

    Checks the pattern, dtype, skew, params, the layout and every token of *every* rank's
    microbatches, so that a bad step raises the same ValueError on all ranks before any
    collective (and none is left waiting for a peer). Messages start with the step's label;
    a bad token names its rank, microbatch, row and position (``torch_impl.batch``).
    """
    where = step.label
    known = (*WINDOW_STEPS, *PIPELINE_STEPS)
    if step.pattern not in known:
        raise ValueError(
            f"{where}: unknown bug pattern {step.pattern!r}; known: {', '.join(known)}"
        )
    if (step.pattern in PIPELINE_STEPS) != (
        step.pipeline_stages > 1
    ) or step.pipeline_stages not in (
        1,
        NUM_STAGES,
    ):
        raise ValueError(
            f"{where}: the pipeline patterns ({', '.join(PIPELINE_STEPS)}) run on "
            f"{NUM_STAGES} stages and the others on none, got pipeline_stages="
            f"{step.pipeline_stages}"
        )
    if step.pipeline_stages > 1 and step.context_size > 1:
        raise ValueError(f"{where}: a pipeline with context parallel is not a catalogue layout")
    if step.pipeline_stages > 1 and (step.dtype != "float64" or world_size % NUM_STAGES):
        raise ValueError(
            f"{where}: a pipeline runs in float64 on R x {NUM_STAGES} processes, got "
            f"{step.dtype} on {world_size}"
        )
    if step.dtype not in DTYPES:
        raise ValueError(f"{where}: dtype must be one of {tuple(DTYPES)}, got {step.dtype!r}")
    if not math.isfinite(step.skew) or (step.pattern != RANK_SKEW and step.skew != 1.0):
        raise ValueError(
            f"{where}: skew must be finite, and 1.0 except for {RANK_SKEW}, got {step.skew!r}"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"{where}: rank {rank} is not in a world of size {world_size}")
    # The batch holds the four token arrays and, optionally, contract v2's row fields
    # (group_ids for local-group-count); the params exactly embed and unembed.
    if not set(BATCH_KEYS) <= set(step.batch) <= {*BATCH_KEYS, *OPTIONAL_KEYS}:
        raise ValueError(
            f"{where}: batch must hold {BATCH_KEYS} and optionally {OPTIONAL_KEYS}, "
            f"got {sorted(step.batch)}"
        )
    if set(step.params) != set(PARAM_NAMES):
        raise ValueError(
            f"{where}: params must hold exactly {PARAM_NAMES}, got {sorted(step.params)}"
        )
    embed, unembed = np.asarray(step.params["embed"]), np.asarray(step.params["unembed"])
    if embed.ndim != 2 or unembed.shape != embed.shape[::-1]:
        raise ValueError(
            f"{where}: params must be embed [V, H] and unembed [H, V], "
            f"got {embed.shape} and {unembed.shape}"
        )
    C = step.context_size
    if isinstance(C, bool) or not isinstance(C, int) or C < 1 or world_size % C:
        raise ValueError(
            f"{where}: context_size must be a whole divisor of the {world_size} processes, "
            f"got {C!r}"
        )
    try:
        for other in range(world_size):
            for batch in _microbatches(step, other, world_size):
                batch.validate(embed.shape[0])
    except ValueError as error:  # BatchError: the layout does not divide, or a bad token
        raise type(error)(f"{where}: {error}") from error
    return _microbatches(step, rank, world_size)


def _microbatches(step: BugStep, process: int, num_processes: int) -> list[TokenBatch]:
    """This process's M microbatches: its rank's rows, and under context parallel its
    context rank's positions of them."""
    C, S = step.context_size, step.pipeline_stages
    if S > 1:  # every stage of data rank r's pipeline holds rank r's rows
        return rank_microbatches(step.batch, process // S, num_processes // S, step.accum_steps)
    if C == 1:
        return rank_microbatches(step.batch, process, num_processes, step.accum_steps)
    R = num_processes // C
    return context_microbatches(step.batch, process, R, C, step.accum_steps, step.context_order)


def run_bug_step(step: BugStep, rank: int, world_size: int) -> BugStepResult:
    """Run one step on this rank (every rank of the group must call it with the same step)."""
    microbatches = validate_step(step, rank, world_size)
    run = _run_pipeline_windows if step.pipeline_stages > 1 else _run_windows
    return run(step, microbatches, rank, world_size)


def _run_windows(
    step: BugStep, microbatches: Sequence[TokenBatch], rank: int, world_size: int
) -> BugStepResult:
    # A fresh wrapper per step: no hook, bucket order or leftover .grad from another step.
    model = DistributedDataParallel(BilinearLM.from_numpy(step.params, DTYPES[step.dtype]))
    C = step.context_size
    window = Window(
        rank=rank,
        world_size=world_size,
        accum_steps=step.accum_steps,
        skew=step.skew,
        clip_norm=step.clip_norm,
        context_size=C,
        # Without context parallel the rank's microbatches are already its whole rows.
        unsplit=microbatches
        if C == 1
        else rank_microbatches(step.batch, rank // C, world_size // C, step.accum_steps),
    )
    window_step = WINDOW_STEPS[step.pattern]
    logged = math.nan
    for _ in range(step.num_windows):
        # Where the optimizer would step and zero: the params stay as they are, so every
        # window sees the same objective and only a loop's own state (stale-count) differs.
        model.zero_grad(set_to_none=True)
        logged = window_step(model, microbatches, window)
    return BugStepResult(step.label, rank, numpy_grads(model), float(logged))


def run_bug_steps(
    rank: int, world_size: int, steps: Sequence[BugStep]
) -> list[BugStepResult | ValueError]:
    """Every step in order on this rank of an initialized process group (a launcher target).

    A step that fails validation yields its ValueError instead of a result; it fails alike on
    every rank (each checks the whole global batch), so the ranks skip it together and the
    other steps still run. An error inside a step's collectives fails the launch.
    """
    if not dist.is_initialized():
        raise RuntimeError(f"rank {rank}: run_bug_steps needs an initialized process group")
    results: list[BugStepResult | ValueError] = []
    for step in steps:
        try:
            microbatches = validate_step(step, rank, world_size)
        except ValueError as error:
            results.append(error)
            continue
        run = _run_pipeline_windows if step.pipeline_stages > 1 else _run_windows
        results.append(run(step, microbatches, rank, world_size))
    return results


def _run_pipeline_windows(
    step: BugStep, microbatches: Sequence[TokenBatch], rank: int, world_size: int
) -> BugStepResult:
    """A pipeline pattern's windows on this process's stage; then every process gathers every
    stage's synchronized gradient, so that each holds the whole gradient (as the optimizer of
    each stage reads its own part of it) and the ranks can be compared."""
    position = PipelinePosition(rank, world_size // NUM_STAGES)
    name = STAGE_PARAMS[position.stage]
    stage = Stage(name, step.params[name])  # float64: the pipeline computes in float64
    for _ in range(step.num_windows):
        result = PIPELINE_STEPS[step.pattern](stage, microbatches, position)
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, (result.name, result.grad, result.denominator))
    grads = {leaf: grad for leaf, grad, _ in gathered}
    logged = gathered[position.peer(NUM_STAGES - 1)][2]  # D as the last stage knows it
    return BugStepResult(step.label, rank, grads, float(logged))


def check_ranks_agree(per_rank: Sequence[BugStepResult]) -> BugStepResult:
    """Rank 0's result, after checking every rank holds a bit-identical gradient.

    One all-reduce leaves the same bytes on every rank, and so does clipping them; anything
    else means a rank synchronized differently. Raises RankDisagreementError naming the first
    rank, parameter and element that differ from rank 0. Denominators may differ (rank-mean
    and microbatch-mean log a per-rank count).
    """
    if not per_rank:
        raise ValueError("check_ranks_agree needs at least one rank's result")
    first = per_rank[0]
    for result in per_rank[1:]:
        if result.label != first.label:
            raise RankDisagreementError(
                first.label, result.rank, f"returned the result of {result.label!r}"
            )
        for name, expected in first.grads.items():
            actual = result.grads.get(name)
            if actual is None or actual.shape != expected.shape:
                raise RankDisagreementError(
                    first.label, result.rank, f"holds no {name} gradient of shape {expected.shape}"
                )
            differ = ~((actual == expected) | (np.isnan(actual) & np.isnan(expected)))
            if differ.any():
                index = tuple(int(i) for i in np.argwhere(differ)[0])
                raise RankDisagreementError(
                    first.label,
                    result.rank,
                    f"holds a different {name} gradient than rank 0 at {list(index)}: "
                    f"{actual[index]!r} vs {expected[index]!r} "
                    f"({int(differ.sum())} of {differ.size} elements differ)",
                )
    return first
