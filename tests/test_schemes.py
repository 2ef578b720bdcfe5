"""The normalization contract: a_t and d of every scheme, and its effective weights."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from crosscheck.contract.layout import IGNORE_INDEX, Layout, Microbatch, lay_out
from crosscheck.contract.schemes import (
    ACCIDENTAL_SCHEMES,
    DEFINITIONS,
    INTENDED_SCHEMES,
    MEAN_SCHEMES,
    SCHEMES,
    Constant,
    effective_weights,
    get_scheme,
)
from crosscheck.fixtures.builtin import BUILTIN_FIXTURES, builtin_fixture, random_fixture

X = IGNORE_INDEX
# Row 0 packs two documents (2 valid targets each) and ends in padding; row 1 is one
# document with 3 valid targets and 2 padding slots.
HAND_MICROBATCH = Microbatch(
    inputs=np.zeros((2, 6), dtype=np.int32),
    targets=np.array([[3, 4, X, 5, 6, X], [7, X, 8, 9, X, X]], dtype=np.int32),
    segment_ids=np.array([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 0, 0]], dtype=np.int32),
    weights=np.array([[0.5, 2.0, 9.0, 1.5, 0.0, 9.0], [0.25, 9.0, 1.0, 3.0, 9.0, 9.0]]),
)
HAND_EXPECTED = {
    # scheme: (a_t, d)
    "token_mean": ([[1, 1, 0, 1, 1, 0], [1, 0, 1, 1, 0, 0]], 7.0),
    "sequence_mean": ([[1 / 2, 1 / 2, 0, 1 / 2, 1 / 2, 0], [1 / 3, 0, 1 / 3, 1 / 3, 0, 0]], 3.0),
    "row_mean": ([[1 / 4, 1 / 4, 0, 1 / 4, 1 / 4, 0], [1 / 3, 0, 1 / 3, 1 / 3, 0, 0]], 2.0),
    "weighted_mean": ([[0.5, 2.0, 0, 1.5, 0.0, 0], [0.25, 0, 1.0, 3.0, 0, 0]], 8.25),
    "constant": ([[1, 1, 0, 1, 1, 0], [1, 0, 1, 1, 0, 0]], 12.0),
    # The token mean at microbatch scope: each microbatch its own D_u (v1 wrote it as
    # a_t = v_t / 7, d = 1: the same c_t).
    "microbatch_mean": ([[1, 1, 0, 1, 1, 0], [1, 0, 1, 1, 0, 0]], 7.0),
}


@pytest.mark.parametrize("name", sorted(HAND_EXPECTED))
def test_token_weight_and_denominator_by_hand(name):
    """a_t, the microbatch's own D and c_t = a_t / D of the one microbatch, by hand (v1's
    per-microbatch methods are gone: the spec's arrays are read instead)."""
    mb = HAND_MICROBATCH
    batch = lay_out(mb.inputs, mb.targets, mb.segment_ids, mb.weights, Layout(1, 1))
    scheme = get_scheme(name)
    expected_a, expected_d = HAND_EXPECTED[name]
    np.testing.assert_array_equal(scheme.token_weights(batch)[0, 0], np.array(expected_a))
    assert replace(scheme, scope="microbatch").unit_denominators(batch) == [expected_d]
    c = np.array(expected_a) / expected_d
    np.testing.assert_array_equal(effective_weights(name, batch), c)


def test_sum_has_unit_denominator_and_constant_takes_an_explicit_normalizer():
    batch = builtin_fixture("packed").layout(2, 2)
    assert get_scheme("sum").global_denominator(batch) == 1.0
    assert get_scheme("constant").global_denominator(batch) == 8 * 64
    assert Constant(4096.0).global_denominator(batch) == 4096.0
    with pytest.raises(ValueError, match="must be > 0"):
        Constant(0.0)


def test_scheme_tables_match_the_design():
    assert INTENDED_SCHEMES == (
        "token_mean",
        "sequence_mean",
        "row_mean",
        "weighted_mean",
        "constant",
        "sum",
    )
    assert ACCIDENTAL_SCHEMES == ("rank_mean", "microbatch_mean")
    for name in SCHEMES:
        assert len(DEFINITIONS[name]) > 60 and ":math:" in DEFINITIONS[name], name


def test_unknown_scheme_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown scheme 'token-mean'.*token_mean"):
        get_scheme("token-mean")


def test_seed_rank_mean_weighs_the_short_rank_exactly_nine_times():
    seed = builtin_fixture("seed")
    batch = seed.layout(2, 1)
    rank_mean = effective_weights("rank_mean", batch)
    token_mean = effective_weights("token_mean", batch)
    short, long = rank_mean[0][seed.valid[0]], rank_mean[1][seed.valid[1]]
    assert np.unique(short).size == 1 and np.unique(long).size == 1
    assert short[0] / long[0] == 9.0
    assert short[0] == 1 / 200 and long[0] == 1 / 1800
    assert np.all(token_mean[seed.valid] == 1 / 1000)
    # At M = 1 a microbatch is a rank: the two accidental schemes coincide.
    assert np.array_equal(effective_weights("microbatch_mean", batch), rank_mean)


@pytest.mark.parametrize("fixture_name", list(BUILTIN_FIXTURES))
@pytest.mark.parametrize("scheme_name", MEAN_SCHEMES)
def test_mean_scheme_weights_sum_to_one(fixture_name, scheme_name):
    fixture = builtin_fixture(fixture_name)
    for R, M in fixture.valid_layouts():
        batch = fixture.layout(R, M)
        weights = effective_weights(scheme_name, batch)
        assert np.isfinite(weights).all()
        if scheme_name == "rank_mean" and (batch.valid.sum(axis=(1, 2, 3)) == 0).any():
            continue  # an empty rank's 1/R share is missing: the accidental scheme's flaw
        if scheme_name == "microbatch_mean" and (batch.valid.sum(axis=(2, 3)) == 0).any():
            continue
        # fsum is correctly rounded: the only error is in the weights themselves, one
        # rounding each, so the sum is within a few thousand ulps of 1.
        assert abs(np.sum(weights, dtype=np.float64) - 1.0) <= 1e-12, (R, M)


@pytest.mark.parametrize("scheme_name", list(SCHEMES))
def test_weights_vanish_on_ignored_tokens_and_empty_ranks(scheme_name):
    fixture = builtin_fixture("empty-rank")
    for R, M in fixture.valid_layouts():
        weights = effective_weights(scheme_name, fixture.layout(R, M))
        assert np.isfinite(weights).all()
        assert not weights[~fixture.valid].any()
        assert not weights[4:].any()  # rows 4..7 carry no valid target


@pytest.mark.parametrize("scheme_name", list(SCHEMES))
def test_no_valid_token_anywhere_gives_zero_weights(scheme_name):
    fixture = random_fixture(3, 4, 8, ignore_fraction=1.0)
    assert fixture.num_valid_tokens == 0
    weights = effective_weights(scheme_name, fixture.layout(2, 2))
    assert np.isfinite(weights).all() and not weights.any()


def test_accidental_schemes_depend_on_the_layout_and_intended_ones_do_not():
    fixture = builtin_fixture("ragged")
    for name in SCHEMES:
        by_layout = [effective_weights(name, fixture.layout(R, M)) for R, M in [(1, 1), (4, 1)]]
        same = np.array_equal(*by_layout)
        assert same == get_scheme(name).intended, name
