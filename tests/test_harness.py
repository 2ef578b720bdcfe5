"""The harness's judgement: rows from outputs, with outputs whose truth is known.

Outputs built from the oracle itself must pass; the same outputs with one token's weight, the
scale or a logged count changed must fail, naming what is wrong. The implementations' own
outputs go through the same functions in test_matrix.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from case_fields import make_case

from crosscheck.contract.cases import Case, CaseOutput, RankMetrics, TrainSettings
from crosscheck.fixtures.builtin import builtin_fixture
from crosscheck.judge.clipping import clip_placement
from crosscheck.run.rows import (
    compare_with_oracle,
    cross_implementation,
    failed_case,
    oracle_run,
    world_size_change,
)

SETTINGS = TrainSettings()


def oracle_output(case: Case, scale: float = 1.0) -> CaseOutput:
    """What a perfect implementation would return, its gradient optionally scaled."""
    records = oracle_run(case, SETTINGS)
    first = records[0].result
    metrics = [
        RankMetrics(
            rank=r,
            update=0,
            valid_tokens=int(first.rank_valid_tokens[r]),
            loss_sum=float(first.rank_loss_sums[r]),
            denominator=first.denominator,
            objective=first.loss,
            grad_norm=records[0].grad_norm,
            clipped_grad_norm=records[0].clipped_grad_norm,
        )
        for r in range(case.world_size)
    ]
    grads = {k: v * scale for k, v in first.grads.items()}
    return CaseOutput(grads=grads, params=[r.params for r in records], metrics=metrics)


def case(**overrides) -> Case:
    """torch-ddp on packed, token_mean, precount, R = M = 2, float64, unless overridden."""
    return make_case(**overrides)


def test_a_perfect_output_passes_with_zero_error():
    row = compare_with_oracle(case(), oracle_output(case()), SETTINGS)
    assert row.ok and row.max_rel_err == 0.0 and row.detail == ""


def test_a_scaled_gradient_fails_and_names_the_leaf():
    # 1 + 1e-9 is 1e4 times the float64 tolerance: a scale error that small is still caught
    row = compare_with_oracle(case(), oracle_output(case(), scale=1 + 1e-9), SETTINGS)
    assert not row.ok
    assert "relative error" in row.detail and ("embed" in row.detail)


def test_a_nan_never_passes():
    output = oracle_output(case())
    output.grads["unembed"][0, 0] = np.nan
    row = compare_with_oracle(case(), output, SETTINGS)
    assert not row.ok and row.max_rel_err == float("inf")
    assert row.to_json()["max_rel_err"] is None


def test_a_wrong_logged_count_fails_naming_the_rank():
    output = oracle_output(case())
    bad = output.metrics[1]._replace(valid_tokens=output.metrics[1].valid_tokens + 1)
    output.metrics[1] = bad
    row = compare_with_oracle(case(), output, SETTINGS)
    assert not row.ok and "rank 1 logged" in row.detail


def test_float32_cases_get_the_float32_tolerance():
    c = case(dtype="float32")
    assert compare_with_oracle(c, oracle_output(c, scale=1 + 1e-7), SETTINGS).ok
    assert not compare_with_oracle(c, oracle_output(c, scale=1 + 1e-4), SETTINGS).ok


def test_accidental_rows_report_their_deviation_from_the_token_mean():
    c = case(fixture="seed", scheme="rank_mean", strategy="naive", accum_steps=1)
    row = compare_with_oracle(c, oracle_output(c), SETTINGS)
    assert row.ok and row.deviation is not None and row.deviation > 0.5
    assert row.weight_ratio == pytest.approx(9.0, rel=1e-12)


def test_a_failed_case_is_a_failed_row_with_the_error():
    row = failed_case(case(), RuntimeError("rank 1 raised: boom"))
    assert not row.ok and "rank 1 raised" in row.detail


def test_cross_implementation_finds_the_disagreeing_pair():
    good, other = case(impl="jax-pmap"), case()
    outputs = {good: oracle_output(good), other: oracle_output(other, scale=1.001)}
    (row,) = cross_implementation(outputs)
    assert not row.ok and row.max_rel_err == pytest.approx(1e-3, rel=1e-2)
    outputs[other] = oracle_output(other)
    assert cross_implementation(outputs)[0].ok


def test_world_size_change_separates_intended_from_accidental():
    outputs = {}
    for scheme, strategy in (("token_mean", "precount"), ("rank_mean", "naive")):
        for R, M in ((1, 4), (2, 2), (4, 1)):
            if scheme == "rank_mean" and M != 1 and R != 1:
                continue
            c = case(
                fixture="ragged", scheme=scheme, strategy=strategy, world_size=R, accum_steps=M
            )
            outputs[c] = oracle_output(c)
    rows = {r.scheme: r for r in world_size_change(outputs, [((1, 4), (2, 2), (4, 1))])}
    assert rows["token_mean"].ok and rows["token_mean"].max_rel_err <= 1e-12
    assert rows["rank_mean"].ok and rows["rank_mean"].max_rel_err > 1e-3  # shown, not failed
    # The weight ratio of a row over several layouts is its scheme's at the worst of them, the
    # figure the vs-oracle rows give at each (not a default 1 for an accidental scheme).
    at_each = {
        layout: compare_with_oracle(c, oracle_output(c), SETTINGS).weight_ratio
        for c in outputs
        if c.scheme == "rank_mean"
        for layout in [(c.world_size, c.accum_steps)]
    }
    assert rows["rank_mean"].weight_ratio == max(at_each.values()) > 1.5, at_each
    assert rows["token_mean"].weight_ratio == 1
    (cross,) = cross_implementation(
        {c: oracle_output(c) for c in (case(fixture="seed", scheme="rank_mean", strategy="naive",
         accum_steps=1), case(fixture="seed", scheme="rank_mean", strategy="naive",
         accum_steps=1, impl="jax-pmap"))}
    )  # fmt: skip
    assert cross.weight_ratio == pytest.approx(9.0, rel=1e-12)


def test_clipping_per_microbatch_differs_exactly_when_a_norm_exceeds_the_threshold():
    fixture = builtin_fixture("seed")
    active = clip_placement(fixture, "token_mean", 1, 2, 0.15)
    assert active.ok and active.max_rel_err > 0.01
    assert max(active.extra["microbatch_norms"]) > 0.15
    idle = clip_placement(fixture, "token_mean", 1, 2, 1.0)
    assert idle.ok and idle.max_rel_err == 0.0
