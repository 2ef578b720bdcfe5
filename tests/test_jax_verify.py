"""The JAX step protocol through its driver.

The protocol is crosscheck.verification.protocol; the driver crosscheck.verification.jax_verify.

Each example step of examples/ runs once, in one worker, over the same three jobs, and its
gradient is compared with the oracle: the token-weighted loop is the token mean, the pmap loop
the rank mean and the MultiSteps loop the microbatch mean. The broken steps of
tests/jax_verify_steps.py check that every failure becomes a StepError that names the job and
the cause, within the time limit plus `jax_verify.TIMEOUT_GRACE_S`, and that a hang or a crash
keeps the jobs finished before it (the hung job timed out, the later ones not run).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from crosscheck.contract.oracle import loss_and_grad
from crosscheck.fixtures.builtin import builtin_fixture
from crosscheck.judge.compare import FLOAT64_RTOL, tree_rel_err
from crosscheck.verification import jax_verify
from crosscheck.verification.protocol import StepError, VerifyJob, VerifyOutput

ROOT = Path(__file__).resolve().parents[1]
JOBS = [
    VerifyJob(fixture="packed", world_size=2, accum_steps=2),
    VerifyJob(fixture="ragged", world_size=2, accum_steps=1),
    VerifyJob(fixture="ragged", world_size=1, accum_steps=2),
]
SHORT_TIMEOUT_S = 20.0


def _job(fixture: str, world_size: int, accum_steps: int) -> VerifyJob:
    return VerifyJob(fixture=fixture, world_size=world_size, accum_steps=accum_steps)


@pytest.fixture(scope="module")
def in_root() -> Iterator[None]:
    """The steps are named relative to the repository root, as a user names theirs."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(ROOT)
        yield


def _timed_run(step: str, jobs: list[VerifyJob], timeout_s: float) -> tuple[dict, float]:
    start = time.monotonic()
    outcomes = jax_verify.run(step, jobs, timeout_s=timeout_s)
    return outcomes, time.monotonic() - start


def _grads(outcome: VerifyOutput | StepError, job: VerifyJob) -> dict:
    assert isinstance(outcome, VerifyOutput), f"{job.describe()}: {outcome}"
    return outcome.grads


def _err(grads: dict, job: VerifyJob, scheme: str) -> float:
    want = loss_and_grad(builtin_fixture(job.fixture), scheme, job.world_size, job.accum_steps)
    return tree_rel_err(grads, want.grads).max_rel_err


@pytest.fixture(scope="module")
def examples(in_root: None) -> dict[str, dict]:
    """{example module: its outcomes}, one worker per example."""
    names = ("jax_token_weighted", "jax_pmap_mean", "jax_optax_multisteps")
    return {name: jax_verify.run(f"examples.{name}:step", JOBS) for name in names}


def test_token_weighted_example_is_the_token_mean(examples: dict) -> None:
    outcomes = examples["jax_token_weighted"]
    assert list(outcomes) == JOBS
    for job in JOBS:
        assert _err(_grads(outcomes[job], job), job, "token_mean") < FLOAT64_RTOL


def test_pmap_example_is_the_rank_mean_at_every_m(examples: dict) -> None:
    for job in JOBS:
        grads = _grads(examples["jax_pmap_mean"][job], job)
        assert _err(grads, job, "rank_mean") < FLOAT64_RTOL
        if job.world_size > 1:  # one device: the rank mean is the token mean
            assert _err(grads, job, "token_mean") > 1e-3


def test_multisteps_example_is_the_microbatch_mean(examples: dict) -> None:
    for job in JOBS:
        grads = _grads(examples["jax_optax_multisteps"][job], job)
        want = "microbatch_mean" if job.accum_steps > 1 else "rank_mean"
        assert _err(grads, job, want) < FLOAT64_RTOL
        assert _err(grads, job, "token_mean") > 1e-3


# --- broken steps ------------------------------------------------------------------------

MISBEHAVING = "tests.jax_verify_steps:misbehaving"
# job -> what its StepError must say, in the order the worker runs them.
MISBEHAVIOUR = {
    _job("packed", 1, 1): ["raised ValueError: boom", "_check_the_batch", "in misbehaving"],
    _job("packed", 2, 1): ["['embed'] has shape (12, 40), expected (40, 12)"],
    _job("packed", 1, 2): ["gradient has keys ['embedding', 'unembed']", "missing ['embed']"],
    _job("packed", 2, 2): ["replica 1 differs from replica 0", "not synchronized"],
    _job("ragged", 1, 2): ["worker died while running this job", "exited with code 3"],
}
GOOD = _job("ragged", 2, 1)


@pytest.fixture(scope="module")
def misbehaving(in_root: None) -> tuple[dict, float]:
    jobs = [*list(MISBEHAVIOUR)[:-1], GOOD, list(MISBEHAVIOUR)[-1]]
    return _timed_run(MISBEHAVING, jobs, SHORT_TIMEOUT_S)


@pytest.mark.parametrize("job", list(MISBEHAVIOUR), ids=lambda job: job.describe())
def test_each_broken_job_gets_a_step_error_naming_it(misbehaving: tuple, job: VerifyJob) -> None:
    outcomes, elapsed = misbehaving
    error = outcomes[job]
    assert isinstance(error, StepError), error
    message = str(error)
    assert message.startswith(f"{job.describe()}: "), message
    assert MISBEHAVING in message, message
    for part in MISBEHAVIOUR[job]:
        assert part in message, message
    assert elapsed < SHORT_TIMEOUT_S + jax_verify.TIMEOUT_GRACE_S


def test_a_traceback_shows_the_users_frames_only(misbehaving: tuple) -> None:
    message = str(misbehaving[0][_job("packed", 1, 1)])
    assert "jax_verify_steps.py" in message
    assert "jax_verify_worker.py" not in message and "site-packages" not in message


def test_a_good_job_among_broken_ones_keeps_its_result(misbehaving: tuple) -> None:
    grads = _grads(misbehaving[0][GOOD], GOOD)
    assert _err(grads, GOOD, "token_mean") < FLOAT64_RTOL


def test_a_worker_that_dies_leaves_the_others_running(in_root: None) -> None:
    """Six shapes: two workers (on two cores or more), dealt in turn. The second dies at once
    on its second job; the first, still in its slow jobs then, runs on to the end: every one
    of its jobs has its gradient, and only the dead worker's jobs say it died."""
    first = [_job("packed", 2, 1), _job("packed", 2, 2), _job("ragged", 2, 1)]
    second = [_job("packed", 1, 2), _job("ragged", 1, 2), _job("ragged", 2, 2)]
    jobs = [job for pair in zip(first, second, strict=True) for job in pair]
    shares = jax_verify._shares(jobs, "cpu")
    assert len(shares) == 2 and shares == [first, second]
    outcomes, _ = _timed_run("tests.jax_verify_steps:dies_on_one_sleeps_on_others", jobs, 60)
    for job in first + second[:1]:
        assert _err(_grads(outcomes[job], job), job, "token_mean") < FLOAT64_RTOL
    assert "worker died while running this job" in str(outcomes[second[1]])
    assert "worker died before this job ran" in str(outcomes[second[2]])


def test_a_hang_is_killed_and_the_finished_jobs_keep_their_results(in_root: None) -> None:
    done = [_job("packed", 1, 1), _job("packed", 2, 2)]
    hung, never_ran = _job("ragged", 2, 1), _job("ragged", 1, 2)
    outcomes, elapsed = _timed_run(
        "tests.jax_verify_steps:hangs_on_ragged", [*done, hung, never_ran], SHORT_TIMEOUT_S
    )
    # The whole run, not each job, is bounded: the limit plus the stated grace.
    assert SHORT_TIMEOUT_S <= elapsed < SHORT_TIMEOUT_S + jax_verify.TIMEOUT_GRACE_S
    for job in done:
        assert _err(_grads(outcomes[job], job), job, "token_mean") < FLOAT64_RTOL
    for job, status, says in [
        (hung, "timed out", "still running this job"),
        (never_ran, "not run", "this job never ran"),
    ]:
        message = str(outcomes[job])
        assert isinstance(outcomes[job], StepError), message
        assert message.startswith(f"{job.describe()}: {status}: "), message
        assert f"did not finish within {SHORT_TIMEOUT_S:g} s" in message, message
        assert says in message, message
    assert f"running {hung.describe()}" in str(outcomes[never_ran])


@pytest.mark.parametrize(
    ("step", "cause"),
    [
        ("tests.no_such_module:step", "ModuleNotFoundError: No module named 'tests.no_such"),
        ("tests.jax_verify_steps:no_such_step", "AttributeError"),
        ("tests.jax_verify_steps:NOT_A_FUNCTION", "is not callable: it is int 42"),
    ],
)
def test_a_step_that_cannot_be_imported_fails_every_job(
    in_root: None, step: str, cause: str
) -> None:
    outcomes, elapsed = _timed_run(step, JOBS, SHORT_TIMEOUT_S)
    assert elapsed < SHORT_TIMEOUT_S + jax_verify.TIMEOUT_GRACE_S
    assert list(outcomes) == JOBS
    for job, error in outcomes.items():
        assert isinstance(error, StepError), error
        assert str(error).startswith(f"{job.describe()}: cannot import step {step}: ")
        assert cause in str(error)


def test_a_malformed_step_name_fails_without_a_worker() -> None:
    outcomes, elapsed = _timed_run("examples.jax_pmap_mean", JOBS, SHORT_TIMEOUT_S)
    assert elapsed < 1.0
    assert list(outcomes) == JOBS
    for job, error in outcomes.items():
        assert isinstance(error, StepError)
        assert str(error).startswith(f"{job.describe()}: step 'examples.jax_pmap_mean' is not")


def test_the_harness_side_does_not_import_jax() -> None:
    code = (
        "import sys, crosscheck.verification.jax_verify; "
        "assert 'jax' not in sys.modules, sorted(k for k in sys.modules if 'jax' in k)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=ROOT)
