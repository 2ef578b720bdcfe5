"""Fixtures: the traps they set, their layouts, validation errors and the .npz round trip."""

from __future__ import annotations

import numpy as np
import pytest

from crosscheck.contract.fixture import NPZ_KEYS, Fixture, FixtureError
from crosscheck.contract.layout import IGNORE_INDEX
from crosscheck.fixtures.builtin import (
    BUILTIN_FIXTURES,
    IMAGE_TOKEN,
    builtin_fixture,
    random_fixture,
)

ALL_BUILTINS = list(BUILTIN_FIXTURES)


def _with(fixture: Fixture, **arrays: np.ndarray) -> Fixture:
    fields = {key: getattr(fixture, key) for key in NPZ_KEYS} | arrays
    return Fixture(name=fixture.name, description=fixture.description, **fields)


def test_seed_has_exactly_100_and_900_valid_tokens_on_two_ranks():
    seed = builtin_fixture("seed")
    batch = seed.layout(2, 1)
    assert batch.valid.sum(axis=(1, 2, 3)).tolist() == [100, 900]
    assert seed.valid_layouts() == [(1, 1), (1, 2), (2, 1)]


def test_packed_ignores_every_target_that_crosses_a_document_boundary():
    packed = builtin_fixture("packed")
    seg = packed.segment_ids
    last_of_segment = (seg[:, :-1] != seg[:, 1:]) & (seg[:, :-1] > 0)
    assert last_of_segment.sum() >= 2 * packed.num_rows  # rows pack several documents
    assert (packed.targets[:, :-1][last_of_segment] == IGNORE_INDEX).all()
    assert (seg.max(axis=1) >= 2).all()
    assert (seg[:, -1] == 0).any()  # some rows end in padding


def test_ragged_lays_out_for_every_world_size_and_accum_up_to_four():
    ragged = builtin_fixture("ragged")
    layouts = ragged.valid_layouts(4, 4)
    assert len(layouts) == 16
    per_microbatch = ragged.layout(4, 4).valid.sum(axis=(2, 3))
    # "differ widely": the busiest microbatch holds several times the valid tokens of the
    # quietest at the finest layout.
    assert per_microbatch.max() >= 4 * per_microbatch.min()
    ranks = ragged.layout(4, 1).valid.sum(axis=(1, 2, 3))
    assert ranks.max() >= 1.5 * ranks.min()


def test_empty_rank_has_one_rank_without_any_valid_target():
    fixture = builtin_fixture("empty-rank")
    per_rank = fixture.layout(2, 1).valid.sum(axis=(1, 2, 3))
    assert per_rank[0] > 0 and per_rank[1] == 0
    # the empty rank still attends to real tokens (segment 1), it just carries no loss
    assert (fixture.layout(2, 1).segment_ids[1] > 0).any()


def test_multimodal_placeholders_are_attended_but_carry_no_loss():
    fixture = builtin_fixture("multimodal")
    placeholder = fixture.inputs == IMAGE_TOKEN
    assert placeholder.sum(axis=1).min() >= 8
    assert (fixture.targets[placeholder] == IGNORE_INDEX).all()
    assert (fixture.segment_ids[placeholder] > 0).all()
    attended = (fixture.segment_ids > 0).sum()
    assert attended >= 2 * fixture.num_valid_tokens


def test_soft_weights_are_fractional_with_zeros_and_weight_on_ignored_tokens():
    fixture = builtin_fixture("soft-weights")
    valid_weights = fixture.weights[fixture.valid]
    assert (valid_weights == 0).any()
    assert not np.allclose(valid_weights, np.round(valid_weights))
    assert (fixture.weights[~fixture.valid] > 0).any()


@pytest.mark.parametrize("name", ALL_BUILTINS)
def test_npz_round_trip_is_bit_exact_with_exactly_the_contract_keys(name, tmp_path):
    fixture = builtin_fixture(name)
    path = fixture.save(tmp_path / f"{name}.npz")
    with np.load(path) as archive:
        assert sorted(archive.files) == sorted(NPZ_KEYS)
    loaded = Fixture.load(path)
    assert loaded.name == name
    for key in NPZ_KEYS:
        original, back = getattr(fixture, key), getattr(loaded, key)
        assert back.dtype == original.dtype and back.shape == original.shape, key
        assert original.tobytes() == back.tobytes(), key


def test_random_fixture_round_trips_and_is_reproducible(tmp_path):
    first = random_fixture(7, 6, 11)
    again = random_fixture(7, 6, 11)
    for key in NPZ_KEYS:
        assert getattr(first, key).tobytes() == getattr(again, key).tobytes()
    loaded = Fixture.load(first.save(tmp_path / "r"))
    assert all(getattr(first, k).tobytes() == getattr(loaded, k).tobytes() for k in NPZ_KEYS)


def test_load_rejects_an_npz_with_other_keys(tmp_path):
    path = tmp_path / "bad.npz"
    fixture = builtin_fixture("packed")
    np.savez(path, **{k: getattr(fixture, k) for k in NPZ_KEYS}, extra=np.zeros(1))
    with pytest.raises(FixtureError, match="extra \\['extra'\\]"):
        Fixture.load(path)


def test_fixture_arrays_are_read_only():
    fixture = builtin_fixture("packed")
    with pytest.raises(ValueError):
        fixture.targets[0, 0] = 1


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("target_out_of_vocab", "target 40 at row 1, position 2"),
        ("input_negative", "input token -1 at row 0, position 3"),
        ("valid_in_padding", "row 2, position 60 lies in segment 0"),
        ("negative_weight", "weight -0.5 at row 3, position 1"),
        ("nan_weight", "weight nan at row 0, position 0"),
        ("shape", "weights has shape"),
        ("transposed_unembed", "unembed must be \\[H, V\\]"),
        ("target_below_ignore", "target -101 at row 1, position 2 is neither -100"),
        ("negative_segment", "negative segment id at row 4, position 7"),
        ("float_inputs", "inputs must be an integer array, got float64 holding whole numbers"),
        ("integer_weights", "weights must be a floating-point array .* got int64"),
        ("inf_param", "embed\\[2, 3\\] = inf is not finite"),
    ],
)
def test_validation_names_what_and_where(change, message):
    fixture = builtin_fixture("packed")
    targets, inputs = fixture.targets.copy(), fixture.inputs.copy()
    segments, weights = fixture.segment_ids.copy(), fixture.weights.copy()
    arrays: dict[str, np.ndarray] = {}
    if change == "target_out_of_vocab":
        targets[1, 2] = fixture.vocab_size
        arrays["targets"] = targets
    elif change == "input_negative":
        inputs[0, 3] = -1
        arrays["inputs"] = inputs
    elif change == "valid_in_padding":
        segments[2, 60] = 0
        targets[2, 60] = 5
        arrays |= {"segment_ids": segments, "targets": targets}
    elif change == "negative_weight":
        weights[3, 1] = -0.5
        arrays["weights"] = weights
    elif change == "nan_weight":
        weights[0, 0] = np.nan
        arrays["weights"] = weights
    elif change == "shape":
        arrays["weights"] = weights[:, :-1]
    elif change == "transposed_unembed":
        arrays["unembed"] = fixture.unembed.T
    elif change == "target_below_ignore":
        targets[1, 2] = -101
        arrays["targets"] = targets
    elif change == "negative_segment":
        segments[4, 7] = -1
        arrays["segment_ids"] = segments
    elif change == "float_inputs":
        arrays["inputs"] = inputs.astype(np.float64)
    elif change == "integer_weights":
        arrays["weights"] = np.ones(weights.shape, dtype=np.int64)
    elif change == "inf_param":
        embed = fixture.embed.copy()
        embed[2, 3] = np.inf
        arrays["embed"] = embed
    with pytest.raises(FixtureError, match=message):
        _with(fixture, **arrays)


def test_layout_that_does_not_divide_the_batch_is_refused():
    with pytest.raises(ValueError, match="8 is not divisible by 3"):
        builtin_fixture("packed").layout(3, 1)


def test_layout_is_a_contiguous_split_of_the_rows():
    fixture = builtin_fixture("ragged")
    batch = fixture.layout(3, 4)
    B = fixture.num_rows // 12
    for r, m, mb in batch.microbatches():
        first_row = r * (fixture.num_rows // 3) + m * B
        assert np.array_equal(mb.targets, fixture.targets[first_row : first_row + B])
