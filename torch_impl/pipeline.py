r"""Pipeline parallel on the bilinear model: two stages, the loss on the last one only.

The model :math:`z_t = E[x_t]\, U` is cut after the embedding: stage 0 holds ``embed`` E and
computes :math:`h_t = E[x_t]`, stage 1 holds ``unembed`` U, the labels and the loss. R
data-parallel pipelines of S = 2 stages are R S processes, process r S + s holding stage s of
data rank r (its rows are rank r's, `torch_impl.batch.rank_microbatches`). The activations of
each microbatch go forward from stage 0 to stage 1 and their gradients come back, point to
point (``isend`` / ``recv`` on gloo), in one of two schedules:

* ``gpipe``: every microbatch forward, then every backward in reverse order;
* ``1f1b``: stage 0 runs one microbatch ahead, then alternates forward m + 1 and backward m;
  stage 1 runs forward and backward of each microbatch in turn.

Only the last stage can count: a_t and D come from its labels, through the count pre-pass of
`torch_impl.update` over the data-parallel group of its stage (the R last stages). Then

* precount divides each microbatch's :math:`\sum_t a_t l_t` by D before its backward: the
  scale travels back with the activations' gradients, and stage 0 never needs D;
* postnorm backpropagates the unnormalized sums and divides the gradients afterwards: the
  last stage must send D to stage 0 (the count is carried down the pipeline), each stage
  divides its own gradient.

Each stage's gradient is then summed over its data-parallel group (an ``all_reduce`` SUM: no
averaging to compensate). The objective is the single-process one, whatever R, M, the schedule
and the strategy: `tests/test_torch_pipeline.py` holds it to the oracle. `pipeline_update`
with ``count_to_first_stage=False`` is the bug of torchtitan#4194's shape: the count reaches
one stage only, and the first stage's gradient stays the unnormalized sum.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.functional import cross_entropy

from torch_impl.batch import IGNORE_INDEX, TokenBatch
from torch_impl.spec import get_spec
from torch_impl.update import SpecLike, count_update

#: The parameters of each stage, in pipeline order.
STAGE_PARAMS: tuple[str, ...] = ("embed", "unembed")
NUM_STAGES = len(STAGE_PARAMS)
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b")
STRATEGIES: tuple[str, ...] = ("precount", "postnorm")


class Stage(nn.Module):
    """One stage's parameter: ``embed`` [V, H] on stage 0, ``unembed`` [H, V] on stage 1."""

    def __init__(self, name: str, value: np.ndarray) -> None:
        super().__init__()
        self.name = name
        self.weight = nn.Parameter(torch.tensor(np.asarray(value), dtype=torch.float64))


@dataclass(frozen=True, slots=True)
class PipelinePosition:
    """Where a process sits: data rank r, stage s, of R pipelines of `NUM_STAGES` stages."""

    process: int
    data_parallel_size: int

    @property
    def data_rank(self) -> int:
        return self.process // NUM_STAGES

    @property
    def stage(self) -> int:
        return self.process % NUM_STAGES

    def peer(self, stage: int) -> int:
        """The process of `stage` in this process's pipeline."""
        return self.data_rank * NUM_STAGES + stage


@functools.cache
def stage_groups(data_parallel_size: int) -> tuple[dist.ProcessGroup, ...]:
    """One group per stage: its R processes r S + s. Every process creates every group, in
    the same order (``dist.new_group`` requires it); cached for the process's life (a launch
    starts fresh processes: one default process group each)."""
    return tuple(
        dist.new_group([r * NUM_STAGES + s for r in range(data_parallel_size)])
        for s in range(NUM_STAGES)
    )


@dataclass(frozen=True, slots=True)
class PipelineResult:
    """One process's stage after an update: its synchronized gradient and the D it used."""

    stage: int
    name: str
    grad: np.ndarray
    #: D of the update as this stage knows it (nan on stage 0 under precount: never sent).
    denominator: float


def _order(schedule: str, stage: int, M: int) -> list[tuple[str, int]]:
    """The ("F" | "B", microbatch) steps a stage runs, in order."""
    if schedule == "gpipe":
        return [("F", m) for m in range(M)] + [("B", m) for m in reversed(range(M))]
    if stage == NUM_STAGES - 1:  # 1f1b on the last stage: each microbatch through at once
        return [step for m in range(M) for step in (("F", m), ("B", m))]
    # 1f1b on stage 0: one forward ahead (the warm-up of a 2-stage pipeline), then
    # forward m + 1 and backward m alternate, then the last backward.
    steps = [("F", 0)]
    for m in range(1, M):
        steps += [("F", m), ("B", m - 1)]
    return [*steps, ("B", M - 1)]


def pipeline_update(
    stage: Stage,
    microbatches: Sequence[TokenBatch],
    spec: SpecLike,
    *,
    position: PipelinePosition,
    schedule: str = "1f1b",
    strategy: str = "precount",
    count_to_first_stage: bool = True,
) -> PipelineResult:
    r"""One update of `spec` through this process's stage (every process calls it).

    `microbatches` are this data rank's M microbatches (stage 0 reads the inputs, stage 1 the
    targets and the spec's fields). Returns the stage's gradient after the data-parallel sum.
    ``count_to_first_stage=False`` (postnorm only) leaves stage 0 without D: the bug of a loop
    that normalizes after the schedule on the last stage alone (torchtitan#4194's shape).
    """
    if schedule not in SCHEDULES or strategy not in STRATEGIES:
        raise ValueError(
            f"schedule must be one of {SCHEDULES} and strategy one of {STRATEGIES}, "
            f"got {schedule!r} and {strategy!r}"
        )
    if not count_to_first_stage and strategy != "postnorm":
        raise ValueError("count_to_first_stage=False is postnorm's bug: precount never sends D")
    spec = get_spec(spec)
    groups = stage_groups(position.data_parallel_size)
    last = position.stage == NUM_STAGES - 1
    stage.zero_grad(set_to_none=True)
    D, weights = math.nan, None
    if last:  # the labels live here: a_t and D before any backward
        plan, D = count_update(spec, microbatches, group=groups[position.stage])
        weights = plan.weights
    scale = 1.0 / D if (last and strategy == "precount" and D) else 1.0
    if last and strategy == "precount" and not D:
        scale = 0.0  # nothing to learn from: D = 0 gives a zero gradient, never NaN
    _run_schedule(stage, microbatches, weights, scale, position, schedule)
    if strategy == "postnorm":
        D = _carry_count(D, position, count_to_first_stage)
        if not math.isnan(D):
            stage.weight.grad.mul_(1.0 / D if D else 0.0)
    grad = stage.weight.grad
    dist.all_reduce(grad, group=groups[position.stage])  # a sum: no averaging to undo
    return PipelineResult(position.stage, stage.name, grad.numpy().copy(), D)


def _carry_count(D: float, position: PipelinePosition, to_first_stage: bool) -> float:
    """postnorm: the last stage sends D to stage 0 of its pipeline (nan there when not sent)."""
    if not to_first_stage:
        return D  # BUG when used: stage 0 keeps nan and never divides
    buffer = torch.tensor(D if position.stage == NUM_STAGES - 1 else 0.0, dtype=torch.float64)
    if position.stage == NUM_STAGES - 1:
        dist.send(buffer, position.peer(0))
    else:
        dist.recv(buffer, position.peer(NUM_STAGES - 1))
    return float(buffer)


def _run_schedule(
    stage: Stage,
    microbatches: Sequence[TokenBatch],
    weights: Sequence[torch.Tensor] | None,
    scale: float,
    position: PipelinePosition,
    schedule: str,
) -> None:
    """The forward and backward steps of `schedule` on this stage, sends and receives between
    the two stages of this pipeline."""
    sends: list[tuple[dist.Work, torch.Tensor]] = []  # each send with the tensor it reads
    kept: dict[int, torch.Tensor] = {}  # stage 0: h_m; stage 1: (h_m, its weighted loss)
    losses: dict[int, torch.Tensor] = {}
    first = position.stage == 0
    for kind, m in _order(schedule, position.stage, len(microbatches)):
        batch = microbatches[m]
        if first and kind == "F":
            hidden = stage.weight[batch.inputs]  # [B, T, H]
            kept[m] = hidden
            sent = hidden.detach().contiguous()
            sends.append((dist.isend(sent, position.peer(1)), sent))
        elif first:
            grad = torch.empty_like(kept[m])
            dist.recv(grad, position.peer(1))
            kept.pop(m).backward(grad)
        elif kind == "F":
            B, T = batch.targets.shape
            hidden = torch.empty(B, T, stage.weight.shape[0], dtype=torch.float64)
            dist.recv(hidden, position.peer(0))
            hidden.requires_grad_(True)
            logits = hidden @ stage.weight
            token_losses = cross_entropy(
                logits.flatten(0, 1),
                batch.targets.flatten(),
                ignore_index=IGNORE_INDEX,
                reduction="none",
            ).view(B, T)
            kept[m] = hidden
            losses[m] = (weights[m].to(torch.float64) * token_losses).sum() * scale
        else:
            losses.pop(m).backward()
            sent = kept.pop(m).grad.contiguous()
            sends.append((dist.isend(sent, position.peer(0)), sent))
    for work, _ in sends:
        work.wait()
