"""Carrying d exactly through a float32 (or bf16) all-reduce, and the postnorm hook's state.

A SUM all-reduce is simulated here by adding the ranks' slot vectors in the bucket dtype, in
every order a backend might use. Counts past 2^24 (a 16M-token global batch) are where a plain
float32 sum stops being exact (docs/bugs.md float32-count); the limbs must stay exact there and for
arbitrary float64 weight sums.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_impl.comm_hooks import PostnormHookError, PostnormState
from torch_impl.exact_carry import (
    CarryError,
    decode_slots,
    encode_slots,
    join_exact,
    limbs_per_value,
    split_exact,
)
from torch_impl.probe import ReductionPath

CARRY_DTYPES = [torch.float32, torch.bfloat16, torch.float64]
# Values a denominator can take: counts up to 2^53, weight sums down to 1e-20 (below ~1e-22
# the last float32 limb would leave float32's normal range; split_exact refuses those).
finite_values = st.one_of(
    st.integers(min_value=0, max_value=2**53).map(float),
    st.floats(min_value=1e-20, max_value=1e30, allow_nan=False, allow_infinity=False),
)


def simulated_all_reduce(vectors: list[torch.Tensor], order: tuple[int, ...]) -> torch.Tensor:
    """Sum the ranks' vectors in `order`, rounding to their dtype after every addition."""
    total = torch.zeros_like(vectors[0])
    for rank in order:
        total = total + vectors[rank]
    return total


def test_limb_counts() -> None:
    assert [limbs_per_value(d) for d in CARRY_DTYPES] == [3, 7, 1]
    with pytest.raises(CarryError, match="float16"):
        limbs_per_value(torch.float16)


@settings(max_examples=300, deadline=None)
@given(value=finite_values, dtype=st.sampled_from(CARRY_DTYPES))
def test_split_is_exact(value: float, dtype: torch.dtype) -> None:
    limbs = split_exact(value, dtype)
    assert join_exact(limbs) == value
    for limb in limbs:  # each limb survives the cast to the bucket dtype unchanged
        assert float(torch.tensor(limb, dtype=torch.float64).to(dtype)) == limb


@settings(max_examples=100, deadline=None)
@given(
    values=st.lists(st.tuples(finite_values, finite_values), min_size=1, max_size=4),
    dtype=st.sampled_from(CARRY_DTYPES),
)
def test_every_rank_receives_every_rank_exactly(
    values: list[tuple[float, float]], dtype: torch.dtype
) -> None:
    world_size = len(values)
    vectors = [encode_slots(v, rank, world_size, dtype) for rank, v in enumerate(values)]
    for order in itertools.permutations(range(world_size)):
        received = decode_slots(simulated_all_reduce(vectors, order), 2, world_size)
        assert received == [tuple(v) for v in values]


def test_counts_past_two_to_the_24_stay_exact() -> None:
    counts = [2.0**24 + 1, 2.0**24 + 3, 2.0**40 + 7, 1.0]
    world_size = len(counts)
    # The naive carry, d summed in the bucket dtype, is wrong here: that is what is avoided.
    naive = simulated_all_reduce(
        [torch.tensor([c], dtype=torch.float32) for c in counts], tuple(range(world_size))
    )
    assert float(naive) != math.fsum(counts)
    vectors = [encode_slots([c], r, world_size, torch.float32) for r, c in enumerate(counts)]
    received = decode_slots(simulated_all_reduce(vectors, (3, 1, 0, 2)), 1, world_size)
    assert math.fsum(d for (d,) in received) == math.fsum(counts)


def test_uncarryable_values_are_refused() -> None:
    with pytest.raises(CarryError, match="non-finite"):
        split_exact(math.inf, torch.float32)
    with pytest.raises(CarryError, match="cannot be split exactly"):
        split_exact(1e-300, torch.float32)  # below float32's range: it would vanish
    with pytest.raises(CarryError, match="rank 2 is not in a world of size 2"):
        encode_slots([1.0], 2, 2, torch.float32)
    with pytest.raises(CarryError, match="expected 2 ranks x 1 values x 3 limbs"):
        decode_slots(torch.zeros(5), 1, 2)


def test_hook_state_is_read_once() -> None:
    """A D is consumed by the update that carried it; reuse is the stale-count bug."""
    state = PostnormState(rank=0, world_size=1)
    with pytest.raises(PostnormHookError, match="carried nothing"):
        state.take()
    state.arm(12.0, 3.5, 12)
    assert state.pending == (12.0, 3.5, 12.0)
    state.received = [(12.0, 3.5, 12.0)]  # what the hook stores after the all-reduce
    assert state.take() == [(12.0, 3.5, 12.0)]
    with pytest.raises(PostnormHookError, match="rank 0"):
        state.take()


@pytest.mark.parametrize(
    ("factor", "world_size", "text"),
    [(4.0, 4, "mean, factor 4"), (1.0, 4, "sum"), (1.0, 1, "sum"), (2.0, 4, "scaled, factor 2")],
)
def test_reduction_path_words(factor: float, world_size: int, text: str) -> None:
    assert str(ReductionPath(reduce_factor=factor, world_size=world_size)) == text
