"""Calling a user's torch step for ``crosscheck verify``: one process group per world size.

`run` lays each `VerifyJob` out from its built-in fixture, launches
``torch_impl.user_step.run_user_steps`` once per world size (every job of that size runs in
that launch, one after the other on every rank) and turns what the ranks left in a status
directory into a `VerifyOutput` (rank 0's gradient, once every rank is known to hold the same
one) or a `StepError` naming the job, the rank and the cause. torch is imported only when
something is launched, so crosscheck itself does not need it.

Time is bounded three ways, so no call waits for ever:

* every job has `timeout_s` on every rank: a watchdog in the rank dumps its stack and ends it
  (the launcher sees the exit and stops the launch; later jobs of that launch are reported as
  not run, with the reason);
* the process group's collective timeout is half of `timeout_s` (at least 5 s, at most 30 s,
  never above `timeout_s`), so a rank left alone in a collective (its peer raised, or never
  joins) fails before its watchdog fires (for `timeout_s` >= 10 s); after a job that failed
  on any rank every rank builds a fresh process group, and the launch goes on with the next;
* the launch itself has a time limit covering start-up and every job's `timeout_s`.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from crosscheck.catalogue import builtin_fixture
from crosscheck.fixtures import BATCH_KEYS
from crosscheck.protocol import StepError, VerifyJob, VerifyOutput

if TYPE_CHECKING:  # torch is imported only when something is launched
    from torch_impl.user_step import RankOutcome, UserStepJob

#: Spawning R processes, importing torch and joining the group, on two shared cores.
STARTUP_S = 60.0
#: A collective waits at most this long (and never longer than a job's time limit).
MAX_COLLECTIVE_TIMEOUT_S = 30.0
#: The collective timeout's floor (when the job's limit allows it): joining the group at
#: start-up waits this long for the slowest rank to import torch.
MIN_COLLECTIVE_TIMEOUT_S = 5.0
#: Past a job's time limit, how long a rank waits for its peers' outcomes (a hung peer has
#: been ended by its watchdog by then).
EXCHANGE_GRACE_S = 15.0
#: Error kinds of torch_impl.user_step, most telling first.
_CAUSE_ORDER = ("raised", "result", "timeout", "peer")
_SHORT = 240


def collective_timeout(timeout_s: float) -> float:
    """The process group's timeout for a job limit of `timeout_s`: never above it."""
    return min(timeout_s, MAX_COLLECTIVE_TIMEOUT_S, max(timeout_s / 2, MIN_COLLECTIVE_TIMEOUT_S))


def _spec_problem(step: str) -> str:
    module, sep, function = step.partition(":")
    names_ok = all(part.isidentifier() for part in module.split(".")) and function.isidentifier()
    if not sep or not names_ok:
        return f"the step must be named MODULE:FUNCTION (e.g. my_train:step), got {step!r}"
    return ""


def _job_problem(job: VerifyJob) -> str:
    """Why this job cannot be laid out, or ''."""
    if job.world_size < 1 or job.accum_steps < 1:
        return "world_size and accum_steps must be >= 1"
    if job.dtype not in ("float64", "float32", "bfloat16"):
        return f"dtype must be float64, float32 or bfloat16, got {job.dtype!r}"
    try:
        num_rows = builtin_fixture(job.fixture).num_rows
    except ValueError as error:  # an unknown fixture: the message lists the known ones
        return str(error)
    if num_rows % (job.world_size * job.accum_steps):
        return (
            f"the {num_rows} rows of fixture {job.fixture!r} cannot be laid out over "
            f"world_size={job.world_size} x accum_steps={job.accum_steps}"
        )
    return ""


def _user_job(job: VerifyJob) -> UserStepJob:
    from torch_impl.user_step import UserStepJob

    fixture = builtin_fixture(job.fixture)
    return UserStepJob(
        label=job.describe(),
        # The fixture's own read-only arrays: pickle sends an array shared by jobs once.
        batch={key: np.asarray(getattr(fixture, key)) for key in BATCH_KEYS},
        params={"embed": np.asarray(fixture.embed), "unembed": np.asarray(fixture.unembed)},
        accum_steps=job.accum_steps,
        dtype=job.dtype,
    )


def _short(text: str) -> str:
    """The line that names the exception in a traceback (or a message's first line), cut."""
    lines = [line for line in str(text).strip().splitlines() if line.strip()]
    # In a traceback the exception's own line is the first unindented one after the frames.
    frames = [i for i, line in enumerate(lines) if line.startswith(" ")]
    after = [line for line in lines[frames[-1] + 1 :] if not line.startswith(" ")] if frames else []
    line = (after or lines or [str(text)])[0].strip()
    return line if len(line) <= _SHORT else line[: _SHORT - 3] + "..."


def ranks_disagree(per_rank: Sequence[dict[str, np.ndarray]]) -> str:
    """Where the first rank whose gradient differs from rank 0's does, or ''.

    One all-reduce (or all-gather) leaves the same bytes on every rank, so a synchronized
    gradient is bit-identical across ranks; anything else means the step did not synchronize.
    """
    first = per_rank[0]
    for rank, grads in enumerate(per_rank[1:], start=1):
        for name, expected in first.items():
            actual = grads[name]
            differ = ~((actual == expected) | (np.isnan(actual) & np.isnan(expected)))
            if differ.any():
                index = tuple(int(i) for i in np.argwhere(differ)[0])
                return (
                    f"rank {rank} holds a different {name} gradient than rank 0 at "
                    f"{list(index)}: {float(actual[index])!r} vs {float(expected[index])!r} "
                    f"({int(differ.sum())} of {differ.size} elements differ): the step's "
                    "gradient is not synchronized across ranks"
                )
    return ""


def _describe_failure(outcomes: Sequence[RankOutcome], collective_s: float) -> str:
    """The root cause first (what a rank raised), then what it did to the other ranks."""
    failed = sorted(
        (o for o in outcomes if o.error),
        key=lambda o: (_CAUSE_ORDER.index(o.kind) if o.kind in _CAUSE_ORDER else 0, o.rank),
    )
    root = failed[0]
    # Ranks that failed exactly alike are named together, the others after the cause.
    alike = [o.rank for o in failed if (o.error, o.kind) == (root.error, root.kind)]
    rest = [o for o in failed if o.rank not in alike]
    ranks = f"rank {alike[0]}" if len(alike) == 1 else f"ranks {', '.join(map(str, alike))}"
    if root.kind == "timeout":
        head = (
            f"{ranks}: a collective did not finish within {collective_s:g} s (the "
            "collective timeout): the other ranks never joined it, or left it"
        )
        text = f"{head}; {root.error}"
    elif root.kind == "peer":
        text = f"{ranks}: a collective failed because a peer rank went away: {root.error}"
    else:
        text = f"{ranks}: {root.error}"
    for other in rest:
        if other.kind in ("timeout", "peer"):
            text += f"\n(rank {other.rank} then failed in a collective: {_short(other.error)})"
        else:
            text += f"\n(rank {other.rank} failed too: {_short(other.error)})"
    return text


def _judge(
    job: VerifyJob, outcomes: Sequence[RankOutcome], collective_s: float
) -> VerifyOutput | StepError:
    if any(o.error for o in outcomes):
        return StepError(f"{job.describe()}: {_describe_failure(outcomes, collective_s)}")
    per_rank = [o.grads for o in outcomes if o.grads is not None]
    disagreement = ranks_disagree(per_rank)
    if disagreement:
        return StepError(f"{job.describe()}: {disagreement}")
    return VerifyOutput(grads=per_rank[0], logged_denominator=outcomes[0].logged_denominator)


def _unfinished(
    job: VerifyJob,
    index: int,
    status_dir: str,
    world_size: int,
    timeout_s: float,
    error: Exception | None,
) -> tuple[StepError, str]:
    """The error of the job that was running when the launch ended, and why it ended."""
    from torch_impl.launcher import LaunchTimeoutError, RankFailedError
    from torch_impl.user_step import describe_watchdog_dump, outcome_path, watchdog_path

    hung = {}
    for rank in range(world_size):
        path = watchdog_path(status_dir, index, rank)
        if os.path.exists(path) and os.path.getsize(path):
            with open(path) as f:
                hung[rank] = describe_watchdog_dump(f.read())
    if hung:
        ranks = ", ".join(map(str, hung))
        where = "\n".join(f"rank {rank} was at:\n{frames}" for rank, frames in hung.items())
        why = f"the step did not finish within {timeout_s:g} s on rank(s) {ranks}"
        return StepError(f"{job.describe()}: {why}\n{where}"), why
    if isinstance(error, LaunchTimeoutError):
        why = f"the step did not finish within {timeout_s:g} s ({error})"
        return StepError(f"{job.describe()}: {why}"), why
    reported = [r for r in range(world_size) if os.path.exists(outcome_path(status_dir, index, r))]
    if isinstance(error, RankFailedError) and error.rank not in reported:
        why = f"rank {error.rank} ended while running the step: {_short(error.details)}"
    else:
        why = f"the torch launch failed: {_short(str(error))}"
    return StepError(f"{job.describe()}: {why}"), why


def _read_outcomes(status_dir: str, index: int, world_size: int) -> list[RankOutcome] | None:
    import pickle

    from torch_impl.user_step import outcome_path

    outcomes = []
    for rank in range(world_size):
        path = outcome_path(status_dir, index, rank)
        if not os.path.exists(path):
            return None
        with open(path, "rb") as f:
            outcomes.append(pickle.load(f))
    return outcomes


def _run_world(
    step: str, world_size: int, jobs: list[VerifyJob], timeout_s: float
) -> dict[VerifyJob, VerifyOutput | StepError]:
    from torch_impl.launcher import launch
    from torch_impl.user_step import UserStepConfig, import_error_path, run_user_steps

    collective_s = collective_timeout(timeout_s)
    status_dir = tempfile.mkdtemp(prefix="gradweight-verify-")
    try:
        config = UserStepConfig(
            step=step,
            cwd=os.getcwd(),
            status_dir=status_dir,
            timeout_s=timeout_s,
            collective_timeout_s=collective_s,
            exchange_grace_s=EXCHANGE_GRACE_S,
        )
        launch_error: Exception | None = None
        try:
            launch(
                run_user_steps,
                world_size,
                (config, [_user_job(job) for job in jobs]),
                timeout_s=STARTUP_S + len(jobs) * (timeout_s + EXCHANGE_GRACE_S),
                collective_timeout_s=collective_s,
            )
        except Exception as error:  # read below: what finished before it still counts
            launch_error = error
        # The import fails alike on every rank, before any job: rank 0's reason stands.
        if os.path.exists(import_error_path(status_dir, 0)):
            with open(import_error_path(status_dir, 0)) as f:
                reason = f.read()
            return {job: StepError(f"{job.describe()}: {reason}") for job in jobs}
        results: dict[VerifyJob, VerifyOutput | StepError] = {}
        stopped = ""
        for index, job in enumerate(jobs):
            outcomes = None if stopped else _read_outcomes(status_dir, index, world_size)
            if stopped:
                results[job] = StepError(f"{job.describe()}: not run: {stopped}")
            elif outcomes is not None:
                results[job] = _judge(job, outcomes, collective_s)
            else:
                results[job], why = _unfinished(
                    job, index, status_dir, world_size, timeout_s, launch_error
                )
                stopped = f"the torch launch for world size {world_size} ended at {job.describe()}"
                stopped += f" ({why.splitlines()[0]})"
        return results
    finally:
        shutil.rmtree(status_dir, ignore_errors=True)


def run(
    step: str, jobs: list[VerifyJob], *, timeout_s: float = 120.0
) -> dict[VerifyJob, VerifyOutput | StepError]:
    """Every job's synchronized gradient under the user's step, or the StepError it met.

    `step` is ``MODULE:FUNCTION``, imported on every rank with the current directory first on
    ``sys.path``. Jobs that cannot be laid out (unknown fixture, a layout that does not divide
    its rows) get a StepError without a launch; the rest run in one launch per world size.
    Each job has `timeout_s` seconds on every rank (see the module docstring for the bounds).
    """
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    results: dict[VerifyJob, VerifyOutput | StepError] = {}
    by_world: dict[int, list[VerifyJob]] = {}
    spec_problem = _spec_problem(step)
    for job in dict.fromkeys(jobs):  # each distinct job once, in order
        problem = spec_problem or _job_problem(job)
        if problem:
            results[job] = StepError(f"{job.describe()}: {problem}")
        else:
            by_world.setdefault(job.world_size, []).append(job)
    for world_size, group in sorted(by_world.items()):
        results.update(_run_world(step, world_size, group, timeout_s))
    return results
