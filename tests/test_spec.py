"""The numpy reading of scheme specs (crosscheck.contract.spec) against the reader and by hand.

v1's names, as the catalogue's specs, give what an independent reader computes; each
trainer mode is checked on a hand-built batch whose weights are worked out in the test; every
layout-invariant spec gives one weight vector for every layout of the v2 fixtures, and the
same spec with its group count taken inside a microbatch or rank does not.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from mixed_alpha_specs import MIXED_ALPHA_SPECS, reader_weights

from crosscheck.contract.fixture import NPZ_KEYS, Fixture, FixtureError
from crosscheck.contract.layout import IGNORE_INDEX
from crosscheck.contract.oracle import loss_and_grad, weighted_grad
from crosscheck.contract.schemes import SCHEMES, resolve_scheme
from crosscheck.contract.spec import SchemeSpec, get_spec
from crosscheck.contract.spec_catalogue import known_spec_names
from crosscheck.fixtures.builtin import _known_names, builtin_fixture

X = IGNORE_INDEX


def _hand_fixture(targets, **fields) -> Fixture:
    """A 4-row batch with the given targets (X = ignored), one segment per non-padding run."""
    targets = np.array(targets)
    segments = np.where(targets == X, 0, 1)
    segments[:, 0] = 1  # the first position of every row is a real (prompt) token
    rng = np.random.default_rng(0)
    return Fixture(
        name="hand",
        description="",
        inputs=np.zeros_like(targets),
        targets=targets,
        segment_ids=segments,
        weights=np.ones(targets.shape),
        embed=rng.standard_normal((5, 3)),
        unembed=rng.standard_normal((3, 5)),
        **fields,
    )


def _weights(fixture: Fixture, scheme, R: int = 1, M: int = 1) -> np.ndarray:
    batch = fixture.layout(R, M)
    return batch.to_global(get_spec(scheme).effective_weights(batch))


@pytest.mark.parametrize("fixture_name", _known_names())
def test_v1_names_give_what_the_independent_reader_reads_in_their_specs(fixture_name: str) -> None:
    """v1's eight names are catalogue specs. Until v1's scheme classes were folded into them
    this test held the two to the same bits (the exported vectors did not change by a bit);
    now each name's weights are held to tests/spec_reader.py's reading of its spec."""
    fixture = builtin_fixture(fixture_name)
    for R, M in fixture.valid_layouts(4, 2):
        for name in [*SCHEMES, "constant:4096"]:
            want = reader_weights(fixture, name, R, M)
            got = _weights(fixture, name, R, M)
            # Counts are exact; weight sums are fsum'd in both: a few float64 ulps at most.
            assert np.max(np.abs(got - want)) <= 1e-12 * np.max(np.abs(want)), (R, M, name)


# Group 0 holds rows 0, 1 and 3 (2 + 3 + 2 valid tokens), group 1 row 2 (1 token).
GROUPS = [[1, 1, X, X], [1, 1, 1, X], [1, X, X, X], [1, 1, X, X]]


def test_group_token_mean_counts_each_group_over_the_whole_update() -> None:
    fixture = _hand_fixture(GROUPS, group_ids=np.array([0, 0, 1, 0]))
    valid = fixture.targets != X
    expected = np.where(valid, 1 / 7 / 2, 0.0)  # group 0: 7 tokens, 2 groups
    expected[2] = np.where(valid[2], 1 / 1 / 2, 0.0)
    for R, M in [(1, 1), (2, 1), (2, 2), (4, 1)]:
        np.testing.assert_array_equal(_weights(fixture, "group_token_mean", R, M), expected)


def test_a_group_count_taken_per_rank_is_not_the_group_count() -> None:
    fixture = _hand_fixture(GROUPS, group_ids=np.array([0, 0, 1, 0]))
    local = {
        "weight": {"group": "group", "count_scope": "rank"},
        "denominator": {"kind": "groups", "group": "group"},
    }
    one_rank = _weights(fixture, local, 1, 1)
    two_ranks = _weights(fixture, local, 2, 1)
    # At R = 2 rank 1 sees 2 of group 0's 7 tokens: its row 3 tokens weigh 1/2/2, not 1/7/2.
    assert two_ranks[3, 0] == 1 / 2 / 2 and one_rank[3, 0] == 1 / 7 / 2
    assert not SchemeSpec.from_dict(local).layout_invariant


def test_all_rows_mean_counts_the_fully_masked_row_and_row_mean_does_not() -> None:
    fixture = _hand_fixture([[1, 1, X, X], [1, X, X, X], [X, X, X, X], [1, 1, 1, 1]])
    valid = fixture.targets != X
    n_row = valid.sum(axis=1, keepdims=True)
    per_row = np.where(valid, 1 / np.maximum(n_row, 1), 0.0)
    np.testing.assert_array_equal(_weights(fixture, "all_rows_mean", 2, 2), per_row / 4)
    np.testing.assert_array_equal(_weights(fixture, "row_mean", 2, 2), per_row / 3)


def test_configured_rows_sample_mask_and_zero_variance_modes_by_hand() -> None:
    fixture = _hand_fixture(GROUPS, sample_mask=np.array([1, 0, 1, 1]))
    valid = fixture.targets != X
    n_row = valid.sum(axis=1, keepdims=True)
    per_row = np.where(valid, 1 / n_row, 0.0)
    np.testing.assert_array_equal(_weights(fixture, "configured_rows_mean:6", 2, 1), per_row / 6)
    np.testing.assert_array_equal(_weights(fixture, "configured_rows_sum:6"), valid / 6)
    kept = valid & (fixture.sample_mask[:, None] == 1)
    np.testing.assert_array_equal(
        _weights(fixture, "sample_rows_mean", 2, 2), np.where(kept, per_row / 3, 0.0)
    )
    # dapo_zv: every token in the numerator, only sampled rows' 5 tokens in the denominator.
    np.testing.assert_array_equal(_weights(fixture, "zero_variance_excluded", 4, 1), valid / 5)


def test_signed_row_weights_over_the_sum_of_their_absolute_values() -> None:
    row_weights = np.array([1.5, -0.5, 2.0, -1.0])
    fixture = _hand_fixture(GROUPS, row_weights=row_weights)
    valid = fixture.targets != X
    n_row = valid.sum(axis=1, keepdims=True)
    expected = np.where(valid, row_weights[:, None] / n_row / 5.0, 0.0)
    np.testing.assert_allclose(
        _weights(fixture, "signed_row_weight_mean", 2, 2), expected, rtol=1e-15, atol=0
    )  # one division more than the expectation's order: a last-bit difference at most


def test_length_power_weights_and_their_denominator() -> None:
    fixture = _hand_fixture(GROUPS)
    valid = fixture.targets != X
    n_row = valid.sum(axis=1).astype(float)
    D = np.sum(n_row**-0.5)
    expected = np.where(valid, (n_row**-0.5)[:, None] / D, 0.0)
    np.testing.assert_allclose(_weights(fixture, "length_power:0.5", 4, 1), expected, rtol=1e-15)
    # a power sum over 4 rows rounds a few times: 1e-15 is a few ulps


def test_nonzero_weight_mean_counts_only_tokens_with_a_weight() -> None:
    fixture = builtin_fixture("rollouts")
    valid = fixture.targets != X
    weights = np.where(valid, fixture.weights, 0.0)
    expected = weights / np.count_nonzero(weights)
    np.testing.assert_allclose(_weights(fixture, "nonzero_weight_mean", 2, 2), expected, rtol=0)
    assert np.count_nonzero(weights) < np.count_nonzero(valid)  # the trap is set


def test_a_document_across_rows_is_one_document() -> None:
    fixture = builtin_fixture("continued-documents")
    valid = fixture.targets != X
    documents = fixture.document_ids
    counts = {d: np.count_nonzero(valid & (documents == d)) for d in np.unique(documents[valid])}
    expected = np.zeros(valid.shape)
    for d, n in counts.items():
        expected[valid & (documents == d)] = 1 / n / len(counts)
    for R, M in fixture.valid_layouts(4, 2):
        np.testing.assert_array_equal(_weights(fixture, "document_mean", R, M), expected)
    # the trap: per row, the continued documents would be counted as several
    assert np.unique(documents[valid]).size < len(
        {
            (r, s)
            for r, s in zip(*np.nonzero(valid), strict=True)
            for s in [fixture.segment_ids[r, s]]
        }
    )


@pytest.mark.parametrize("fixture_name", ["rollouts", "continued-documents", "ragged"])
def test_every_invariant_spec_gives_one_weighting_for_every_layout(fixture_name: str) -> None:
    fixture = builtin_fixture(fixture_name)
    for name in known_spec_names():
        spec = get_spec(name)
        weights = [_weights(fixture, spec, R, M) for R, M in fixture.valid_layouts(4, 2)]
        spread = max(np.max(np.abs(w - weights[0])) for w in weights)
        if spec.layout_invariant:
            # counts are exact and each weight is one quotient of the same numbers
            assert spread == 0, (name, spread)
        else:  # an accidental scheme moves some token's weight by more than 10%
            assert spread > 0.1 * np.max(np.abs(weights[0])), (name, spread)


@pytest.mark.parametrize("fixture_name", ["rollouts", "continued-documents", "packed"])
def test_power_sums_with_their_own_alpha_match_the_independent_reader(fixture_name: str) -> None:
    """D's exponent is the denominator's, not the weight's: specs where the two differ."""
    fixture = builtin_fixture(fixture_name)
    for (R, M), (name, spec) in itertools.product(
        fixture.valid_layouts(4, 2), MIXED_ALPHA_SPECS.items()
    ):
        want = reader_weights(fixture, spec, R, M)
        got = _weights(fixture, get_spec(spec), R, M)
        # The same counts to the same powers, summed in another order (math.fsum in both,
        # but over differently grouped terms): a few ulps of float64.
        assert np.max(np.abs(got - want)) <= 1e-12 * np.max(np.abs(want)), (name, R, M)


@pytest.mark.parametrize(
    ("group", "fixture_name"), [("group", "rollouts"), ("document", "continued-documents")]
)
def test_a_microbatch_local_count_of_a_spanning_group_changes_with_the_layout(
    group: str, fixture_name: str
) -> None:
    fixture = builtin_fixture(fixture_name)
    spec = {
        "weight": {"group": group, "count_scope": "microbatch"},
        "denominator": {"kind": "groups", "group": group},
    }
    one = _weights(fixture, spec, 1, 1)
    assert any(
        not np.array_equal(_weights(fixture, spec, R, M), one)
        for R, M in fixture.valid_layouts(4, 2)
    )


def test_spec_schemes_drive_the_oracle_like_any_weighting() -> None:
    fixture = builtin_fixture("rollouts")
    scheme = resolve_scheme("group_token_mean")
    assert isinstance(scheme, SchemeSpec) and scheme.intended
    result = loss_and_grad(fixture, scheme, 2, 2)
    grads = weighted_grad(
        fixture.params(),
        fixture.inputs,
        fixture.targets,
        _weights(fixture, "group_token_mean", 2, 2),
    )
    for key in grads:
        np.testing.assert_array_equal(result.grads[key], grads[key])
    assert result.denominator == 3.0  # three prompt groups
    assert resolve_scheme("token_mean") == SCHEMES["token_mean"] == get_spec("token_mean")


def test_a_spec_round_trips_through_its_dict() -> None:
    for name in known_spec_names():
        spec = get_spec(name)
        assert SchemeSpec.from_dict(spec.to_dict()) == spec
    assert get_spec({}) == get_spec("token_mean").__class__()  # {} is token_mean


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"weigth": {}}, "unknown key(s) ['weigth'] in the spec"),
        ({"weight": {"group": "prompt"}}, "weight.group = 'prompt' is not one of"),
        ({"weight": {"alpha": "1"}}, "weight.alpha must be a number"),
        ({"denominator": {"kind": "groups"}}, "denominator.kind 'groups' needs a group"),
        ({"denominator": {"kind": "configured"}}, "a configured denominator needs a value > 0"),
        ({"denominator": {"kind": "tokens", "value": 3}}, "kind 'tokens' takes no value"),
        ({"scope": "global"}, "scope = 'global' is not one of microbatch, rank, update"),
    ],
)
def test_a_bad_spec_is_refused_naming_the_key(spec: dict, message: str) -> None:
    with pytest.raises(
        ValueError,
        match=message.replace("(", r"\(")
        .replace(")", r"\)")
        .replace("[", r"\[")
        .replace("]", r"\]"),
    ):
        get_spec(spec)


def test_v2_fields_round_trip_and_v1_files_keep_six_keys(tmp_path: Path) -> None:
    rollouts = builtin_fixture("rollouts")
    path = rollouts.save(tmp_path / "rollouts.npz")
    with np.load(path) as archive:
        assert archive.files == [*NPZ_KEYS, "group_ids", "row_weights", "sample_mask"]
    loaded = Fixture.load(path)
    for key in ("group_ids", "document_ids", "row_weights", "sample_mask"):
        np.testing.assert_array_equal(getattr(loaded, key), getattr(rollouts, key))
    with np.load(builtin_fixture("packed").save(tmp_path / "packed.npz")) as archive:
        assert archive.files == list(NPZ_KEYS)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"group_ids": np.array([0, 1, -1, 0])}, r"group_ids\[2\] = -1 is negative"),
        ({"sample_mask": np.array([1, 2, 1, 1])}, r"sample_mask\[1\] = 2 must be 0 or 1"),
        ({"row_weights": np.array([1.0, np.nan, 1, 1])}, r"row_weights\[1\] = nan is not finite"),
        ({"group_ids": np.zeros(3, int)}, r"group_ids has shape \(3,\), it must be \[4\]"),
        (
            {"document_ids": np.ones((4, 4), int)},
            r"document_ids\[0, 2\] = 1 with segment id 0: document 0 is padding",
        ),
    ],
)
def test_bad_v2_fields_are_named_where_they_are(fields: dict, message: str) -> None:
    with pytest.raises(FixtureError, match=message):
        _hand_fixture(GROUPS, **fields)


@pytest.mark.parametrize(
    "spec",
    [
        {"weight": {"group": "row"}, "denominator": {"kind": "all_groups", "group": "microbatch"}},
        {"denominator": {"kind": "groups", "group": "rank"}},
        {
            "weight": {"group": "row", "count_scope": "microbatch"},
            "denominator": {"kind": "power_sum", "group": "group", "alpha": 0.5},
        },
    ],
)
def test_a_denominator_that_counts_what_the_layout_cuts_is_not_invariant(spec):
    assert not SchemeSpec.from_dict(spec).layout_invariant
    fixture = builtin_fixture("rollouts")
    assert not np.array_equal(_weights(fixture, spec, 1, 1), _weights(fixture, spec, 2, 2))
