"""The harness's job scheduler: costliest first, within a process budget, nothing lost."""

import threading
import time

import pytest

from crosscheck.launch.processes import usable_cores
from crosscheck.launch.schedule import Job, default_capacity, run_jobs


class Recorder:
    """Jobs that note which jobs were running when each started."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running: dict[str, int] = {}
        self.starts: list[tuple[str, dict[str, int]]] = []

    def job(self, name: str, processes: int, cost: float, seconds: float = 0.05) -> Job:
        def run() -> None:
            with self.lock:
                self.starts.append((name, dict(self.running)))
                self.running[name] = processes
            time.sleep(seconds)
            with self.lock:
                del self.running[name]

        return Job(name, processes, cost, run)


def test_costliest_jobs_start_first():
    recorder = Recorder()
    jobs = [recorder.job(name, 1, cost) for name, cost in (("b", 2.0), ("c", 1.0), ("a", 3.0))]
    timings = run_jobs(jobs, capacity=1)
    assert [name for name, _ in recorder.starts] == ["a", "b", "c"]
    assert [t.name for t in timings] == ["a", "b", "c"]
    assert all(t.end >= t.start >= 0 for t in timings)


def test_running_processes_stay_within_the_capacity():
    recorder = Recorder()
    jobs = [recorder.job(f"j{i}", width, 10.0 - i) for i, width in enumerate([2, 2, 1, 1, 3, 1])]
    run_jobs(jobs, capacity=3)
    for name, running in recorder.starts:
        width = next(job.processes for job in jobs if job.name == name)
        assert sum(running.values()) + width <= 3, (name, running)
    assert len(recorder.starts) == len(jobs)


def test_a_job_wider_than_the_capacity_runs_alone():
    recorder = Recorder()
    jobs = [recorder.job("wide", 8, 5.0), recorder.job("one", 1, 1.0), recorder.job("two", 1, 1.0)]
    run_jobs(jobs, capacity=3)
    assert dict(recorder.starts)["wide"] == {}
    assert {name for name, _ in recorder.starts} == {"wide", "one", "two"}


def test_a_failing_job_is_raised_after_the_others_finished():
    recorder = Recorder()

    def fail() -> None:
        raise RuntimeError("broken job")

    jobs = [Job("fails", 1, 9.0, fail), recorder.job("slow", 1, 1.0, seconds=0.3)]
    with pytest.raises(RuntimeError, match="broken job"):
        run_jobs(jobs, capacity=2)
    assert [name for name, _ in recorder.starts] == ["slow"]
    assert recorder.running == {}  # it ran to the end before run_jobs raised


def test_capacity_must_be_positive_and_defaults_to_the_cores():
    with pytest.raises(ValueError, match="capacity"):
        run_jobs([], capacity=0)
    assert default_capacity() == len(usable_cores()) + 1  # 3 on the 2-core CI machine
