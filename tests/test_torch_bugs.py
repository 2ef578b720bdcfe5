"""The torch bug catalogue against what each pattern's text says the buggy step computes.

The session's one run of the catalogue (tests/bug_outputs.py, through
``crosscheck.bugs.torch_bugs.run``: one launch per world size) carries every torch run of
the catalogue and the rank-skew runs. Each run's second-window gradient is compared with a
prediction built here from the numpy oracle (the intended gradient times the pattern's scale,
or the accidental scheme it amounts to), and its logged denominator with the count the
pattern defines (the counts and scales: tests/bug_predictions.py, shared with test_jax_bugs).
"""

from __future__ import annotations

import numpy as np
import pytest
from bug_outputs import bug_output, judged_runs
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

from crosscheck.bugs import torch_bugs
from crosscheck.contract.layout import IGNORE_INDEX
from crosscheck.contract.optimizers import clip_by_global_norm
from crosscheck.contract.oracle import loss_and_grad, weighted_grad
from crosscheck.diagnosis.patterns import CLIP_PER_MICROBATCH_NORM, PATTERNS, RANK_SKEW, BugRun
from crosscheck.fixtures.builtin import builtin_fixture
from crosscheck.judge.clipping import microbatch_gradients
from crosscheck.judge.compare import FLOAT32_RTOL, FLOAT64_RTOL, tree_rel_err

Grads = dict[str, np.ndarray]


CATALOGUE, SKEW_RUNS = judged_runs("torch")
RUNS = [*CATALOGUE, *SKEW_RUNS]
RTOL = {"float64": FLOAT64_RTOL, "float32": FLOAT32_RTOL}


def _ids(runs: list[BugRun]) -> list[str]:
    return [r.describe().replace(" ", "-") for r in runs]


#: pattern -> the oracle scheme its gradient is exactly.
AS_SCHEME = {
    "rank-mean": "rank_mean",
    "microbatch-mean": "microbatch_mean",
    "packed-as-one": "row_mean",
}


def _scaled(grads: Grads, factor: float) -> Grads:
    return {k: v * factor for k, v in grads.items()}


def _clip_per_microbatch(bug_run: BugRun) -> Grads:
    """sum over m of clip(all ranks' microbatch m), clipped the way clip_grad_norm_ clips."""
    fixture, R, M = builtin_fixture(bug_run.fixture), bug_run.world_size, bug_run.accum_steps
    parts = microbatch_gradients(fixture, "token_mean", R, M)  # rank-major, [R M]
    steps = [{k: sum(parts[r * M + m][k] for r in range(R)) for k in parts[0]} for m in range(M)]
    clipped = [clip_by_global_norm(g, CLIP_PER_MICROBATCH_NORM, "torch")[0] for g in steps]
    return {k: sum(g[k] for g in clipped) for k in parts[0]}


def _rank_skew(bug_run: BugRun) -> Grads:
    """g + (skew - 1) g_0, with g_0 the token-mean gradient of rank 0's rows alone."""
    fixture, R = builtin_fixture(bug_run.fixture), bug_run.world_size
    valid = fixture.targets != IGNORE_INDEX
    on_rank0 = np.zeros(valid.shape, dtype=bool)
    on_rank0[: fixture.num_rows // R] = True
    c = np.where(valid & on_rank0, 1.0, 0.0) / valid.sum()
    rank0 = weighted_grad(fixture.params(), fixture.inputs, fixture.targets, c)
    intended = loss_and_grad(fixture, "token_mean", R, bug_run.accum_steps).grads
    return {k: intended[k] + (bug_run.skew - 1) * rank0[k] for k in intended}


def predicted_grads(bug_run: BugRun, logged: float) -> Grads:
    """What the pattern's text says the second window's gradient is."""
    fixture, R, M = builtin_fixture(bug_run.fixture), bug_run.world_size, bug_run.accum_steps
    if bug_run.pattern == "pp-unsent-count":
        return pipeline_prediction(bug_run)
    if bug_run.pattern in CONTEXT_PARALLEL:
        c, _ = context_parallel_prediction(bug_run)
        return weighted_grad(fixture.params(), fixture.inputs, fixture.targets, c)
    if bug_run.pattern in TOKEN_MEAN_SCALE:
        factor = TOKEN_MEAN_SCALE[bug_run.pattern](counts(fixture.name, R, M), R, M)
        return _scaled(loss_and_grad(fixture, "token_mean", R, M).grads, factor)
    if bug_run.pattern in AS_SCHEME:
        return loss_and_grad(fixture, AS_SCHEME[bug_run.pattern], R, M).grads
    if bug_run.pattern == "float32-count":
        intended = loss_and_grad(fixture, "weighted_mean", R, M)
        return _scaled(intended.grads, intended.denominator / logged)
    if bug_run.pattern == "clip-per-microbatch":
        return _clip_per_microbatch(bug_run)
    if bug_run.pattern == RANK_SKEW:
        return _rank_skew(bug_run)
    if bug_run.pattern == "local-group-count":
        c = local_group_count_weights(fixture.name, R, M)
        return weighted_grad(fixture.params(), fixture.inputs, fixture.targets, c)
    if bug_run.pattern == "microstep-mean":
        c = microstep_mean_weights(fixture.name, R, M)
        return weighted_grad(fixture.params(), fixture.inputs, fixture.targets, c)
    raise AssertionError(f"no prediction for {bug_run.pattern!r}")


# --- the tests -------------------------------------------------------------------------------


def test_every_pattern_has_torch_runs_and_a_prediction() -> None:
    """A pattern added to the contract must get a torch loop, runs, and checks here."""
    from torch_impl.harness.bugs_windows import PIPELINE_STEPS, WINDOW_STEPS
    from torch_impl.harness.bugs_windows import RANK_SKEW as TORCH_RANK_SKEW

    assert TORCH_RANK_SKEW == RANK_SKEW  # repeated there: torch_impl never imports crosscheck
    every = {*PATTERNS, RANK_SKEW}
    assert {*WINDOW_STEPS, *PIPELINE_STEPS} == every
    assert {r.pattern for r in RUNS} == every
    assert {*LOGGED_DENOMINATOR, "float32-count", *CONTEXT_PARALLEL} == every
    predicted = {*TOKEN_MEAN_SCALE, *AS_SCHEME, "float32-count", "clip-per-microbatch", RANK_SKEW}
    predicted |= {*CONTEXT_PARALLEL, "pp-unsent-count"}
    # zero-count-nan's gradient is NaN, checked by its own test.
    assert predicted | {"local-group-count", "microstep-mean", "zero-count-nan"} == every


FINITE_RUNS = [r for r in RUNS if r.pattern != "zero-count-nan"]
NAN_RUNS = [r for r in RUNS if r.pattern == "zero-count-nan"]


@pytest.mark.parametrize("bug_run", FINITE_RUNS, ids=_ids(FINITE_RUNS))
def test_gradient_is_finite(bug_run: BugRun) -> None:
    out = bug_output(bug_run)
    fixture = builtin_fixture(bug_run.fixture)
    assert set(out.grads) == {"embed", "unembed"}
    assert out.grads["embed"].shape == fixture.embed.shape
    assert out.grads["unembed"].shape == fixture.unembed.shape
    for key, grad in out.grads.items():
        assert grad.dtype == np.float64, f"{bug_run.describe()}: {key} is {grad.dtype}"
        assert np.isfinite(grad).all(), f"{bug_run.describe()}: {key} holds NaN or inf"
        assert np.abs(grad).max() > 0, f"{bug_run.describe()}: {key} is all zeros"


@pytest.mark.parametrize("bug_run", RUNS, ids=_ids(RUNS))
def test_logged_denominator(bug_run: BugRun) -> None:
    c = counts(bug_run.fixture, bug_run.world_size, bug_run.accum_steps)
    logged = bug_output(bug_run).logged_denominator
    if bug_run.pattern == "float32-count":
        # The exact total is an odd integer past 2^24, which no float32 holds: the logged
        # value is a float32, off the total by float32 rounding of a few hundred additions.
        assert logged == float(np.float32(logged)), f"{logged!r} is not a float32 value"
        assert logged != c["weight_total"]
        assert abs(logged - c["weight_total"]) <= 1e-4 * c["weight_total"]
        return
    if bug_run.pattern in CONTEXT_PARALLEL:
        expected = context_parallel_prediction(bug_run)[1]
    else:
        expected = LOGGED_DENOMINATOR[bug_run.pattern](c, bug_run.world_size)
    assert logged == expected, f"{bug_run.describe()}: logged {logged!r}, expected {expected!r}"


@pytest.mark.parametrize("bug_run", NAN_RUNS, ids=_ids(NAN_RUNS))
def test_zero_count_nan_puts_nan_on_every_rank(bug_run: BugRun) -> None:
    """The empty microbatch's 0/0 reaches all of the unembedding and the embedding rows its
    inputs read; every rank holds the same NaN (`check_ranks_agree` compares NaN as equal)."""
    grads = bug_output(bug_run).grads
    assert np.isnan(grads["unembed"]).all(), bug_run.describe()
    assert np.isnan(grads["embed"]).any(), bug_run.describe()


@pytest.mark.parametrize("bug_run", FINITE_RUNS, ids=_ids(FINITE_RUNS))
def test_gradient_matches_the_pattern(bug_run: BugRun) -> None:
    out = bug_output(bug_run)
    expected = predicted_grads(bug_run, out.logged_denominator)
    err = tree_rel_err(out.grads, expected)
    assert err.max_rel_err <= RTOL[bug_run.dtype], f"{bug_run.describe()}: {err.describe()}"


@pytest.mark.parametrize("bug_run", SKEW_RUNS, ids=_ids(list(SKEW_RUNS)))
def test_rank_skew_against_the_oracle(bug_run: BugRun) -> None:
    """skew 1 is the correct step (the oracle's token mean); skew 1.01 is visibly not."""
    fixture = builtin_fixture(bug_run.fixture)
    oracle = loss_and_grad(fixture, "token_mean", bug_run.world_size, bug_run.accum_steps)
    err = tree_rel_err(bug_output(bug_run).grads, oracle.grads).max_rel_err
    if bug_run.skew == 1.0:
        assert err <= RTOL[bug_run.dtype], f"{bug_run.describe()}: {err:.3e}"
    else:
        # Rank 0 holds about half the gradient: 1% on it is ~5e-3, far above any tolerance.
        assert err > 1e-3, f"{bug_run.describe()}: a 1% skew moved the gradient by {err:.3e}"


CLIP_RUNS = [r for r in RUNS if r.pattern == "clip-per-microbatch"]


@pytest.mark.parametrize("bug_run", CLIP_RUNS, ids=_ids(CLIP_RUNS))
def test_clip_per_microbatch_is_not_clip_after(bug_run: BugRun) -> None:
    fixture = builtin_fixture(bug_run.fixture)
    oracle = loss_and_grad(fixture, "token_mean", bug_run.world_size, bug_run.accum_steps)
    after, _ = clip_by_global_norm(oracle.grads, CLIP_PER_MICROBATCH_NORM, "torch")
    err = tree_rel_err(bug_output(bug_run).grads, after).max_rel_err
    assert err > 1e-3, f"{bug_run.describe()}: per-microbatch clipping looks like clip-after"


@pytest.mark.parametrize("bug_run", CLIP_RUNS, ids=_ids(CLIP_RUNS))
def test_clip_per_microbatch_differs_from_the_intended_gradient(bug_run: BugRun) -> None:
    """The catalogue's layouts must make the clipping bite, or the bug is invisible."""
    fixture = builtin_fixture(bug_run.fixture)
    oracle = loss_and_grad(fixture, "token_mean", bug_run.world_size, bug_run.accum_steps)
    err = tree_rel_err(bug_output(bug_run).grads, oracle.grads).max_rel_err
    assert err > 1e-3, (
        f"{bug_run.describe()}: no microbatch norm exceeds {CLIP_PER_MICROBATCH_NORM}, the "
        f"step is the intended one (relative difference {err:.3e})"
    )


# --- validation, without a launch -------------------------------------------------------------


def _run(**changes) -> BugRun:
    fields = dict(
        pattern="stale-count", framework="torch", fixture="ragged", world_size=2, accum_steps=1
    )
    return BugRun(**{**fields, **changes})


@pytest.mark.parametrize(
    ("bug_run", "message"),
    [
        (_run(pattern="no-such-bug"), "unknown bug pattern 'no-such-bug'"),
        (_run(framework="jax"), "framework 'jax'"),
        (_run(fixture="no-such-fixture"), "unknown fixture 'no-such-fixture'"),
        (_run(world_size=5), "144 rows of fixture 'ragged' cannot be laid out"),
        (_run(skew=1.5), "skew applies to rank-skew only"),
        (_run(dtype="float16"), "dtype must be one of"),
    ],
)
def test_runs_that_cannot_launch_fail_by_name(bug_run: BugRun, message: str) -> None:
    result = torch_bugs.run([bug_run])[bug_run]
    assert isinstance(result, ValueError)
    assert message in str(result) and bug_run.describe() in str(result)


def _step(**changes):
    from torch_impl.harness.bugs import BugStep

    fixture = builtin_fixture("packed")
    fields = dict(
        label="packed step",
        pattern="stale-count",
        batch={k: getattr(fixture, k) for k in ("inputs", "targets", "segment_ids", "weights")},
        params=fixture.params(),
        accum_steps=2,
    )
    return BugStep(**{**fields, **changes})


def test_rank_side_validation_names_what_and_where() -> None:
    from torch_impl.batch import BatchError
    from torch_impl.harness.bugs import validate_step

    with pytest.raises(ValueError, match="packed step: unknown bug pattern 'nope'"):
        validate_step(_step(pattern="nope"), 0, 2)
    with pytest.raises(BatchError, match=r"packed step: .*8 rows .* world_size=3"):
        validate_step(_step(), 0, 3)
    step = _step()
    targets = np.array(step.batch["targets"])
    targets[6, 3] = 99  # global row 6: rank 1's second microbatch at R = 2, M = 2
    bad = _step(batch={**step.batch, "targets": targets})
    # Rank 0 fails on rank 1's token too: every rank must skip the step together.
    with pytest.raises(BatchError, match=r"rank 1, microbatch 1, row 0 \(global row 6\)"):
        validate_step(bad, 0, 2)
    assert len(validate_step(step, 1, 2)) == 2
    # Contract v2's row fields travel with the batch, and reach the microbatches; a key
    # that is neither a token array nor a v2 field is refused by name.
    groups = np.arange(8) // 3
    (first, _) = validate_step(_step(batch={**step.batch, "group_ids": groups}), 1, 2)
    assert first.group_ids.tolist() == groups[4:6].tolist()
    with pytest.raises(ValueError, match=r"packed step: batch must hold .*'labels'"):
        validate_step(_step(batch={**step.batch, "labels": targets}), 0, 2)


def test_a_rank_with_another_gradient_is_named() -> None:
    from torch_impl.harness.bugs import BugStepResult, RankDisagreementError, check_ranks_agree

    grads = builtin_fixture("packed").params()
    other = {k: v.copy() for k, v in grads.items()}
    other["unembed"][2, 5] += 1e-15
    per_rank = [
        BugStepResult("step", 0, grads, 1.0),
        BugStepResult("step", 1, grads, 2.0),
        BugStepResult("step", 2, other, 1.0),
    ]
    with pytest.raises(RankDisagreementError, match=r"step: rank 2 .* unembed .* \[2, 5\]"):
        check_ranks_agree(per_rank)
    assert check_ranks_agree(per_rank[:2]) is per_rank[0]
