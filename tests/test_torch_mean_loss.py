"""The plain DDP loop with F.cross_entropy(reduction="mean") reproduces the accidental schemes.

Each microbatch's token mean, divided by M, averaged by DDP over R ranks: the oracle's
rank_mean at M = 1 and microbatch_mean at M > 1 (docs/bugs.md rank-mean and microbatch-mean;
transformers#34191). Reproducing them exactly is what shows the reference would catch a real
loop written this way. A microbatch without a valid target reports a NaN loss (0/0) but adds a
zero gradient, which is how the oracle's accidental schemes treat it too.
"""

from __future__ import annotations

import numpy as np
import pytest
from torch_world import WORLD_SIZES, mean_loss_matrix, world_results

from crosscheck import (
    FLOAT32_RTOL,
    FLOAT64_RTOL,
    assert_tree_close,
    builtin_fixture,
    loss_and_grad,
    tree_rel_err,
)

# Same reasoning as the main grid: float64 admits only the rounding of a few reductions,
# float32 ~1e-6 of accumulated rounding (crosscheck.judge.compare).
RTOL = {"float64": FLOAT64_RTOL, "float32": FLOAT32_RTOL}

CASES = [(R, *case) for R in WORLD_SIZES for case in mean_loss_matrix(R)]


@pytest.mark.parametrize(
    ("world_size", "fixture", "accum_steps", "dtype"),
    CASES,
    ids=[f"{f}-R{R}-M{M}-{d}" for R, f, M, d in CASES],
)
def test_mean_loss_loop_is_the_accidental_scheme(
    world_size: int, fixture: str, accum_steps: int, dtype: str
) -> None:
    label = f"mean_loss-{fixture}-R{world_size}-M{accum_steps}-{dtype}"
    outputs = world_results(world_size)[label]
    grads = outputs[0].updates[0].grads
    empty = builtin_fixture(fixture).layout(world_size, accum_steps).valid.sum(axis=(2, 3)) == 0
    for output in outputs:
        losses = np.array(output.updates[0].mean_losses)
        # The visible symptom: the logged loss is NaN exactly on the empty microbatches.
        np.testing.assert_array_equal(np.isnan(losses), empty[output.rank], err_msg=label)
    accidental = "rank_mean" if accum_steps == 1 else "microbatch_mean"
    expected = loss_and_grad(builtin_fixture(fixture), accidental, world_size, accum_steps)
    assert_tree_close(grads, expected.grads, RTOL[dtype], f"{label} vs oracle {accidental}")
    # Where the accidental weighting differs from the intended one, the loop fails the check
    # against the intended scheme: the reference would catch this loop.
    intended = loss_and_grad(builtin_fixture(fixture), "token_mean", world_size, accum_steps)
    if tree_rel_err(expected.grads, intended.grads).max_rel_err > 100 * RTOL[dtype]:
        assert tree_rel_err(grads, intended.grads).max_rel_err > RTOL[dtype]


def test_seed_shows_the_nine_to_one_weighting() -> None:
    """The seed example: 100 vs 900 tokens, the per-rank mean weighs a short-rank token 9x."""
    grads = world_results(2)["mean_loss-seed-R2-M1-float64"][0].updates[0].grads
    rank_mean = loss_and_grad(builtin_fixture("seed"), "rank_mean", 2, 1)
    weights = rank_mean.token_weights[builtin_fixture("seed").valid]
    assert np.isclose(weights.max() / weights.min(), 9.0, rtol=1e-12)
    assert tree_rel_err(grads, rank_mean.grads).max_rel_err <= FLOAT64_RTOL
