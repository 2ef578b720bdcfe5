"""The JAX bug catalogue (jax_impl.harness.bugs) through its harness runner, against numpy.

Every catalogue run plus the rank-skew calibration runs come from the session's one run of
the catalogue (tests/bug_outputs.py, through `crosscheck.bugs.jax_bugs.run`: two worker
processes, one per dtype). Each output is then checked against what the pattern's text in
crosscheck.diagnosis.patterns defines, computed with numpy (the counts and scales in
tests/bug_predictions.py, which test_torch_bugs holds torch to) and the oracle: the logged
denominator exactly, and the gradient within 1e-12 (float64) of the weighting the pattern
describes: a scale of the token mean, a reweighting, or the clipped sum.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from bug_outputs import bug_output, judged_runs, skew_run
from bug_predictions import (
    CONTEXT_PARALLEL,
    LOGGED_DENOMINATOR,
    TOKEN_MEAN_SCALE,
    context_parallel_prediction,
    counts,
    local_group_count_weights,
    microstep_mean_weights,
    pipeline_prediction,
)

from crosscheck.bugs import jax_bugs
from crosscheck.bugs.catalogue_run import SKEW
from crosscheck.contract.fixture import Fixture
from crosscheck.contract.oracle import OracleResult, loss_and_grad, weighted_grad
from crosscheck.diagnosis.patterns import CLIP_PER_MICROBATCH_NORM, PATTERNS, RANK_SKEW, BugRun
from crosscheck.fixtures.builtin import builtin_fixture
from crosscheck.judge.compare import FLOAT32_RTOL, FLOAT64_RTOL, tree_rel_err

ROOT = Path(__file__).resolve().parents[1]
# Both held by the session's one run (tests/bug_outputs.py); the skew runs' layout, (ragged,
# 2, 1), is a catalogue layout too.
CATALOGUE, SKEW_RUNS = judged_runs("jax")
BAD_RUNS = {
    "not divisible by 3": BugRun(
        pattern="rank-mean", framework="jax", fixture="packed", world_size=3, accum_steps=1
    ),
    "unknown bug pattern": BugRun(
        pattern="no-such-bug", framework="jax", fixture="packed", world_size=2, accum_steps=1
    ),
    "world_size=16 needs 1 to 8 devices": BugRun(
        pattern="rank-mean", framework="jax", fixture="ragged", world_size=16, accum_steps=1
    ),
    "not a JAX run": BugRun(
        pattern="rank-mean", framework="torch", fixture="seed", world_size=2, accum_steps=1
    ),
}


@pytest.fixture(scope="module")
def bad_outcomes() -> dict:
    """The bad runs through the JAX runner (the catalogue's come from tests/bug_outputs.py)."""
    return jax_bugs.run(list(BAD_RUNS.values()))


def _rows(fixture: Fixture, R: int, M: int, rank: int, micro: int) -> slice:
    B = fixture.num_rows // (R * M)
    start = rank * (fixture.num_rows // R) + micro * B
    return slice(start, start + B)


def _valid_count(f: Fixture) -> int:
    return int(f.valid.sum())


def _rows_with_target(f: Fixture) -> int:
    return int(f.valid.any(axis=1).sum())


def _token_mean(run: BugRun) -> OracleResult:
    return loss_and_grad(
        builtin_fixture(run.fixture), "token_mean", run.world_size, run.accum_steps
    )


def _grad(f: Fixture, c: np.ndarray) -> dict:
    return weighted_grad(f.params(), f.inputs, f.targets, c)


def _assert_close(run: BugRun, actual: dict, expected: dict, rtol: float = FLOAT64_RTOL) -> None:
    err = tree_rel_err(actual, expected)
    assert err.max_rel_err <= rtol, f"{run.describe()}: {err.describe()}"


def test_every_run_produced_a_finite_synchronized_gradient() -> None:
    for run in [*CATALOGUE, *SKEW_RUNS]:
        if run.pattern == "zero-count-nan":
            continue  # NaN by design: its own test below
        out = bug_output(run)
        f = builtin_fixture(run.fixture)
        assert set(out.grads) == {"embed", "unembed"}, run.describe()
        for name, shape in (("embed", f.embed.shape), ("unembed", f.unembed.shape)):
            g = out.grads[name]
            assert g.dtype == np.float64 and g.shape == shape, (run.describe(), name, g.shape)
            assert np.isfinite(g).all() and np.abs(g).max() > 0, (run.describe(), name)


def test_the_catalogue_has_every_pattern_and_every_logged_rule() -> None:
    assert {run.pattern for run in CATALOGUE} == set(PATTERNS)
    assert set(LOGGED_DENOMINATOR) | {"float32-count", *CONTEXT_PARALLEL} == set(PATTERNS) | {
        RANK_SKEW
    }


def test_logged_denominators_are_the_ones_the_pattern_text_defines() -> None:
    for run in [*CATALOGUE, *SKEW_RUNS]:
        if run.pattern == "float32-count" or run.pattern in CONTEXT_PARALLEL:
            continue  # their own tests: float32 summation order; the context split
        c = counts(run.fixture, run.world_size, run.accum_steps)
        want = LOGGED_DENOMINATOR[run.pattern](c, run.world_size)
        got = bug_output(run).logged_denominator
        assert got == want, f"{run.describe()}: logged {got}, the pattern defines {want}"


def test_rank_skew_at_one_is_the_token_mean_in_both_dtypes() -> None:
    for run, rtol in ((SKEW_RUNS[0], FLOAT64_RTOL), (SKEW_RUNS[1], FLOAT32_RTOL)):
        _assert_close(run, bug_output(run).grads, _token_mean(run).grads, rtol)
    # float32 really ran in float32: it is not float64-exact.
    err = tree_rel_err(bug_output(SKEW_RUNS[1]).grads, _token_mean(SKEW_RUNS[1]).grads)
    assert err.max_rel_err > 1e-12


def test_rank_skew_weighs_rank_zero_by_the_skew() -> None:
    run = SKEW_RUNS[2]
    f = builtin_fixture(run.fixture)
    c = f.valid / _valid_count(f)
    c[: f.num_rows // run.world_size] *= run.skew
    got = bug_output(run).grads
    _assert_close(run, got, _grad(f, c))
    assert tree_rel_err(got, _token_mean(run).grads).max_rel_err > 1e-4


@pytest.mark.parametrize("pattern", sorted(TOKEN_MEAN_SCALE))
def test_scale_patterns_are_the_token_mean_times_their_scale(pattern: str) -> None:
    for run in (r for r in CATALOGUE if r.pattern == pattern):
        c = counts(run.fixture, run.world_size, run.accum_steps)
        scale = TOKEN_MEAN_SCALE[pattern](c, run.world_size, run.accum_steps)
        want = {k: scale * v for k, v in _token_mean(run).grads.items()}
        _assert_close(run, bug_output(run).grads, want)


@pytest.mark.parametrize("pattern", ["rank-mean", "microbatch-mean"])
def test_local_means_are_the_oracles_accidental_schemes(pattern: str) -> None:
    for run in (r for r in CATALOGUE if r.pattern == pattern):
        scheme = pattern.replace("-", "_")
        want = loss_and_grad(builtin_fixture(run.fixture), scheme, run.world_size, run.accum_steps)
        _assert_close(run, bug_output(run).grads, want.grads)
        assert tree_rel_err(want.grads, _token_mean(run).grads).max_rel_err > 1e-3


def test_microstep_mean_weighs_each_microbatch_by_its_count_over_ranks() -> None:
    runs = [r for r in CATALOGUE if r.pattern == "microstep-mean"]
    assert runs
    for run in runs:
        f, R, M = builtin_fixture(run.fixture), run.world_size, run.accum_steps
        want = _grad(f, microstep_mean_weights(f.name, R, M))
        _assert_close(run, bug_output(run).grads, want)
        # The layout tells it from the intended token mean and from microbatch-mean.
        for scheme in ("token_mean", "microbatch_mean"):
            other = loss_and_grad(f, scheme, R, M).grads
            assert tree_rel_err(want, other).max_rel_err > 1e-3, (run.describe(), scheme)


def test_local_group_count_weighs_each_group_part_by_its_microbatch_count() -> None:
    runs = [r for r in CATALOGUE if r.pattern == "local-group-count"]
    assert runs
    for run in runs:
        f = builtin_fixture(run.fixture)
        want = _grad(f, local_group_count_weights(f.name, run.world_size, run.accum_steps))
        _assert_close(run, bug_output(run).grads, want)
        # The layout splits a group: the global count would be another gradient.
        intended = loss_and_grad(f, "group_token_mean", run.world_size, run.accum_steps)
        assert tree_rel_err(want, intended.grads).max_rel_err > 1e-3, run.describe()


def test_zero_count_nan_puts_nan_on_every_rank() -> None:
    """The sweep checked every rank holds the same gradient, NaN included; the empty
    microbatch's 0/0 reaches all of the unembedding and the embedding rows it reads."""
    runs = [r for r in CATALOGUE if r.pattern == "zero-count-nan"]
    assert runs
    for run in runs:
        grads = bug_output(run).grads
        assert np.isnan(grads["unembed"]).all() and np.isnan(grads["embed"]).any(), run


def test_packed_as_one_weighs_every_token_by_its_row() -> None:
    for run in (r for r in CATALOGUE if r.pattern == "packed-as-one"):
        f = builtin_fixture(run.fixture)
        n_row = f.valid.sum(axis=1, keepdims=True)
        c = np.where(f.valid, 1 / np.maximum(n_row, 1), 0.0) / _rows_with_target(f)
        _assert_close(run, bug_output(run).grads, _grad(f, c))


def test_clip_per_microbatch_is_the_sum_of_clipped_microbatch_gradients() -> None:
    for run in (r for r in CATALOGUE if r.pattern == "clip-per-microbatch"):
        f = builtin_fixture(run.fixture)
        R, M = run.world_size, run.accum_steps
        want = {k: np.zeros_like(v) for k, v in f.params().items()}
        for m in range(M):
            c = np.zeros(f.targets.shape)
            for r in range(R):
                rows = _rows(f, R, M, r, m)
                c[rows] = f.valid[rows] / _valid_count(f)
            g = _grad(f, c)
            norm = np.sqrt(sum(float((x**2).sum()) for x in g.values()))
            factor = 1.0 if norm < CLIP_PER_MICROBATCH_NORM else CLIP_PER_MICROBATCH_NORM / norm
            want = {k: want[k] + factor * g[k] for k in want}
        _assert_close(run, bug_output(run).grads, want)
        # The catalogue promises the clip bites on its layouts: else this is the token mean.
        assert tree_rel_err(want, _token_mean(run).grads).max_rel_err > 1e-3, run.describe()


def test_float32_count_divides_by_an_inexact_float32_total() -> None:
    for run in (r for r in CATALOGUE if r.pattern == "float32-count"):
        f = builtin_fixture(run.fixture)
        total = float(f.weights[f.valid].sum())  # integers < 2^53: exact in float64
        out = bug_output(run)
        logged = out.logged_denominator
        assert float(np.float32(logged)) == logged, f"{run.describe()}: {logged} is not float32"
        assert logged != total, f"{run.describe()}: float32 cannot hold {total} exactly"
        # Recursive summation of n terms in float32 errs by at most n * 2^-24 of the total.
        assert abs(logged - total) <= f.num_valid_tokens * 2.0**-24 * total, run.describe()
        weighted = loss_and_grad(f, "weighted_mean", run.world_size, run.accum_steps).grads
        want = {k: total / logged * v for k, v in weighted.items()}
        _assert_close(run, out.grads, want)


@pytest.mark.parametrize("why", sorted(BAD_RUNS))
def test_a_bad_run_comes_back_as_an_error_naming_it(bad_outcomes: dict, why: str) -> None:
    run = BAD_RUNS[why]
    error = bad_outcomes[run]
    assert isinstance(error, ValueError | jax_bugs.JaxBugRunError), error
    assert run.describe() in str(error) and why in str(error), str(error)


def test_a_worker_that_outlives_its_timeout_fails_its_runs_instead_of_hanging() -> None:
    runs = [skew_run("jax", "float64", 1.0), skew_run("jax", "float32", 1.0)]
    result = jax_bugs.run(runs, timeout_s=0.5)  # importing JAX alone takes longer
    for run in runs:
        assert isinstance(result[run], jax_bugs.JaxBugRunError), result[run]
        assert run.describe() in str(result[run]) and "still running" in str(result[run])


def test_a_failed_worker_fails_every_run_it_carried(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jax_bugs, "WORKER_MODULE", "crosscheck.bugs.no_such_worker")
    runs = [skew_run("jax", "float64", 1.0), skew_run("jax", "float64", SKEW)]
    result = jax_bugs.run(runs)
    for run in runs:
        assert isinstance(result[run], jax_bugs.JaxBugRunError), result[run]
        assert "No module named" in str(result[run]), str(result[run])


def test_the_runner_does_not_import_jax_in_the_calling_process() -> None:
    code = (
        "import sys, crosscheck.bugs.jax_bugs, crosscheck.launch.worker_processes, "
        "crosscheck.launch.zygote; "
        "assert 'jax' not in sys.modules, sorted(k for k in sys.modules if 'jax' in k)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=ROOT)


CONTEXT_RUNS = [run for run in CATALOGUE if run.pattern in CONTEXT_PARALLEL]


def test_context_parallel_steps_weigh_and_log_as_their_text_says() -> None:
    """Every context-parallel run: the logged denominator exactly, and the gradient within
    1e-12 of the weights the pattern's text gives (tests/bug_predictions.py)."""
    assert {run.pattern for run in CONTEXT_RUNS} == set(CONTEXT_PARALLEL)
    for run in CONTEXT_RUNS:
        weights, logged = context_parallel_prediction(run)
        out = bug_output(run)
        got = out.logged_denominator
        assert got == logged, f"{run.describe()}: logged {got}, the pattern defines {logged}"
        _assert_close(run, out.grads, _grad(builtin_fixture(run.fixture), weights))


def test_a_pipeline_count_on_the_last_stage_only_inflates_the_first_stage() -> None:
    """The embedding (stage 0) D times its intended gradient, the unembedding as intended."""
    runs = [run for run in CATALOGUE if run.pipeline_stages > 1]
    assert {run.pattern for run in runs} == {"pp-unsent-count"}
    for run in runs:
        _assert_close(run, bug_output(run).grads, pipeline_prediction(run))
