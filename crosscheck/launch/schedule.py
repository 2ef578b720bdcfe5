"""Run the harness's jobs side by side on a few cores, costliest first, within a process budget.

Every piece of work of a run is a `Job`: one worker process or one process group (a JAX worker
for one front-end and world size, a torch launch at one world size, a multi-process JAX
launch, a resume round trip) that keeps `processes` processes busy for about `cost` seconds of
CPU. Its thread in this process only waits for the children and judges what they return, so
the constraint is cores, not threads.

`run_jobs` starts jobs in order of decreasing cost (longest-processing-time-first: a long job
started last would leave a core idle at the end), skipping over any that would take the
running processes past `capacity`, and a job wider than the capacity runs once nothing else
does. Width matters beyond CPU share: the ranks of a process group wait for each other at
every collective, so two 4-rank groups sharing 2 cores stall each other at every step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from crosscheck.launch.processes import usable_cores


@dataclass(frozen=True)
class Job:
    """A unit of harness work: `run()` does it and reports its own results."""

    name: str
    processes: int
    cost: float  # rough seconds on one core, only to order the jobs
    run: Callable[[], None]


@dataclass(frozen=True)
class JobTiming:
    """When a job ran, in seconds since `run_jobs` began."""

    name: str
    processes: int
    start: float
    end: float


def default_capacity() -> int:
    """Processes to run at once: one per core this process may use, plus one.

    Workers spend part of their time waiting (process start, collectives, file I/O), so one
    process more than the cores keeps them busy; each process beyond that only takes turns on
    a core, and the turns cost CPU: caches refilled after every switch, a rank's gloo loop
    spinning while the peer it waits for has no core. Measured on 2 cores (the default matrix,
    farm-bench, 3 runs of each in turn): 3 processes used 0.925 of the CPU of 5 (128.7 s
    against 139.1 s) for 1.02 of the wall (76.1 s against 74.6 s); 4 used 1.045 of the CPU of
    3 for 0.98 of its wall. A group wider than this runs alone (`run_jobs`).
    """
    return len(usable_cores()) + 1


def run_jobs(jobs: Sequence[Job], capacity: int | None = None) -> list[JobTiming]:
    """Run every job and say when each ran; re-raise the first exception a job raised, after
    all have ended.

    Jobs report their own results and failures (a runner fails its cases by name); an
    exception here is a bug in a job's own code, which must not go unnoticed.
    """
    capacity = default_capacity() if capacity is None else capacity
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    pending = sorted(jobs, key=lambda job: -job.cost)
    changed = threading.Condition()
    in_use = 0
    errors: list[BaseException] = []
    threads: list[threading.Thread] = []
    timings: list[JobTiming] = []
    began = time.monotonic()

    def run_one(job: Job, width: int) -> None:
        nonlocal in_use
        start = time.monotonic() - began
        try:
            job.run()
        except BaseException as error:  # re-raised by run_jobs below
            errors.append(error)
        finally:
            with changed:
                in_use -= width
                timings.append(JobTiming(job.name, job.processes, start, time.monotonic() - began))
                changed.notify()

    with changed:
        while pending:
            free = capacity - in_use
            job = next((j for j in pending if min(j.processes, capacity) <= free), None)
            if job is None:
                changed.wait()
                continue
            pending.remove(job)
            width = min(job.processes, capacity)
            in_use += width
            thread = threading.Thread(target=run_one, args=(job, width), name=job.name)
            threads.append(thread)
            thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return sorted(timings, key=lambda timing: timing.start)
