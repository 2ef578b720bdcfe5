"""Running harness cases on torch: one process group per world size serves all its cases.

`torch_impl.harness.cases.run_cases` runs on every rank of a real gloo process group; this side
builds its case list, makes one job per world size that launches once (bounded by a timeout; ranks
are forked from a zygote that imported torch, see `torch_impl.harness.launcher`), and turns
each rank's plain numpy output into a `CaseOutput`. The accidental schemes are produced the way real
loops produce them: F.cross_entropy(reduction="mean") per microbatch under plain DDP averaging
(`mean_loss`), which is rank_mean at M = 1 and microbatch_mean at M > 1. Every dtype of the
matrix runs: float64, float32 and bfloat16 (a bf16 model whose gradients DDP all-reduces in
bf16 buckets on gloo, FSDP2 reduce-scatters in bf16; counts, weight sums and the division by D
stay float64 in torch_impl whatever the params' dtype).

`run_resume` checks checkpoint resume: a first round of launches (one per world size) stops
each case's run and saves a checkpoint, a second round in fresh processes (one launch per
resume world size) loads and continues; the uninterrupted baselines ride in the first round.
"""

from __future__ import annotations

import dataclasses
import functools
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from crosscheck.contract.cases import (
    Case,
    CaseOutput,
    Params,
    RankMetrics,
    ResumeCase,
    ResumeOutput,
    TrainSettings,
)
from crosscheck.contract.schemes import SCHEMES as V1_SCHEMES
from crosscheck.contract.schemes import resolve_scheme
from crosscheck.launch.schedule import Job
from crosscheck.launch.workers import launch_arrays, launch_each, launchable

IMPLS: dict[str, str] = {"torch-ddp": "ddp", "torch-fsdp2": "fsdp2"}
#: The params' dtypes of torch_impl.harness.cases.DTYPES (repeated so that choosing cases does not
#: import torch).
DTYPES: tuple[str, ...] = ("float64", "float32", "bfloat16")
LAUNCH_TIMEOUT_S = 300.0
COLLECTIVE_TIMEOUT_S = 120.0

OnDone = Callable[[Case, CaseOutput | BaseException], None]
OnResumeDone = Callable[[ResumeCase, ResumeOutput | BaseException], None]


def why_unsupported(case: Case) -> str:
    """Why the torch reference does not run `case`, or '' when it does: FSDP2 has no comm hook
    (precount only); the mean-loss loop makes rank_mean only where a rank is one microbatch.
    One sentence per reason, without the case's coordinates: the harness groups skips by it."""
    # The widest reason first (dtype, then implementation, then scheme and layout), so that a
    # refused plan names the reason that matters.
    if case.dtype not in DTYPES:
        return f"the torch reference runs {', '.join(DTYPES)}, not {case.dtype}"
    if case.impl == "torch-fsdp2" and case.strategy == "postnorm":
        return "FSDP2 has no comm hook, so postnorm does not run there: torch-fsdp2 runs precount"
    if case.impl == "torch-fsdp2" and case.strategy != "precount":
        return "torch-fsdp2 runs precount only (the accidental schemes' loop runs on torch-ddp)"
    if case.scheme == "rank_mean" and case.accum_steps != 1:
        return "the torch mean-loss loop is rank_mean only at M = 1 (at M > 1 microbatch_mean)"
    if case.scheme not in V1_SCHEMES and case.dtype != "float64":
        return "the matrix runs trainer modes (scheme specs) in float64"
    return ""


def supports(case: Case) -> bool:
    """Whether the torch reference runs `case` (`why_unsupported` says why not)."""
    return not why_unsupported(case)


def _update_case(case: Case | ResumeCase, settings: TrainSettings, accum_steps: int | None = None):
    """The case as a torch_impl UpdateCase, at `accum_steps` (default: the case's own)."""
    from torch_impl.harness.cases import UpdateCase
    from torch_impl.optimizers import OptimizerSpec

    accidental = case.scheme in ("rank_mean", "microbatch_mean")
    batch, params = launch_arrays(case.fixture)
    return UpdateCase(
        label=case.describe(),
        batch=batch,
        params=params,
        # The spec itself, in its JSON form: torch_impl reads it with its own parser.
        scheme="token_mean" if accidental else resolve_scheme(case.scheme).to_dict(),
        strategy="mean_loss" if accidental else case.strategy,
        accum_steps=case.accum_steps if accum_steps is None else accum_steps,
        optimizer=OptimizerSpec(**settings.optimizer_spec()),
        dtype=case.dtype,
        front_end=IMPLS[case.impl],
        num_updates=settings.num_updates,
        max_grad_norm=settings.max_grad_norm,
    )


def _case_output(case: Case, per_rank: list) -> CaseOutput:
    """Rank 0's gradient and params (checked equal on every rank) and every rank's metrics."""
    first = per_rank[0]
    for other in per_rank[1:]:
        for a, b in zip(first.updates, other.updates, strict=True):
            for key in a.params:
                if not np.array_equal(a.params[key], b.params[key]):
                    raise AssertionError(
                        f"{case.describe()}: rank {other.rank} holds different {key} than rank 0"
                    )
    metrics = [
        RankMetrics(
            rank=out.rank,
            update=u,
            valid_tokens=int(m.rank_valid_tokens[out.rank]),
            loss_sum=float(m.rank_loss_sums[out.rank]),
            denominator=float(m.global_denominator),
            objective=float(m.objective),
            grad_norm=float(m.grad_norm),
            clipped_grad_norm=float(m.clipped_grad_norm),
        )
        for out in per_rank
        for u, update in enumerate(out.updates)
        if (m := update.metrics) is not None
    ]
    return CaseOutput(
        grads=first.updates[0].grads,
        params=[update.params for update in first.updates],
        metrics=metrics,
    )


def _run_world(
    cases: list[Case], settings: TrainSettings, on_done: OnDone, world_size: int
) -> None:
    """One launch of `world_size` ranks runs every case of that size."""
    from torch_impl.harness.cases import run_cases

    outcomes = launch_each(
        run_cases,
        world_size,
        cases,
        lambda case: _update_case(case, settings),
        _case_output,
        timeout_s=LAUNCH_TIMEOUT_S,
        collective_timeout_s=COLLECTIVE_TIMEOUT_S,
    )
    for case, outcome in zip(cases, outcomes, strict=True):
        on_done(case, outcome)


def jobs(cases: list[Case], settings: TrainSettings, on_done: OnDone) -> list[Job]:
    """One launch per world size; each reports its cases through `on_done`."""
    by_world: dict[int, list[Case]] = {}
    for case in cases:
        by_world.setdefault(case.world_size, []).append(case)
    # Costs (CPU seconds, measured on 2 cores): a rank starts in about 0.5 s (forked from the
    # zygote); a case costs every rank a few ms, more as ranks outnumber the cores and
    # wait for each other at every collective.
    return [
        Job(
            name=f"torch R={world_size}",
            processes=world_size,
            cost=0.5 * world_size + 0.004 * world_size**2 * len(group),
            run=functools.partial(_run_world, group, settings, on_done, world_size),
        )
        for world_size, group in sorted(by_world.items())
    ]


def _resume_base(case: ResumeCase, settings: TrainSettings, accum_steps: int):
    """The case's run at `accum_steps` microbatches per rank (the world size is the launch's),
    `case.num_updates` long, as a torch_impl UpdateCase."""
    return dataclasses.replace(
        _update_case(case, settings, accum_steps), num_updates=case.num_updates
    )


def _resume_problem(case: ResumeCase) -> str:
    """Why the torch reference cannot run this resume case, or ''."""
    if case.impl != "torch-ddp":
        return f"{case.describe()}: checkpoint resume runs under DDP only (impl torch-ddp)"
    if case.strategy not in ("precount", "postnorm") or case.scheme in (
        "rank_mean",
        "microbatch_mean",
    ):
        return f"{case.describe()}: checkpoint resume runs intended schemes, precount or postnorm"
    if case.dtype not in DTYPES:
        return f"{case.describe()}: dtype {case.dtype} is not run by the torch reference"
    return ""


def _final_params(label: str, per_rank: list, num_updates: int) -> Params:
    """Rank 0's params after update `num_updates`, checked equal on every rank."""
    reached = per_rank[0].first_update + len(per_rank[0].updates)
    if reached != num_updates or not per_rank[0].updates:
        raise AssertionError(f"{label}: the run ended after update {reached}, not {num_updates}")
    first = per_rank[0].updates[-1].params
    for other in per_rank[1:]:
        for key, value in other.updates[-1].params.items():
            if not np.array_equal(value, first[key]):
                raise AssertionError(f"{label}: rank {other.rank} holds different {key}")
    return first


def _launch_groups(work: dict[int, dict[tuple, Any]]) -> dict[tuple, Params | BaseException]:
    """Launch each world size's UpdateCases once; each key's final params or its error."""
    from torch_impl.harness.cases import run_cases

    def final_params(item: tuple[tuple, Any], per_rank: list) -> Params:
        _, update_case = item
        # A stop saves without finishing; only runs that reach the end have params.
        if update_case.stop_after_updates is not None:
            return {}
        return _final_params(update_case.label, per_rank, update_case.num_updates)

    results: dict[tuple, Params | BaseException] = {}
    for world_size, group in sorted(work.items()):
        outcomes = launch_each(
            run_cases,
            world_size,
            list(group.items()),
            lambda item: item[1],
            final_params,
            timeout_s=LAUNCH_TIMEOUT_S,
            collective_timeout_s=COLLECTIVE_TIMEOUT_S,
        )
        results.update(zip(group, outcomes, strict=True))
    return results


def run_resume(cases: list[ResumeCase], settings: TrainSettings, on_done: OnResumeDone) -> None:
    """Stop, checkpoint, resume in fresh processes; report each case through `on_done`.

    Round 1 (one launch per world size) runs every distinct stop, saving a checkpoint into a
    temporary directory, and every distinct uninterrupted baseline; round 2 (one launch per
    resume world size) loads each checkpoint and continues to `case.num_updates`. Each case
    gets ResumeOutput(resumed=final params of the resumed run, uninterrupted=final params of
    the same run at the original layout without a stop). Optimizer and clipping come from
    `settings`; its num_updates is replaced by each case's own.
    """
    root = Path(tempfile.mkdtemp(prefix="gradweight-resume-"))
    try:
        _run_resume(cases, settings, on_done, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run_resume(
    cases: list[ResumeCase], settings: TrainSettings, on_done: OnResumeDone, root: Path
) -> None:
    runnable = launchable(cases, _resume_problem, on_done)

    first_round: dict[int, dict[tuple, Any]] = {}
    stops: dict[ResumeCase, tuple] = {}
    baselines: dict[ResumeCase, tuple] = {}
    for case in runnable:
        R, M = case.world_size, case.accum_steps
        run = (case.fixture, case.scheme, case.strategy, case.dtype, R, M)
        group = first_round.setdefault(R, {})
        baselines[case] = ("uninterrupted", *run, case.num_updates)
        if baselines[case] not in group:
            group[baselines[case]] = dataclasses.replace(
                _resume_base(case, settings, M),
                label=f"uninterrupted {case.describe()}",
            )
        # Cases that stop at the same point of the same run share one checkpoint.
        stops[case] = ("stop", *run, case.stop_after_updates, case.stop_after_microbatches)
        if stops[case] not in group:
            group[stops[case]] = dataclasses.replace(
                _resume_base(case, settings, M),
                label=f"stop {case.describe()}",
                stop_after_updates=case.stop_after_updates,
                stop_after_microbatches=case.stop_after_microbatches,
                save_to=str(root / f"checkpoint-{len(stops)}"),
            )
    saved = _launch_groups(first_round)

    second_round: dict[int, dict[tuple, Any]] = {}
    for case in runnable:
        failure = next(
            (
                saved[k]
                for k in (stops[case], baselines[case])
                if isinstance(saved[k], BaseException)
            ),
            None,
        )
        if failure is not None:
            on_done(case, failure)
            continue
        R, M = case.resume_world_size, case.resume_accum_steps
        second_round.setdefault(R, {})[("resume", case)] = dataclasses.replace(
            _resume_base(case, settings, M),
            label=f"resume {case.describe()}",
            resume_from=first_round[case.world_size][stops[case]].save_to,
        )
    resumed = _launch_groups(second_round)
    for group in second_round.values():
        for key in group:
            case = key[1]
            result = resumed[key]
            if isinstance(result, BaseException):
                on_done(case, result)
            else:
                on_done(case, ResumeOutput(resumed=result, uninterrupted=saved[baselines[case]]))
