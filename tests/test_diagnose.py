"""Diagnosis on oracle-made gradients: no false alarm, every pattern named, refusals."""

from __future__ import annotations

import numpy as np
import pytest

from crosscheck.contract.fixture import Fixture
from crosscheck.contract.oracle import loss_and_grad, weighted_grad
from crosscheck.contract.schemes import INTENDED_SCHEMES, resolve_scheme
from crosscheck.diagnosis import candidates
from crosscheck.diagnosis.diagnose import AMBIGUOUS, CONDITION_LIMIT, UNKNOWN, diagnose
from crosscheck.diagnosis.explain import guide
from crosscheck.diagnosis.patterns import (
    CLIP_PER_MICROBATCH_NORM,
    PATTERNS,
    PIPELINE_STAGE_PARAMS,
)
from crosscheck.fixtures.builtin import BUILTIN_FIXTURES, builtin_fixture
from crosscheck.judge.compare import FLOAT32_RTOL, FLOAT64_RTOL


def _grad(fixture: Fixture, weights: np.ndarray) -> dict[str, np.ndarray]:
    return weighted_grad(fixture.params(), fixture.inputs, fixture.targets, weights)


def test_seed_rank_mean_is_named_with_ratio_nine():
    fixture = builtin_fixture("seed")
    grads = loss_and_grad(fixture, "rank_mean", 2, 1).grads
    d = diagnose(fixture, 2, 1, grads, "token_mean")
    assert d.best_match == "rank-mean"
    assert d.detected
    assert abs(d.weight_ratio - 9.0) <= 1e-9
    assert "rank 0 weigh 9.0x tokens on rank 1" in d.explanation
    assert d.well_posed and d.residual < 1e-12


@pytest.mark.parametrize("fixture_name", list(BUILTIN_FIXTURES))
@pytest.mark.parametrize("scheme", INTENDED_SCHEMES)
def test_intended_gradient_is_not_a_false_alarm(fixture_name, scheme):
    fixture = builtin_fixture(fixture_name)
    for R, M in fixture.valid_layouts():
        if R * M > 8:
            continue
        grads = loss_and_grad(fixture, scheme, R, M).grads
        d = diagnose(fixture, R, M, grads, scheme, max_grad_norm=CLIP_PER_MICROBATCH_NORM)
        where = f"{fixture_name} {scheme} R={R} M={M}"
        assert d.best_match == scheme, where
        assert not d.detected, where
        assert abs(d.scale - 1.0) <= FLOAT64_RTOL, where
        assert d.precision == "float64" and d.residual <= FLOAT64_RTOL, where
        # The weight ratio is against the intended weights: 1 for a correct step, whatever
        # the scheme's own spread (row_mean's is 23 on packed). 1e-9: the recovered weights
        # of a float64 gradient are exact to ~1e-14 (condition number < 10).
        assert abs(d.weight_ratio - 1) <= 1e-9, where
        # Fixtures are built so that the group weights are identifiable.
        assert d.well_posed and d.condition_number < 10, where


#: Context-parallel layouts (R, M, C, order) of the 8 x 64 fixtures: both orders, C = 2 and 4.
CONTEXT_LAYOUTS = ((1, 1, 2, "contiguous"), (2, 1, 2, "zigzag"), (1, 2, 4, "zigzag"))


@pytest.mark.parametrize("fixture_name", ["packed", "multimodal", "rollouts"])
@pytest.mark.parametrize("scheme", INTENDED_SCHEMES)
def test_intended_gradient_under_context_parallel_is_not_a_false_alarm(fixture_name, scheme):
    """Split into context ranks' parts, the groups of a correct gradient still all weigh as
    intended: nothing is detected, and no context-parallel pattern is named."""
    fixture = builtin_fixture(fixture_name)
    for R, M, C, order in CONTEXT_LAYOUTS:
        grads = loss_and_grad(fixture, scheme, R, M).grads
        d = diagnose(fixture, R, M, grads, scheme, context_size=C, context_order=order)
        where = f"{fixture_name} {scheme} R={R} M={M} C={C} {order}"
        assert d.best_match == scheme and not d.detected, (where, d.matches)
        assert abs(d.scale - 1.0) <= FLOAT64_RTOL, where
        # As above: the recovered weights of a float64 gradient are exact to ~1e-14.
        assert abs(d.weight_ratio - 1) <= 1e-9, where
        assert d.well_posed, where


def _prediction(pattern: str, fixture: Fixture, R: int, M: int, C: int = 1, order: str = ""):
    """The oracle-side prediction of a pattern at a layout (what a faithful bug produces)."""
    spec = PATTERNS[pattern]
    scheme = resolve_scheme(spec.intended)
    batch = fixture.layout(R, M)
    w = batch.to_global(scheme.effective_weights(batch))
    D = scheme.global_denominator(batch)
    if C > 1:
        context_batch = fixture.layout(R, M, C, order)
        pool = candidates.context_candidates(scheme, context_batch)
        (match,) = [c for c in pool if c.name == pattern]
        return match.weights, match.logged_denominator, D
    if pattern == "pp-unsent-count":  # the weights are right; the stages are not
        return w, D, D
    if pattern == "local-group-count":
        (match,) = [c for c in candidates.local_mean_candidates(scheme, batch) if c.name == pattern]
        return match.weights, match.logged_denominator, D
    if pattern == "zero-count-nan":  # 0/0 on the empty microbatch: NaN reaches every token
        return np.full(w.shape, np.nan), None, D
    if pattern == "float32-count":
        D32 = float(
            np.float32(np.where(fixture.valid, fixture.weights, 0).astype(np.float32).sum())
        )
        return w * (D / D32), D32, D
    pool = candidates.local_mean_candidates(scheme, batch)
    pool += candidates.scale_candidates(scheme, fixture, batch, w, (D,))
    pool += candidates.clip_candidates(
        lambda weights: _grad(fixture, weights), batch, w, CLIP_PER_MICROBATCH_NORM
    )
    match = [c for c in pool if c.name == pattern][-1]  # the torch clipping convention
    return match.weights, match.logged_denominator, D


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_catalogue_layouts_name_each_pattern_uniquely(pattern):
    for run in PATTERNS[pattern].runs:
        fixture = builtin_fixture(run.fixture)
        C, order = run.context_size, run.context_order
        weights, logged, D = _prediction(
            pattern, fixture, run.world_size, run.accum_steps, C, order
        )
        grads = _grad(fixture, weights)
        stages = PIPELINE_STAGE_PARAMS if run.pipeline_stages > 1 else ()
        if stages:  # every stage before the last keeps the unnormalized sum: D x its gradient
            grads = {k: v * (D if k in stages[0] else 1.0) for k, v in grads.items()}
        d = diagnose(
            fixture,
            run.world_size,
            run.accum_steps,
            grads,
            PATTERNS[pattern].intended,
            pipeline_stages=stages,
            logged_denominator=logged,
            previous_denominators=(D,),
            max_grad_norm=CLIP_PER_MICROBATCH_NORM,
            context_size=C,
            context_order=order,
        )
        assert d.detected, (pattern, str(run))
        assert d.best_match == pattern, (pattern, str(run), d.matches, d.explanation)
        assert pattern in d.explanation or pattern.endswith("-mean")


def test_same_gradient_without_its_log_is_ambiguous():
    fixture = builtin_fixture("packed")
    grads = _grad(fixture, loss_and_grad(fixture, "token_mean", 4, 1).token_weights / 4)
    d = diagnose(fixture, 4, 1, grads, "token_mean")
    assert d.best_match == AMBIGUOUS
    assert set(d.matches) == {"missing-world-size", "double-reduce-count"}
    assert "logged denominator" in d.explanation
    D = float(fixture.valid.sum())
    assert diagnose(fixture, 4, 1, grads, "token_mean", logged_denominator=D).best_match == (
        "missing-world-size"
    )
    named = diagnose(fixture, 4, 1, grads, "token_mean", logged_denominator=4 * D)
    assert named.best_match == "double-reduce-count"


def test_unknown_distortion_is_reported_with_its_weights():
    fixture = builtin_fixture("ragged")
    result = loss_and_grad(fixture, "token_mean", 2, 2)
    weights = result.token_weights.copy()
    weights[5] *= 3.0  # one row triples: no known pattern does that
    d = diagnose(fixture, 2, 2, _grad(fixture, weights), "token_mean")
    assert d.detected and d.best_match == UNKNOWN
    assert "No known scheme, pattern or reweighting family fits" in d.explanation
    assert abs(d.weight_ratio - 3.0) <= 1e-9 and d.residual < 1e-12
    heavy = [g for g in d.groups if g.row == 5]
    assert heavy and all(abs(g.weight / g.intended - 3.0) <= 1e-9 for g in heavy)


def test_gradient_at_other_params_leaves_a_residual():
    fixture = builtin_fixture("packed")
    params = fixture.params()
    params["unembed"] = params["unembed"] * 1.1
    grads = weighted_grad(params, fixture.inputs, fixture.targets, fixture.valid / 231.0)
    d = diagnose(fixture, 2, 1, grads, "token_mean")
    assert d.best_match == UNKNOWN and d.residual > 1e-3
    assert "not a per-document reweighting" in d.explanation
    assert "the model or the params differ" in d.explanation


def test_nan_never_passes():
    fixture = builtin_fixture("packed")
    grads = loss_and_grad(fixture, "token_mean", 2, 1).grads
    grads["embed"] = grads["embed"].copy()
    grads["embed"][0, 0] = np.nan
    d = diagnose(fixture, 2, 1, grads, "token_mean")
    assert d.detected and d.best_match == UNKNOWN
    assert "NaN or inf" in d.explanation


def _nan_at(grads: dict[str, np.ndarray], value: float = np.nan) -> dict[str, np.ndarray]:
    grads = {k: v.copy() for k, v in grads.items()}
    grads["unembed"][0, 0] = value
    return grads


def test_nan_on_a_layout_with_an_empty_microbatch_is_zero_count_nan():
    """rollouts at (4, 2): row 5, alone in rank 2's microbatch 1, has no valid target."""
    fixture = builtin_fixture("rollouts")
    grads = _nan_at(loss_and_grad(fixture, "token_mean", 4, 2).grads)
    d = diagnose(fixture, 4, 2, grads, "token_mean")
    assert d.detected and d.best_match == "zero-count-nan" and d.matches == ("zero-count-nan",)
    assert "rank 2 microbatch 1 has no token that token_mean counts" in d.explanation
    assert d.fix == f"{PATTERNS['zero-count-nan'].fix} ({guide(['zero-count-nan'], None)})"
    # inf is as non-finite as NaN; a whole empty rank is named as the rank.
    empty = builtin_fixture("empty-rank")
    grads = _nan_at(loss_and_grad(empty, "token_mean", 2, 2).grads, np.inf)
    d = diagnose(empty, 2, 2, grads, "token_mean")
    assert d.best_match == "zero-count-nan"
    assert "rank 1 (all 2 microbatches)" in d.explanation


def test_nan_without_an_empty_unit_or_a_huge_entry_is_not_zero_count_nan():
    """Only a non-finite gradient on a layout with an empty unit is named; the intended
    gradient of the same layout still passes (no verdict on a finite gradient moves)."""
    fixture = builtin_fixture("rollouts")
    grads = loss_and_grad(fixture, "token_mean", 2, 2).grads  # no empty microbatch at (2, 2)
    assert diagnose(fixture, 2, 2, _nan_at(grads), "token_mean").best_match == UNKNOWN
    correct = loss_and_grad(fixture, "token_mean", 4, 2).grads
    assert not diagnose(fixture, 4, 2, correct, "token_mean").detected
    huge = diagnose(fixture, 4, 2, _nan_at(correct, 1e200), "token_mean")
    assert huge.detected and huge.best_match == UNKNOWN
    # sum has no denominator: no local mean of it divides by 0.
    summed = loss_and_grad(fixture, "sum", 4, 2).grads
    assert diagnose(fixture, 4, 2, _nan_at(summed), "sum").best_match == UNKNOWN


def test_indistinguishable_groups_are_reported_as_ill_posed():
    base = builtin_fixture("packed")
    inputs, targets = base.inputs.copy(), base.targets.copy()
    segments = base.segment_ids.copy()
    # Rows 0 and 4 become the same single token: their weights cannot be told apart.
    for row in (0, 4):
        inputs[row], targets[row], segments[row] = 3, -100, 0
        inputs[row, 0], targets[row, 0], segments[row, 0] = 3, 7, 1
    fixture = Fixture(
        name="twins",
        description="two identical one-token rows",
        inputs=inputs,
        targets=targets,
        segment_ids=segments,
        weights=base.weights,
        embed=base.embed,
        unembed=base.unembed,
    )
    grads = loss_and_grad(fixture, "token_mean", 2, 1).grads
    d = diagnose(fixture, 2, 1, grads, "token_mean")
    assert d.condition_number > CONDITION_LIMIT and not d.well_posed
    assert "not identifiable" in d.explanation
    assert d.best_match == "token_mean"  # naming compares whole gradients, still fine


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_one_percent_rank_skew_is_flagged(dtype):
    fixture = builtin_fixture("ragged")
    result = loss_and_grad(fixture, "token_mean", 2, 1)
    weights = result.token_weights.copy()
    weights[: fixture.num_rows // 2] *= 1.01
    grads = _grad(fixture, weights)
    if dtype == "float32":  # what a float32 implementation could at best return
        grads = {k: v.astype(np.float32) for k, v in grads.items()}
    d = diagnose(fixture, 2, 1, grads, "token_mean", dtype=dtype)
    tolerance = FLOAT32_RTOL if dtype == "float32" else FLOAT64_RTOL
    assert d.detected and d.intended_error > 100 * tolerance
    assert d.precision == dtype
    # No catalogued pattern makes a 1.01x rank: the rank-skew family names it, with its factor.
    assert d.best_match == "rank-skew", d.explanation
    assert "okens on rank 0 weigh 1.010000x tokens on rank 1" in d.explanation
    # float32 rounding of the gradient moves a recovered weight by ~1e-7 (noise 6e-8 here).
    assert abs(d.weight_ratio - 1.01) <= (1e-9 if dtype == "float64" else 1e-6)


@pytest.mark.parametrize("name", ["dedup-seed", "dedup-packed"])
def test_dedup_fixtures_count_past_float32(name):
    fixture = builtin_fixture(name)
    multiplicities = fixture.weights[fixture.valid]
    total = int(multiplicities.sum())
    assert total > 2**24 and total % 2 == 1  # no float32 number equals it
    assert float(np.float32(total)) != total
    assert multiplicities.max() < 2**24 and np.all(multiplicities == np.round(multiplicities))
    assert not np.any(fixture.weights[~fixture.valid])


def _microstep_mean(fixture: Fixture, R: int, M: int) -> np.ndarray:
    """v_t / (M n_m), n_m the valid targets of t's microbatch index over every rank: numpy
    from the counts, not from crosscheck.diagnosis.candidates."""
    valid = fixture.valid.astype(np.float64)
    B = fixture.num_rows // (R * M)
    step_of_row = (np.arange(fixture.num_rows) // B) % M  # rank-major microbatches of B rows
    per_step = np.array([valid[step_of_row == m].sum() for m in range(M)])
    denominator = (M * per_step)[step_of_row][:, None]
    return np.where(denominator > 0, valid / np.maximum(denominator, 1.0), 0.0)


def test_microstep_mean_is_named_only_where_no_other_name_predicts_it():
    """On every fixture and layout: the intended token mean at M = 1 or where every global
    microbatch holds the same count, microbatch-mean at R = 1 or where every rank of each
    microbatch holds the same count (one gradient there; the older name is kept), and
    microstep-mean everywhere else, which at R, M > 1 with unequal counts is most
    fixtures."""
    named = 0
    for fixture_name in BUILTIN_FIXTURES:
        fixture = builtin_fixture(fixture_name)
        for R, M in fixture.valid_layouts():
            if R * M > 8:
                continue
            counts = fixture.valid.reshape(R, M, -1).sum(axis=2)
            grads = _grad(fixture, _microstep_mean(fixture, R, M))
            d = diagnose(fixture, R, M, grads, "token_mean")
            where = (fixture_name, R, M, counts.tolist(), d.matches)
            per_step = counts.sum(axis=0)
            if np.any(per_step == 0):
                # A microbatch without a token anywhere: the others' mean, a plain 1/M
                # (empty-rank at R = 1), which the catalogue leaves to the scale patterns.
                assert "microstep-mean" not in d.matches, where
            elif M == 1 or np.all(per_step == per_step[0]):
                assert d.best_match == "token_mean", where
            elif R == 1 or np.all(counts == counts[:1]):
                assert d.best_match == "microbatch-mean", where
                assert "microstep-mean" in d.fits, where  # degenerate: it fits
            else:
                assert d.best_match == "microstep-mean", where
                assert "Tokens on microbatch" in d.explanation and "every rank" in d.explanation
                assert d.fix.startswith(PATTERNS["microstep-mean"].fix)
                named += 1
    assert named >= 10


def test_microbatch_mean_is_never_renamed_microstep_mean():
    """The per-rank pattern keeps its name on every fixture and layout where it was named."""
    for fixture_name in BUILTIN_FIXTURES:
        fixture = builtin_fixture(fixture_name)
        for R, M in fixture.valid_layouts():
            if R * M > 8 or M == 1:
                continue
            grads = loss_and_grad(fixture, "microbatch_mean", R, M).grads
            d = diagnose(fixture, R, M, grads, "token_mean")
            assert "microstep-mean" not in d.matches, (fixture_name, R, M, d.matches)
