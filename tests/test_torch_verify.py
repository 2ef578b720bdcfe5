"""`crosscheck.verification.torch_verify.run`: the example steps against the oracle, and every way a
step can fail giving a StepError that names the job and the cause, within a bounded time.

Each test is one call of `run` (one launch per world size, and a fresh one after a job that
failed: forking ranks from the warm zygote costs a fraction of a second). The
example steps run from the repository root (``examples.*``); the broken ones from ``tests/``
(``verify_steps``, ``verify_broken_step``), so the ranks must find them through the caller's
working directory.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest

from crosscheck.contract.oracle import loss_and_grad
from crosscheck.fixtures.builtin import builtin_fixture
from crosscheck.judge.compare import FLOAT64_RTOL, tree_rel_err
from crosscheck.verification import torch_verify
from crosscheck.verification.protocol import StepError, VerifyJob, VerifyOutput
from torch_impl.harness.user_step import RAISED, STOPPED, stopped_after

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
JOBS = [
    VerifyJob(fixture="packed", world_size=2, accum_steps=2),
    VerifyJob(fixture="ragged", world_size=2, accum_steps=1),
    VerifyJob(fixture="ragged", world_size=1, accum_steps=2),
]
#: The failure tests' time limit for the whole run: small, so a hang costs little.
TIMEOUT_S = 10.0
#: What a failing call may take at most: the runner's stated bound (the limit, plus start-up
#: and clean-up).
BOUND_S = TIMEOUT_S + torch_verify.GRACE_S


def run_in(
    directory: Path, step: str, jobs: list[VerifyJob], timeout_s: float = 120.0
) -> tuple[dict[VerifyJob, VerifyOutput | StepError], float]:
    """`run` from `directory` (where the ranks import the step from), and its wall time."""
    with contextlib.chdir(directory):
        start = time.monotonic()
        results = torch_verify.run(step, jobs, timeout_s=timeout_s)
    return results, time.monotonic() - start


def rel_err(output: VerifyOutput | StepError, job: VerifyJob, scheme: str) -> float:
    """The output's relative error against the oracle's gradient for `scheme` on `job`."""
    if not isinstance(output, VerifyOutput):
        raise AssertionError(f"{job.describe()}: expected a gradient, got {output!r}")
    fixture = builtin_fixture(job.fixture)
    expected = loss_and_grad(fixture, scheme, job.world_size, job.accum_steps).grads
    return tree_rel_err(output.grads, expected).max_rel_err


def step_error(output: VerifyOutput | StepError) -> str:
    assert isinstance(output, StepError), f"expected a StepError, got {output!r}"
    return str(output)


@pytest.mark.parametrize("step", ["examples.torch_torchtitan:step", "examples.torch_factory:step"])
def test_global_count_examples_are_the_token_mean(step: str) -> None:
    results, _ = run_in(REPO, step, JOBS)
    for job in JOBS:
        assert rel_err(results[job], job, "token_mean") <= FLOAT64_RTOL, job.describe()


def test_nanogpt_example_is_the_microbatch_mean() -> None:
    results, _ = run_in(REPO, "examples.torch_nanogpt:step", JOBS)
    for job in JOBS:
        # Per-microbatch means: microbatch_mean, which at M = 1 is the per-rank mean.
        accidental = "microbatch_mean" if job.accum_steps > 1 else "rank_mean"
        assert rel_err(results[job], job, accidental) <= FLOAT64_RTOL, job.describe()
        # ... and visibly not the token mean: what verify rejects.
        assert rel_err(results[job], job, "token_mean") > 1e-3, job.describe()


def test_a_step_raising_on_one_rank_fails_its_job_only() -> None:
    jobs = [
        VerifyJob(fixture="ragged", world_size=2, accum_steps=1),
        VerifyJob(fixture="packed", world_size=2, accum_steps=2),  # rank 1 raises
        VerifyJob(fixture="packed", world_size=2, accum_steps=1),
    ]
    results, elapsed = run_in(
        TESTS, "verify_steps:raise_on_rank1_when_accumulating", jobs, TIMEOUT_S
    )
    message = step_error(results[jobs[1]])
    assert message.startswith("packed R=2 M=2: rank 1: the step raised ValueError")
    assert "rank 1 cannot accumulate" in message
    # The user's frame, none of the harness's.
    assert 'verify_steps.py", line' in message
    assert "raise_on_rank1_when_accumulating" in message
    assert "user_step.py" not in message
    # Rank 0, left in the step's all-reduce, was stopped by its watcher, and the job after it
    # ran in a fresh process group: the jobs around it are unharmed.
    assert "(rank 0 was stopped while still in the step, after rank 1 failed;" in message
    for job in (jobs[0], jobs[2]):
        assert rel_err(results[job], job, "token_mean") <= FLOAT64_RTOL, job.describe()
    assert elapsed < BOUND_S


def test_every_stopped_rank_names_the_rank_that_raised() -> None:
    """Four ranks, rank 1 raising while the others wait in the all-reduce: each rank its
    watcher stops says it was stopped after rank 1 failed. Which peer a watcher reads first is
    a race (rank 0's own stop may already be on disk when rank 2 looks): the rule that picks
    the cause over a stopped peer is held on its own first."""
    assert stopped_after([(0, STOPPED), (1, RAISED), (3, STOPPED)]) == "rank 1 failed"
    assert stopped_after([(0, STOPPED), (3, "")]) == "rank 3 failed"  # marker being written
    assert stopped_after([(0, STOPPED)]) == "rank 0 was stopped"
    job = VerifyJob(fixture="packed", world_size=4, accum_steps=2)
    results, elapsed = run_in(TESTS, "verify_steps:raise_on_rank1_when_accumulating", [job])
    message = step_error(results[job])
    assert message.startswith("packed R=4 M=2: rank 1: the step raised ValueError"), message
    stopped = [line for line in message.splitlines() if "was stopped while still" in line]
    assert {line.split(" was")[0] for line in stopped} == {"(rank 0", "(rank 2", "(rank 3"}
    assert all(line.endswith("after rank 1 failed; it was at:") for line in stopped), stopped
    assert elapsed < BOUND_S


def test_unsynchronized_gradients_name_the_rank() -> None:
    job = VerifyJob(fixture="ragged", world_size=2, accum_steps=2)
    results, _ = run_in(TESTS, "verify_steps:never_synchronized", [job], TIMEOUT_S)
    message = step_error(results[job])
    assert message.startswith("ragged R=2 M=2: rank 1 holds a different")
    assert "not synchronized" in message


def test_factory_step_results_that_are_no_gradient() -> None:
    jobs = [VerifyJob(fixture="ragged", world_size=1, accum_steps=m) for m in (1, 2, 3)]
    results, elapsed = run_in(TESTS, "verify_steps:misbehaving_factory_step", jobs, TIMEOUT_S)
    returned_none, padded, dropped = (step_error(results[job]) for job in jobs)
    assert returned_none.startswith("ragged R=1 M=1: rank 0: ")
    assert "must return the (wrapped) model" in returned_none and "NoneType" in returned_none
    assert padded.startswith("ragged R=1 M=2: ")
    assert "parameter 'embed' has shape (48, 12), expected (40, 12)" in padded
    assert dropped.startswith("ragged R=1 M=3: ")
    assert "parameter 'embed' has no gradient" in dropped
    assert elapsed < BOUND_S


def test_a_step_hanging_on_every_rank_times_out() -> None:
    jobs = [
        VerifyJob(fixture="packed", world_size=2, accum_steps=1),
        VerifyJob(fixture="ragged", world_size=2, accum_steps=1),
    ]
    results, elapsed = run_in(TESTS, "verify_steps:hang_everywhere", jobs, TIMEOUT_S)
    message = step_error(results[jobs[0]])
    assert message.startswith("packed R=2 M=1: the step did not finish within 10 s")
    assert "hang_everywhere" in message  # where the watchdog found it
    # The hung ranks were ended, and the launch with them: the next job says why it did not run.
    skipped = step_error(results[jobs[1]])
    assert skipped.startswith("ragged R=2 M=1: not run: ")
    assert "packed R=2 M=1" in skipped and "did not finish" in skipped
    # The step had its whole time limit, and the run ended within the stated grace after it.
    assert TIMEOUT_S <= elapsed < BOUND_S


def test_a_collective_only_rank_1_enters_times_out_and_the_launch_recovers() -> None:
    jobs = [
        VerifyJob(fixture="packed", world_size=2, accum_steps=2),  # rank 1 waits alone
        VerifyJob(fixture="ragged", world_size=2, accum_steps=1),
    ]
    results, elapsed = run_in(TESTS, "verify_steps:hang_in_collective_on_rank1", jobs, TIMEOUT_S)
    message = step_error(results[jobs[0]])
    collective_s = torch_verify.collective_timeout(TIMEOUT_S)
    assert message.startswith(
        f"packed R=2 M=2: rank 1: a collective did not finish within {collective_s:g} s"
    )
    assert "hang_in_collective_on_rank1" in message
    # A fresh process group ran the next job: its collectives line up again.
    assert rel_err(results[jobs[1]], jobs[1], "token_mean") <= FLOAT64_RTOL
    assert elapsed < BOUND_S


def test_a_step_that_cannot_be_imported_fails_every_job() -> None:
    jobs = JOBS[:2]
    results, elapsed = run_in(TESTS, "verify_broken_step:step", jobs, TIMEOUT_S)
    for job in jobs:
        message = step_error(results[job])
        assert message.startswith(f"{job.describe()}: cannot import the step ")
        assert "'verify_broken_step:step'" in message
        assert "ModuleNotFoundError: No module named 'gradweight_missing_dependency'" in message
        assert 'verify_broken_step.py", line' in message
    assert elapsed < BOUND_S


def test_jobs_that_cannot_run_fail_without_a_launch() -> None:
    packed = VerifyJob(fixture="packed", world_size=3, accum_steps=1)  # 8 rows over 3 ranks
    unknown = VerifyJob(fixture="no-such-fixture", world_size=1, accum_steps=1)
    results, elapsed = run_in(TESTS, "verify_steps:never_synchronized", [packed, unknown])
    assert "cannot be laid out over world_size=3" in step_error(results[packed])
    assert "unknown fixture 'no-such-fixture'" in step_error(results[unknown])
    results, _ = run_in(TESTS, "verify_steps.never_synchronized", JOBS[:1])
    assert "must be named MODULE:FUNCTION" in step_error(results[JOBS[0]])
    assert elapsed < 5.0  # nothing was launched
    with pytest.raises(ValueError, match="timeout_s"):
        torch_verify.run("verify_steps:never_synchronized", JOBS, timeout_s=0.0)
