"""The contract's context-parallel layouts (docs/contract.md#context-parallel) in the oracle.

A layout (R, M, C, order) gives every row's positions to C context ranks, contiguously or in
the zigzag order; process r C + c holds data-parallel rank r's rows at context rank c's
positions. An intended scheme weights every token as at (1, 1): the layout only says who
computes what. A scope or count local to a process moves with C, and these are the bugs of
context parallel: a CP shard's own token count (Megatron-LM#7513: one valid token, CP = 2
halves the gradient) and a per-sequence mean whose sequence count is shard-local (verl
rejects seq-mean-token-mean under CP for it).
"""

from __future__ import annotations

import numpy as np
import pytest

from crosscheck.contract.fixture import Fixture
from crosscheck.contract.layout import Layout
from crosscheck.contract.oracle import loss_and_grad
from crosscheck.contract.spec import get_spec
from crosscheck.contract.spec_catalogue import known_spec_names
from crosscheck.fixtures.builtin import builtin_fixture

CP_LAYOUTS = [
    (R, M, C, order)
    for R in (1, 2)
    for M in (1, 2)
    for C in (2, 4)
    for order in ("contiguous", "zigzag")
]


def test_positions_go_to_their_context_rank_contiguously_or_in_zigzag() -> None:
    assert Layout(1, 1, 2).context_ranks(8).tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    # 2 C = 4 chunks of 2 positions: chunks 0 and 3 to rank 0, chunks 1 and 2 to rank 1.
    assert Layout(1, 1, 2, "zigzag").context_ranks(8).tolist() == [0, 0, 1, 1, 1, 1, 0, 0]
    zigzag = Layout(1, 1, 4, "zigzag").context_ranks(16).tolist()
    assert zigzag == [0, 0, 1, 1, 2, 2, 3, 3, 3, 3, 2, 2, 1, 1, 0, 0]
    # Every rank holds as many positions, and in zigzag as many early ones as late ones.
    for C in (2, 4):
        ranks = Layout(1, 1, C, "zigzag").context_ranks(64)
        assert np.bincount(ranks).tolist() == [64 // C] * C
        assert np.bincount(ranks[:32]).tolist() == [32 // C] * C


def test_layouts_that_do_not_split_the_positions_are_refused_saying_why() -> None:
    fixture = builtin_fixture("packed")  # T = 64
    with pytest.raises(ValueError, match="64 is not divisible by 24"):
        fixture.layout(1, 1, 12, "zigzag")
    with pytest.raises(ValueError, match="context_order must be one of contiguous, zigzag"):
        Layout(1, 1, 2, "ring")
    with pytest.raises(ValueError, match="context_size >= 1"):
        Layout(1, 1, 0)
    assert str(Layout(2, 1, 4, "zigzag")) == "R=2,M=1,C=4z"


@pytest.mark.parametrize("fixture_name", ["packed", "rollouts", "continued-documents"])
def test_every_intended_spec_weights_every_token_as_without_context_parallel(
    fixture_name: str,
) -> None:
    """Counts are exact and every weight is one quotient of the same numbers: equal bit for
    bit. Every accidental spec moves some token's weight by more than 10% at some layout."""
    fixture = builtin_fixture(fixture_name)
    for name in known_spec_names():
        spec = get_spec(name)
        base = spec.effective_weights(fixture.layout(1, 1)).reshape(fixture.targets.shape)
        spread = 0.0
        for R, M, C, order in CP_LAYOUTS:
            batch = fixture.layout(R, M, C, order)
            weights = batch.to_global(spec.effective_weights(batch))
            spread = max(spread, float(np.max(np.abs(weights - base))))
        if spec.layout_invariant:
            assert spread == 0, (name, spread)
        else:
            assert spread > 0.1 * np.max(np.abs(base)), (name, spread)


def _one_token_row() -> Fixture:
    """One row of 8 positions with one valid target, at position 0."""
    targets = np.full((1, 8), -100)
    targets[0, 0] = 5
    fixture = builtin_fixture("seed")
    return Fixture(
        name="one-token",
        description="one valid token",
        inputs=np.full((1, 8), 3),
        targets=targets,
        segment_ids=np.ones((1, 8), dtype=np.int64),
        weights=np.ones((1, 8)),
        embed=fixture.embed,
        unembed=fixture.unembed,
    )


@pytest.mark.parametrize("C", [2, 4])
def test_a_context_shards_own_token_count_divides_the_gradient_by_c(C: int) -> None:
    """Megatron-LM#7513: each CP rank divides its sum by its own count (rank_mean over the
    R C processes); the rank holding the token divides by 1, the others contribute nothing,
    and the average over the C ranks leaves 1 / C of the gradient."""
    fixture = _one_token_row()
    intended = loss_and_grad(fixture, "token_mean", context_size=C)
    local = loss_and_grad(fixture, "rank_mean", context_size=C)
    assert intended.token_weights[0, 0] == 1.0
    assert local.token_weights[0, 0] == 1.0 / C
    assert local.rank_valid_tokens.tolist() == [1] + [0] * (C - 1)
    for key, g in intended.grads.items():
        np.testing.assert_allclose(local.grads[key], g / C, rtol=1e-15)


def test_a_sequence_count_taken_on_the_shard_moves_with_context_parallel() -> None:
    """sequence_mean with its counts per process: exact at C = 1, wrong under C > 1 (each
    shard's piece of a sequence counted as a whole one)."""
    fixture = builtin_fixture("packed")
    spec = get_spec("sequence_mean").to_dict()
    spec["weight"]["count_scope"] = "rank"
    local = get_spec(spec)
    intended = get_spec("sequence_mean")
    for R, M in ((1, 1), (2, 2)):
        batch = fixture.layout(R, M)
        assert np.array_equal(local.token_weights(batch), intended.token_weights(batch))
    batch = fixture.layout(1, 1, 2, "zigzag")
    moved = np.abs(local.token_weights(batch) - intended.token_weights(batch)).max()
    assert moved > 0.1 * intended.token_weights(batch).max()


def test_per_process_figures_sum_to_the_updates() -> None:
    fixture = builtin_fixture("packed")
    result = loss_and_grad(fixture, "token_mean", 2, 2, context_size=2, context_order="zigzag")
    assert len(result.rank_valid_tokens) == 4
    assert result.rank_valid_tokens.sum() == fixture.num_valid_tokens
    plain = loss_and_grad(fixture, "token_mean", 2, 2)
    assert result.loss == plain.loss
    assert np.isclose(result.rank_loss_sums.sum(), plain.rank_loss_sums.sum(), rtol=1e-14)
