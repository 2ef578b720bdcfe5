"""Calling a user's torch step for ``crosscheck verify``: one process group per world size.

`run` lays each `VerifyJob` out from its built-in fixture, launches
``torch_impl.harness.user_step.run_user_steps`` for each world size (the jobs of that size run
in that launch, one after the other on every rank) and turns what the ranks left in a status
directory into a `VerifyOutput` (rank 0's gradient, once every rank is known to hold the same
one) or a `StepError` naming the job, the rank and the cause
(`crosscheck.verification.torch_verify_outcomes`). torch is imported only when something is
launched, so crosscheck itself does not need it.

Time: `timeout_s` bounds the whole run of the step, all jobs of every world size together.

* The step has `timeout_s` seconds in all, counted from when each launch's ranks are ready
  (start-up is not the step's time), and everything, start-ups included, must be over by the
  run's deadline, ``timeout_s + STARTUP_GRACE_S`` after `run` began. At the deadline (or when
  the step's time is used up) every rank's watchdog dumps where the step was and ends the rank;
  that job is reported as a timeout with the user's frames, every later job (of every world
  size) as not run.
* `run` therefore returns within ``timeout_s + GRACE_S`` seconds, GRACE_S = 21 s being the
  start-up allowance (`STARTUP_GRACE_S`, 15 s), `DETECT_S` (2 s) for the launcher to see the
  watchdogs fire, and `CLEANUP_S` (4 s) to stop every process the launch started (SIGTERM,
  SIGKILL after `STOP_GRACE_S`), with nothing left running. Measured on two shared
  cores, in a fresh process: a step that hangs in its first job returns after 12.2 s under
  ``--timeout 10`` and 22.1 s under ``--timeout 20`` (2.1 s of it the zygote's first
  import of torch, which a slow start-up may stretch to STARTUP_GRACE_S).
* A job that fails on any rank ends that launch: a rank left waiting in a collective by a peer
  that raised is stopped by its watcher half a second after the peer's error (not at the
  collective timeout), the job is reported with the raising rank's error, and a fresh process
  group runs the jobs that remain (forking ranks from the warm zygote takes a fraction of
  a second). A rank that dies (a signal, ``os._exit``) fails its job the same way.
* A rank alone in a collective that no peer joins (its peers finished) fails at the process
  group's collective timeout: half of `timeout_s`, at least 5 s, at most 30 s, never above
  `timeout_s`.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from crosscheck.contract.row_fields import ROW_FIELD_KEYS
from crosscheck.fixtures.builtin import builtin_fixture
from crosscheck.launch.workers import launch_arrays, layout_problem
from crosscheck.verification import torch_verify_outcomes as rank_outcomes
from crosscheck.verification.objective_verify import objective_arrays
from crosscheck.verification.protocol import StepError, VerifyJob, VerifyOutput

if TYPE_CHECKING:  # torch is imported only when something is launched
    from torch_impl.harness.user_step import UserStepJob

#: Start-up allowance inside the run's deadline: the zygote's first import of torch
#: (about 2 s on two idle cores; 11 s was seen on two cores shared with other test runs) and,
#: per launch, forking R ranks, joining the group and DDP's warm-up (a fraction of a second
#: each). Start-up within it does not eat into the step's `timeout_s`; it only widens the worst
#: case, the usual run ends when the step's time is up.
STARTUP_GRACE_S = 15.0
#: After the deadline, how long the launcher waits for the ranks' watchdogs to end them (they
#: fire at the deadline, and the launcher polls every 0.05 s) before it gives up on its own.
DETECT_S = 2.0
#: The launcher's stop: SIGTERM to every process group, SIGKILL after this.
STOP_GRACE_S = 2.0
#: Stopping every process the launch started: STOP_GRACE_S, then up to 2 s for SIGKILL to land.
CLEANUP_S = STOP_GRACE_S + 2.0
#: `run` returns within ``timeout_s + GRACE_S`` seconds, whatever the step does.
GRACE_S = STARTUP_GRACE_S + DETECT_S + CLEANUP_S
#: A collective waits at most this long (and never longer than the run's time limit).
MAX_COLLECTIVE_TIMEOUT_S = 30.0
#: The collective timeout's floor (when the time limit allows it): joining the group at
#: start-up waits this long for the slowest rank to import torch.
MIN_COLLECTIVE_TIMEOUT_S = 5.0


def collective_timeout(timeout_s: float) -> float:
    """The process group's timeout for a run limit of `timeout_s`: never above it."""
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
    return layout_problem(job.fixture, job.world_size, job.accum_steps, job.layout)


def _user_job(job: VerifyJob) -> UserStepJob:
    from torch_impl.harness.user_step import UserStepJob

    batch, params = launch_arrays(job.fixture)
    if job.row_fields:  # every v2 field, its default where the fixture gives none
        fixture = builtin_fixture(job.fixture)
        batch = {**batch, **{key: np.asarray(getattr(fixture, key)) for key in ROW_FIELD_KEYS}}
    if job.objective_params:  # the multi-term family's params and, for mtp, y'
        params, extra = objective_arrays(job.fixture, job.objective_params)
        batch = {**batch, **extra}
    return UserStepJob(
        label=job.describe(),
        batch=batch,
        params=params,
        accum_steps=job.accum_steps,
        dtype=job.dtype,
        objective=bool(job.objective_params),
        context_size=job.context_size,
        context_order=job.context_order,
    )


@dataclass(slots=True)
class _RunClock:
    """The time limits of one `run`: the step's time left, and the deadline for everything."""

    timeout_s: float
    #: ``time.monotonic()`` by which every rank of every launch must be done.
    hard_deadline: float
    #: Step time not yet used (each launch uses it from when its ranks are ready).
    budget_s: float

    @classmethod
    def start(cls, timeout_s: float, startup_spent_s: float = 0.0) -> _RunClock:
        """The clock of a run starting now, whose ranks' start-up already took
        `startup_spent_s` of STARTUP_GRACE_S (`torch_impl.harness.launcher.preloading`)."""
        allowance = max(0.0, STARTUP_GRACE_S - startup_spent_s)
        return cls(timeout_s, time.monotonic() + timeout_s + allowance, timeout_s)

    def limit(self) -> str:
        return f"{self.timeout_s:g} s (the time limit of the whole run, --timeout)"


def _launch_once(
    step: str,
    world_size: int,
    jobs: list[VerifyJob],
    clock: _RunClock,
    device: str = "cpu",
    model: str = "",
) -> tuple[dict[VerifyJob, VerifyOutput | StepError], str]:
    """One launch for a prefix of `jobs`: the results of the jobs it got through, and the
    reason the run stops ('' when the remaining jobs may run in a fresh launch)."""
    from torch_impl.harness.launcher import launch
    from torch_impl.harness.user_step import UserStepConfig, import_error_path, run_user_steps

    collective_s = collective_timeout(clock.timeout_s)
    status_dir = tempfile.mkdtemp(prefix="gradweight-verify-")
    try:
        config = UserStepConfig(
            step=step,
            cwd=os.getcwd(),
            status_dir=status_dir,
            hard_deadline=clock.hard_deadline,
            budget_s=clock.budget_s,
            collective_timeout_s=collective_s,
            model=model,
        )
        launch_error: Exception | None = None
        try:
            launch(
                run_user_steps,
                world_size,
                (config, [_user_job(job) for job in jobs]),
                timeout_s=clock.hard_deadline + DETECT_S - time.monotonic(),
                collective_timeout_s=collective_s,
                stop_grace_s=STOP_GRACE_S,
                device=device,  # crosscheck.launch.devices: "cpu" (gloo) or "cuda" (NCCL)
            )
        except Exception as error:  # read below: what finished before it still counts
            launch_error = error
        ready = rank_outcomes.read_ready(status_dir)
        if ready is not None:
            clock.budget_s -= max(0.0, time.monotonic() - ready)
        # The import fails alike on every rank, before any job: rank 0's reason stands.
        if os.path.exists(import_error_path(status_dir, 0)):
            with open(import_error_path(status_dir, 0)) as f:
                reason = f.read()
            return {job: StepError(f"{job.describe()}: {reason}") for job in jobs}, ""
        results: dict[VerifyJob, VerifyOutput | StepError] = {}
        for index, job in enumerate(jobs):
            outcomes = rank_outcomes.read_outcomes(status_dir, index, world_size)
            if outcomes is None:
                results[job], why, stop = rank_outcomes.unfinished(
                    job, index, status_dir, world_size, clock.limit(), launch_error
                )
                return results, why if stop else ""
            results[job] = rank_outcomes.judge(job, outcomes, collective_s)
            if any(o.error for o in outcomes):
                return results, ""  # the ranks stopped after it: the rest run afresh
        return results, ""
    finally:
        shutil.rmtree(status_dir, ignore_errors=True)


def _run_world(
    step: str,
    world_size: int,
    jobs: list[VerifyJob],
    clock: _RunClock,
    device: str = "cpu",
    model: str = "",
) -> tuple[dict[VerifyJob, VerifyOutput | StepError], str]:
    """Every job of one world size, relaunching after a failed one; and why the run stopped."""
    results: dict[VerifyJob, VerifyOutput | StepError] = {}
    while len(results) < len(jobs):
        pending = jobs[len(results) :]
        if clock.budget_s <= 0 or clock.hard_deadline <= time.monotonic():
            stopped = f"the time limit of {clock.limit()} was used up"
            results.update(
                {job: StepError(f"{job.describe()}: not run: {stopped}") for job in pending}
            )
            return results, stopped
        done, why = _launch_once(step, world_size, pending, clock, device, model)
        results.update(done)
        if why:
            last = pending[len(done) - 1].describe()
            stopped = f"the torch run ended at {last} ({why.splitlines()[0]})"
            for job in pending[len(done) :]:
                results[job] = StepError(f"{job.describe()}: not run: {stopped}")
            return results, stopped
    return results, ""


def run(
    step: str,
    jobs: list[VerifyJob],
    *,
    timeout_s: float = 120.0,
    device: str = "cpu",
    model: str = "",
    startup_spent_s: float = 0.0,
) -> dict[VerifyJob, VerifyOutput | StepError]:
    """Every job's synchronized gradient under the user's step, or the StepError it met.

    `step` is ``MODULE:FUNCTION``, imported on every rank with the current directory first on
    ``sys.path``. Jobs that cannot be laid out (unknown fixture, a layout that does not divide
    its rows) get a StepError without a launch; the rest run in one launch per world size (and
    a fresh one after a job that failed). `timeout_s` is the step's time for all the jobs
    together; `run` returns within ``timeout_s + GRACE_S`` seconds (see the module docstring).
    `device` is ``"cpu"`` (gloo) or ``"cuda"`` (one GPU per rank, NCCL), resolved by the
    caller (`crosscheck.launch.devices.resolve_torch_device`). `model` is ``MODULE:FACTORY``
    of the user's own model (``verify --model``), or "" for the analytic one.
    `startup_spent_s`: how much of the start-up allowance (STARTUP_GRACE_S) the caller already
    used starting the ranks' zygote (`torch_impl.harness.launcher.preloading`), so that the
    bound holds from its start.
    """
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    clock = _RunClock.start(timeout_s, startup_spent_s)
    results: dict[VerifyJob, VerifyOutput | StepError] = {}
    by_world: dict[int, list[VerifyJob]] = {}
    spec_problem = _spec_problem(step)
    for job in dict.fromkeys(jobs):  # each distinct job once, in order
        problem = spec_problem or _job_problem(job)
        if problem:
            results[job] = StepError(f"{job.describe()}: {problem}")
        else:
            by_world.setdefault(job.processes, []).append(job)
    stopped = ""
    for world_size, group in sorted(by_world.items()):
        if stopped:  # the time is up: nothing more starts
            results.update(
                {job: StepError(f"{job.describe()}: not run: {stopped}") for job in group}
            )
            continue
        done, stopped = _run_world(step, world_size, group, clock, device, model)
        results.update(done)
    return results
