"""What the ranks of a torch verify launch left, judged and put into words.

`crosscheck.verification.torch_verify` launches ``torch_impl.harness.user_step.run_user_steps``
with a status directory; every rank writes there its outcome of each job (its gradient, or the
error it met: raised, a bad result, a collective timeout, a peer gone, stopped by its
watchdog), and its watchdog's dump when the step hung. Here those files become a job's result:

- `judge`: a job every rank reported: rank 0's gradient once every rank is known to hold the
  same one (`ranks_disagree`), or a StepError that names the root cause first (what a rank
  raised), then what it did to the other ranks;
- `unfinished`: the job that was running when the launch ended: a timeout with the user's
  frames, a rank that died, a stopped launch, and whether the run stops there;
- `read_outcomes`, `read_ready`: the files themselves.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from crosscheck.diagnosis.verdict import level_of_dtypes
from crosscheck.launch.processes import describe_status
from crosscheck.verification.protocol import StepError, VerifyJob, VerifyOutput

if TYPE_CHECKING:  # torch is imported only when something is launched
    from torch_impl.harness.user_step import RankOutcome

#: Error kinds of torch_impl.harness.user_step, most telling first.
_CAUSE_ORDER = ("raised", "result", "timeout", "peer", "stopped")
_SHORT = 240


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
        if other.kind == "stopped":  # with where the step was: it may be why the others failed
            text += f"\n(rank {other.rank} {other.error})"
        elif other.kind in ("timeout", "peer"):
            text += f"\n(rank {other.rank} then failed in a collective: {_short(other.error)})"
        else:
            text += f"\n(rank {other.rank} failed too: {_short(other.error)})"
    return text


def judge(
    job: VerifyJob, outcomes: Sequence[RankOutcome], collective_s: float
) -> VerifyOutput | StepError:
    """A job every rank reported: its synchronized gradient, or the StepError that says why
    there is none (`collective_s`: the collective timeout the ranks ran under)."""
    if any(o.error for o in outcomes):
        return StepError(f"{job.describe()}: {_describe_failure(outcomes, collective_s)}")
    per_rank = [o.grads for o in outcomes if o.grads is not None]
    disagreement = ranks_disagree(per_rank)
    if disagreement:
        return StepError(f"{job.describe()}: {disagreement}")
    return VerifyOutput(
        grads=per_rank[0],
        logged_denominator=outcomes[0].logged_denominator,
        returned_dtype=level_of_dtypes(name for o in outcomes for name in o.gradient_dtypes),
    )


def _job_started(status_dir: str, index: int, world_size: int) -> bool:
    from torch_impl.harness.user_step import watchdog_path

    return any(os.path.exists(watchdog_path(status_dir, index, r)) for r in range(world_size))


def unfinished(
    job: VerifyJob,
    index: int,
    status_dir: str,
    world_size: int,
    limit: str,
    error: Exception | None,
) -> tuple[StepError, str, bool]:
    """The error of the job that was running when the launch ended, why, and whether the run
    stops there (the time is up, or the launch broke before the job started). `limit` is the
    run's time limit in words; `error`, the launch's (None: the ranks returned before it)."""
    from torch_impl.harness.launcher import (
        LaunchStoppedError,
        LaunchTimeoutError,
        RankFailedError,
    )
    from torch_impl.harness.user_step import outcome_path, read_watchdog

    reported = [r for r in range(world_size) if os.path.exists(outcome_path(status_dir, index, r))]
    # A rank that reported finished its step: its watchdog fired while it waited for the others.
    hung = {
        rank: dump
        for rank in range(world_size)
        if rank not in reported and (dump := read_watchdog(status_dir, index, rank)) is not None
    }
    if hung:
        ranks = ", ".join(map(str, hung))
        ran_s = max(dump.deadline - dump.started for dump in hung.values())
        why = f"the step did not finish within {limit}"
        where = "\n".join(f"rank {rank} was at:\n{dump.frames}" for rank, dump in hung.items())
        head = f"{why}: still running on rank(s) {ranks} after {ran_s:.1f} s in this case"
        return StepError(f"{job.describe()}: {head}\n{where}"), why, True
    if isinstance(error, LaunchTimeoutError):
        why = f"the step did not finish within {limit} ({error})"
        return StepError(f"{job.describe()}: {why}"), why, True
    if isinstance(error, LaunchStoppedError):  # interrupted: nothing more may start
        why = f"the torch launch was stopped ({error})"
        return StepError(f"{job.describe()}: {why}"), why, True
    if error is None:  # the ranks returned before it: no time left to start it
        why = f"the time limit of {limit} was used up"
        return StepError(f"{job.describe()}: not run: {why}"), why, True
    started = _job_started(status_dir, index, world_size)
    if isinstance(error, RankFailedError) and error.rank not in reported:
        if error.exitcode is not None:
            cause = f"process {describe_status(error.exitcode)} without reporting a result"
        else:
            cause = _short(error.details)
        doing = "running the step" if started else "starting"
        why = f"rank {error.rank} ended while {doing}: {cause}"
    else:
        why = f"the torch launch failed: {_short(str(error))}"
    # A crash inside the job is the job's; the jobs after it get fresh processes.
    return StepError(f"{job.describe()}: {why}"), why, not started


def read_outcomes(status_dir: str, index: int, world_size: int) -> list[RankOutcome] | None:
    """Every rank's outcome of job `index`, in rank order; None unless every rank reported."""
    import pickle

    from torch_impl.harness.user_step import outcome_path

    outcomes = []
    for rank in range(world_size):
        path = outcome_path(status_dir, index, rank)
        if not os.path.exists(path):
            return None
        with open(path, "rb") as f:
            outcomes.append(pickle.load(f))
    return outcomes


def read_ready(status_dir: str) -> float | None:
    """When the launch's ranks were ready (``time.monotonic()``), or None if they never were."""
    from torch_impl.harness.user_step import ready_path

    try:
        with open(ready_path(status_dir)) as f:
            return float(f.read())
    except (OSError, ValueError):
        return None
