"""Calling a user's JAX step without importing JAX here.

The step follows the protocol of `crosscheck.verification.protocol`.

x64 and the fake-device count are process-global in JAX, and the user's code may hang or kill
its process, so the step runs in a worker process (`crosscheck.verification.jax_verify_worker`)
with eight CPU devices, started in the caller's working directory and waited for by
`crosscheck.launch.worker_processes.run_workers` with a bounded wait. JAX start-up and the step's
compiles dominate: each worker pays the start-up once and serves its share of the jobs, one
worker per core (`_shares`), so the compiles of different layouts run side by side.

Time limit: `timeout_s` bounds the whole run (the worker's start-up, the import of the step and
every job), not each job. A run ends at most `TIMEOUT_GRACE_S` after `timeout_s`: at the limit
the worker's process group is killed (with whatever the step started: no process of the run
outlives it) and this process reads what the worker left. The worker reports each job as it
finishes, so the jobs before a hang keep their results; the job it was running is reported as
timed out, every later one as not run, and every StepError says what happened and, where
known, which job the worker was on.
"""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
from pathlib import Path

from crosscheck.fixtures.builtin import builtin_fixture
from crosscheck.launch.processes import usable_cores
from crosscheck.launch.worker_processes import run_workers
from crosscheck.launch.workers import jax_worker_env, worker_zygote
from crosscheck.verification.protocol import StepError, VerifyJob, VerifyOutput

WORKER_MODULE = "crosscheck.verification.jax_verify_worker"
DEFAULT_TIMEOUT_S = 120.0
#: How long a JAX verify run may take past its `timeout_s`: noticing the deadline (50 ms
#: polls), killing the worker's process group and waiting until it is gone (SIGKILL lands in
#: milliseconds; the wait is cut at `KILL_WAIT_S`), reading the progress folder and removing
#: the temporary files. Measured on two shared cores with a hung step and a 10 s limit: this
#: function returned after 10.03 s, the whole ``crosscheck verify --timeout 10`` after 10.5 s.
TIMEOUT_GRACE_S = 5.0
#: The part of the grace that may go to waiting for the killed processes to be gone.
KILL_WAIT_S = 3.0
#: Workers a run may start on the CPU (one per core, up to this), and the fewest distinct
#: batch shapes each gets (a worker's JAX start-up costs about as much as two compiles).
MAX_WORKERS = 4
MIN_SHAPES_PER_WORKER = 3

Outcome = VerifyOutput | StepError


def _check_spec(step: str) -> str | None:
    """Why `step` is not of the form MODULE:FUNCTION, or None when it is."""
    module, sep, function = step.partition(":")
    if not sep or not module.strip() or not function.strip():
        return f"step {step!r} is not of the form MODULE:FUNCTION (e.g. mytrain.step:train_step)"
    return None


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def _current(progress: Path, jobs: list[VerifyJob]) -> str | None:
    """What the worker was doing when it stopped, in words (None if it never said)."""
    marker = (_read(progress / "current") or b"").decode(errors="replace").strip()
    if marker == "import":
        return "importing the step"
    if marker.isdigit() and int(marker) < len(jobs):
        return f"running {jobs[int(marker)].describe()}"
    return None


def _unfinished(
    job: VerifyJob, step: str, doing: str | None, timed_out: bool, timeout_s: float, cause: str
) -> StepError:
    """The StepError of a job the worker did not finish: it timed out, was not run, or died."""
    this_one = doing == f"running {job.describe()}"
    if timed_out:
        head = f"step {step} did not finish within {timeout_s:g} s"
        if this_one:
            return StepError(
                f"{job.describe()}: timed out: {head}: it was still running this job when the "
                "worker was killed"
            )
        where = f"the worker was {doing}" if doing else "the worker had not started any job"
        return StepError(
            f"{job.describe()}: not run: {head}: {where} when it was killed; this job never ran"
        )
    head = f"{job.describe()}: step {step}: the JAX verify worker died"
    if this_one:
        return StepError(f"{head} while running this job:\n{cause}")
    where = f" (it was {doing})" if doing else ""
    return StepError(f"{head} before this job ran{where}:\n{cause}")


def _collect(
    step: str,
    jobs: list[VerifyJob],
    progress: Path,
    failure: Exception | None,
    timed_out: bool,
    timeout_s: float,
) -> dict[VerifyJob, Outcome]:
    """Every job's outcome from the progress folder; what is missing failed with the worker."""
    import_error = _read(progress / "import-error")
    if import_error is not None:
        message = import_error.decode(errors="replace")
        return {job: StepError(f"{job.describe()}: {message}") for job in jobs}
    doing = _current(progress, jobs)
    outcomes: dict[VerifyJob, Outcome] = {}
    for index, job in enumerate(jobs):
        data = _read(progress / f"{index}.pkl")
        if data is not None:
            status, payload = pickle.loads(data)
            outcomes[job] = VerifyOutput(*payload) if status == "ok" else StepError(payload)
        elif failure is not None:
            outcomes[job] = _unfinished(job, step, doing, timed_out, timeout_s, str(failure))
        else:  # exited cleanly without this result: a bug of the worker, said as such
            outcomes[job] = StepError(
                f"{job.describe()}: step {step}: the JAX verify worker exited without a result "
                "for this job"
            )
    return outcomes


def run(
    step: str,
    jobs: list[VerifyJob],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    platform: str | None = None,
    model: str = "",
) -> dict[VerifyJob, VerifyOutput | StepError]:
    """Call the JAX step ``MODULE:FUNCTION`` once per job; each job -> gradient or StepError.

    `step` is imported in the worker from the current working directory, as the user's shell
    would. The whole worker (JAX start-up, import, every job) is bounded by `timeout_s`: this
    returns at most `TIMEOUT_GRACE_S` later. On a hang the worker is killed with everything
    the step started, and the jobs it had finished keep their results. The dict is in the
    order of `jobs` (duplicates run once). `platform` (cpu, gpu, tpu) is the worker's JAX
    platform; None: `crosscheck.launch.devices.chosen_platform` (cpu unless a run set one).
    `model` is ``MODULE:FACTORY`` of the user's own model (``verify --model``; the step gets
    its params and apply_fn), or "".
    """
    jobs = list(dict.fromkeys(jobs))
    if not jobs:
        return {}
    bad_spec = _check_spec(step)
    if bad_spec is not None:
        return {job: StepError(f"{job.describe()}: {bad_spec}") for job in jobs}
    cwd = os.getcwd()
    env = jax_worker_env(platform)
    # The user's module (and anything it starts) must import from the caller's directory.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (cwd, env.get("PYTHONPATH", "")) if p)
    env["JAX_ENABLE_X64"] = "1"  # for a step module that reads the flag at import
    shares = _shares(jobs, platform)
    with tempfile.TemporaryDirectory(prefix="gradweight-jax-verify-") as tmp:
        work = Path(tmp)
        commands, folders = [], []
        for index, share in enumerate(shares):
            progress = work / f"progress{index}"
            progress.mkdir()
            job_file = work / f"job{index}.pkl"
            job_file.write_bytes(
                pickle.dumps(
                    {
                        "step": step,
                        "jobs": share,
                        "cwd": cwd,
                        "progress": str(progress),
                        "model": model,
                    }
                )
            )
            commands.append([sys.executable, "-m", WORKER_MODULE, str(job_file)])
            folders.append(progress)
        failure: Exception | None = None
        try:
            run_workers(
                commands,
                timeout_s=timeout_s,
                log_dir=work / "logs",
                env=env,
                cwd=cwd,
                kill_wait_s=KILL_WAIT_S,
                independent=True,
                zygote=worker_zygote(),
            )
        except Exception as error:  # LaunchError: killed at the deadline, or died on its own
            failure = error
        timed_out = bool(getattr(failure, "timed_out", False))
        failed = dict(getattr(failure, "failed", {}) or {})
        outcomes: dict[VerifyJob, Outcome] = {}
        for index, (share, progress) in enumerate(zip(shares, folders, strict=True)):
            # The workers are independent: one that died leaves the others running to their
            # end, whose jobs then all have results. Only a timeout stops every worker.
            died = index in failed
            cause = failure if timed_out or died else None
            late = timed_out and not died
            outcomes.update(_collect(step, share, progress, cause, late, timeout_s))
        return {job: outcomes[job] for job in jobs}


def _shares(jobs: list[VerifyJob], platform: str | None) -> list[list[VerifyJob]]:
    """The jobs split over the workers: one worker per core up to `MAX_WORKERS`, each with at
    least `MIN_SHAPES_PER_WORKER` distinct batch shapes. What costs is compiling the step for
    a shape (about 1 to 3 s each; a job whose shape a worker has seen reuses the compiled
    program in a few ms), so jobs of one shape ([R, M, B, T] and dtype) stay in one worker and
    the shapes are dealt out in turn. An accelerator platform gets one worker: its devices are
    not for sharing between processes."""
    by_shape: dict[tuple, list[VerifyJob]] = {}
    for job in jobs:
        rows, width = builtin_fixture(job.fixture).targets.shape
        key = (rows, width, job.layout, job.dtype, job.row_fields)
        by_shape.setdefault(key, []).append(job)
    cores = len(usable_cores())
    workers = 1 if (platform or "cpu") != "cpu" else min(MAX_WORKERS, cores)
    workers = max(1, min(workers, len(by_shape) // MIN_SHAPES_PER_WORKER))
    shares: list[list[VerifyJob]] = [[] for _ in range(workers)]
    for index, group in enumerate(by_shape.values()):
        shares[index % workers].extend(group)
    return shares
