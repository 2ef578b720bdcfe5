"""Running the bug catalogue on torch: one process group per world size serves all its runs.

`torch_impl.harness.bugs.run_bug_steps` runs on every rank of a real gloo process group; this side
checks each `BugRun`, builds its step from the built-in fixture's plain numpy arrays, launches
once per world size (starting R processes costs seconds; every wait is bounded), checks that
every rank holds the same gradient and hands back rank 0's as a `BugOutput`. torch is imported
only when something is launched, so crosscheck itself does not need it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from crosscheck.diagnosis.patterns import (
    CLIP_PER_MICROBATCH_NORM,
    NUM_WINDOWS,
    PATTERNS,
    PIPELINE_STAGE_PARAMS,
    RANK_SKEW,
    BugOutput,
    BugRun,
)
from crosscheck.launch.workers import launch_arrays, launch_each, layout_problem

if TYPE_CHECKING:  # torch is imported only when something is launched
    from torch_impl.harness.bugs import BugStep, BugStepResult

#: One launch runs every step of its world size; the largest (R = 4, a dozen steps, two
#: windows each) takes well under a minute on two shared cores.
LAUNCH_TIMEOUT_S = 300.0
#: A collective whose peer died fails on its own after this.
COLLECTIVE_TIMEOUT_S = 120.0
DTYPES: tuple[str, ...] = ("float64", "float32", "bfloat16")


def _problem(bug_run: BugRun) -> str:
    """Why this run cannot be launched on torch, or ''."""
    where = bug_run.describe()
    if bug_run.framework != "torch":
        return f"{where}: framework {bug_run.framework!r} is not run here (torch only)"
    if bug_run.pattern != RANK_SKEW:
        if bug_run.pattern not in PATTERNS:
            known = ", ".join([*PATTERNS, RANK_SKEW])
            return f"{where}: unknown bug pattern {bug_run.pattern!r}; known: {known}"
        if "torch" not in PATTERNS[bug_run.pattern].frameworks:
            return f"{where}: pattern {bug_run.pattern!r} does not exist in torch"
        if bug_run.skew != 1.0:
            return f"{where}: skew applies to {RANK_SKEW} only, got {bug_run.skew!r}"
    if not math.isfinite(bug_run.skew):
        return f"{where}: skew must be finite, got {bug_run.skew!r}"
    if bug_run.dtype not in DTYPES:
        return f"{where}: dtype must be one of {DTYPES}, got {bug_run.dtype!r}"
    if bug_run.world_size < 1 or bug_run.accum_steps < 1:
        return f"{where}: world_size and accum_steps must be >= 1"
    if bug_run.pipeline_stages > 1 and bug_run.context_size > 1:
        return f"{where}: a pipeline with context parallel is not a catalogue layout"
    if bug_run.pipeline_stages not in (1, len(PIPELINE_STAGE_PARAMS)):
        stages = len(PIPELINE_STAGE_PARAMS)
        return f"{where}: pipelines have {stages} stages here, not {bug_run.pipeline_stages}"
    try:
        layout = bug_run.layout
    except ValueError as error:  # a context size below 1 or an unknown order
        return f"{where}: {error}"
    problem = layout_problem(bug_run.fixture, bug_run.world_size, bug_run.accum_steps, layout)
    return f"{where}: {problem}" if problem else ""


def _bug_step(bug_run: BugRun) -> BugStep:
    from torch_impl.harness.bugs import BugStep

    batch, params = launch_arrays(bug_run.fixture)
    return BugStep(
        label=bug_run.describe(),
        pattern=bug_run.pattern,
        batch=batch,
        params=params,
        accum_steps=bug_run.accum_steps,
        dtype=bug_run.dtype,
        skew=bug_run.skew,
        num_windows=NUM_WINDOWS,
        clip_norm=CLIP_PER_MICROBATCH_NORM,
        context_size=bug_run.context_size,
        context_order=bug_run.context_order,
        pipeline_stages=bug_run.pipeline_stages,
    )


def bug_output(per_rank: Sequence[BugStepResult | BaseException]) -> BugOutput | BaseException:
    """One run's BugOutput from every rank's result (rank order), or the error it raised.

    A validation error is the same on every rank; rank 0's is returned. Otherwise every rank
    must hold rank 0's gradient bit for bit (RankDisagreementError names the rank).
    """
    from torch_impl.harness.bugs import check_ranks_agree

    if isinstance(per_rank[0], BaseException):
        return per_rank[0]
    for rank, result in enumerate(per_rank):
        if isinstance(result, BaseException):
            return RuntimeError(
                f"{per_rank[0].label}: rank {rank} failed where rank 0 did not: {result}"
            )
    first = check_ranks_agree(per_rank)
    return BugOutput(grads=first.grads, logged_denominator=first.logged_denominator)


def run(runs: list[BugRun]) -> dict[BugRun, BugOutput | BaseException]:
    """Every run's second-window gradient and logged denominator, or the error it met.

    Runs that cannot be launched (another framework, unknown pattern or fixture, a layout that
    does not divide the fixture's rows or positions) get a ValueError without a launch. The
    rest run in one launch per number of processes (R, or R C under context parallel: a
    context-parallel step shares the launch of its process count); a launch that fails fails
    every run it carried, with its error.
    """
    results: dict[BugRun, BugOutput | BaseException] = {}
    by_world: dict[int, list[BugRun]] = {}
    for bug_run in dict.fromkeys(runs):  # each distinct run once, in order
        problem = _problem(bug_run)
        if problem:
            results[bug_run] = ValueError(problem)
        else:
            by_world.setdefault(bug_run.num_processes, []).append(bug_run)
    if not by_world:
        return results

    from torch_impl.harness.bugs import run_bug_steps

    for world_size, group in sorted(by_world.items()):
        outcomes = launch_each(
            run_bug_steps,
            world_size,
            group,
            _bug_step,
            lambda _, per_rank: bug_output(per_rank),
            timeout_s=LAUNCH_TIMEOUT_S,
            collective_timeout_s=COLLECTIVE_TIMEOUT_S,
        )
        results.update(zip(group, outcomes, strict=True))
    return results
