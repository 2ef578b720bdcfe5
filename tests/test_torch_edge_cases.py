"""Ranks without tokens, updates without any loss, and SGD with active clipping.

A rank whose rows carry no valid target must add nothing, not 0/0 = NaN (fixture
"empty-rank"); an update in which no token carries a loss has D = 0 and must leave a zero
gradient. SGD makes the updated params proportional to the clipped gradient, so it checks the
clip-after-reduction order in the params themselves (docs/bugs.md clip-per-microbatch).
"""

from __future__ import annotations

import numpy as np
import pytest
from torch_world import (
    ADAMW,
    DTYPES,
    SGD,
    STRATEGIES,
    WORLD_SIZES,
    layouts,
    no_loss_fixture,
    world_results,
)

from crosscheck import FLOAT64_RTOL, INTENDED_SCHEMES, assert_tree_close, builtin_fixture
from crosscheck.contract.optimizers import train

EMPTY_RANK_LAYOUTS = [(R, M) for R in (2, 4) for M in layouts(builtin_fixture("empty-rank"), R)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("scheme", INTENDED_SCHEMES)
@pytest.mark.parametrize(("world_size", "accum_steps"), EMPTY_RANK_LAYOUTS)
def test_zero_token_ranks_are_finite_and_add_nothing(
    world_size: int, accum_steps: int, scheme: str, strategy: str, dtype: str
) -> None:
    label = f"empty-rank-R{world_size}-M{accum_steps}-{scheme}-{strategy}-{dtype}"
    outputs = world_results(world_size)[label]
    fixture = builtin_fixture("empty-rank")
    # Rows 4-7 have no valid target: the upper half of the ranks is empty.
    empty = list(range(world_size // 2, world_size))
    # constant counts every target slot (padding included), so an empty rank still adds its
    # rows x T to D; every other scheme's d is 0 there (sum has D = 1 and no d at all).
    empty_d = fixture.num_rows // world_size * fixture.seq_len if scheme == "constant" else 0.0
    for output in outputs:
        for update in output.updates:
            metrics = update.metrics
            assert [r for r, n in enumerate(metrics.rank_valid_tokens) if n == 0] == empty
            for rank in empty:
                assert metrics.rank_loss_sums[rank] == 0.0, f"{label}: rank {rank} loss sum"
                assert metrics.rank_denominators[rank] == empty_d, f"{label}: rank {rank} d"
            for name, grad in update.grads.items():
                assert np.isfinite(grad).all(), f"{label}: rank {output.rank} {name} not finite"
            assert np.isfinite(metrics.objective) and metrics.global_denominator > 0


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_update_without_any_loss_is_zero(world_size: int, strategy: str) -> None:
    (output, *_) = world_results(world_size)[f"no-loss-{strategy}-R{world_size}"]
    update = output.updates[0]
    assert update.metrics.global_denominator == 0.0
    assert update.metrics.objective == 0.0
    assert update.metrics.grad_norm == 0.0
    for name, grad in update.grads.items():
        assert not grad.any(), f"{name}: gradient must be exactly zero when D = 0"
    # AdamW with a zero gradient only decays the weights; the oracle does the same.
    (record,) = train(
        no_loss_fixture(), "token_mean", world_size, 1, num_updates=1, optimizer=ADAMW
    )
    assert_tree_close(update.params, record.params, FLOAT64_RTOL, "no-loss params")


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_sgd_with_clipping_matches_oracle(world_size: int, strategy: str) -> None:
    outputs = world_results(world_size)[f"sgd-{strategy}-R{world_size}"]
    records = train(
        builtin_fixture("ragged"),
        "token_mean",
        world_size,
        2,
        num_updates=2,
        optimizer=SGD,
        max_grad_norm=0.2,
        clip_convention="torch",
    )
    for update, record in zip(outputs[0].updates, records, strict=True):
        assert record.grad_norm > 0.2, "the case must exercise clipping"
        # float64 throughout: rounding only (see tests/test_torch_ddp.py).
        assert_tree_close(update.grads, record.result.grads, FLOAT64_RTOL, "SGD gradient")
        assert_tree_close(update.params, record.params, FLOAT64_RTOL, "SGD params")
        assert abs(update.metrics.clipped_grad_norm - 0.2) < 1e-6  # clipped to c / (1 + 1e-6/norm)
