"""DDP on R real gloo processes against the oracle: every intended scheme, layout, strategy, dtype.

The grid is every built-in fixture x world size {1, 2, 3, 4} x accum_steps {1, 2, 4} (where N is
divisible by R M) x the six intended schemes x {precount, postnorm} x {float64, float32}: 1128
cases, each two consecutive AdamW updates with clipping, run in one launch per world size
(tests/torch_world.py). Each case checks, for both updates: the reduced gradient, the params
after the step, D, the objective, the per-rank valid-token counts and loss sums, and the grad
norm before and after clipping; and that every rank holds bit-identical gradients and params.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from torch_world import WORLD_SIZES, MatrixCase, matrix, oracle_updates, world_results

from crosscheck import FLOAT32_RTOL, FLOAT64_RTOL, assert_tree_close
from crosscheck.contract.optimizers import UpdateRecord

# Gradients: docs/contract.md's tolerances (crosscheck.judge.compare explains them: float64 admits
# only rounding of a few reductions, measured <= 1e-14 here; float32 admits ~1e-6 accumulated
# rounding, measured <= 1.1e-6, while one wrongly weighted token moves the gradient >= 1e-4).
GRAD_RTOL = {"float64": FLOAT64_RTOL, "float32": FLOAT32_RTOL}
# Updated params: O(1) values moved by ~lr = 1e-2 per AdamW step. float64: rounding only
# (measured <= 4e-15). float32: the params' own rounding (6e-8) plus the step's sensitivity to
# gradient rounding, |delta g| / eps * lr for the smallest gradients (eps = 1e-6 is why
# AdamWConfig does not use 1e-8); measured <= 1.8e-6, so FLOAT32_RTOL holds with room.
PARAM_RTOL = {"float64": FLOAT64_RTOL, "float32": FLOAT32_RTOL}
# Scalars (objective, D, norms, loss sums) are single reductions: float64 to ~1e-16, float32
# to ~1e-7 relative (measured <= 3e-7); the same tolerances bound them.
SCALAR_RTOL = GRAD_RTOL

ALL_CASES = [case for world_size in WORLD_SIZES for case in matrix(world_size)]


def assert_close(actual: float, expected: float, rtol: float, what: str) -> None:
    """|a - b| <= rtol |b| (and exact when b = 0); NaN never passes."""
    if not abs(actual - expected) <= rtol * abs(expected):
        raise AssertionError(f"{what}: got {actual!r}, expected {expected!r} (rtol {rtol:.0e})")


def check_metrics(metrics, record: UpdateRecord, rtol: float, what: str) -> None:
    result = record.result
    assert list(metrics.rank_valid_tokens) == result.rank_valid_tokens.tolist(), (
        f"{what}: per-rank valid tokens {metrics.rank_valid_tokens}, "
        f"expected {result.rank_valid_tokens.tolist()}"
    )
    # D is a count (exact) or a float64 sum of weights (order-dependent in the last bit).
    assert_close(metrics.global_denominator, result.denominator, 4e-16, f"{what}: D")
    assert_close(metrics.objective, result.loss, rtol, f"{what}: objective")
    scale = max(float(np.max(np.abs(result.rank_loss_sums))), math.ulp(0.0))
    for rank, (got, expected) in enumerate(
        zip(metrics.rank_loss_sums, result.rank_loss_sums, strict=True)
    ):
        # Relative to the largest rank's sum: an empty rank's sum is exactly 0 in both.
        assert abs(got - expected) <= rtol * scale, (
            f"{what}: rank {rank} loss sum {got!r}, expected {expected!r}"
        )
    assert_close(metrics.grad_norm, record.grad_norm, rtol, f"{what}: grad norm")
    assert_close(
        metrics.clipped_grad_norm, record.clipped_grad_norm, rtol, f"{what}: clipped grad norm"
    )


def check_replicas(outputs, what: str) -> None:
    """DDP hands every rank the same reduced buffer, so replicas agree bit for bit."""
    reference = outputs[0]
    for output in outputs[1:]:
        for update, (got, expected) in enumerate(
            zip(output.updates, reference.updates, strict=True), start=1
        ):
            for name in expected.grads:
                assert np.array_equal(got.grads[name], expected.grads[name]), (
                    f"{what}: rank {output.rank} {name} gradient differs from rank 0's, "
                    f"update {update}"
                )
                assert np.array_equal(got.params[name], expected.params[name]), (
                    f"{what}: rank {output.rank} {name} differs from rank 0's after update {update}"
                )


@pytest.mark.parametrize("case", ALL_CASES, ids=lambda case: case.label)
def test_update_matches_oracle(case: MatrixCase) -> None:
    outputs = world_results(case.world_size)[case.label]
    records = oracle_updates(case.fixture, case.scheme, case.world_size, case.accum_steps)
    assert [output.rank for output in outputs] == list(range(case.world_size))
    for update, (output, record) in enumerate(
        zip(outputs[0].updates, records, strict=True), start=1
    ):
        what = f"{case.label}, update {update}"
        assert_tree_close(output.grads, record.result.grads, GRAD_RTOL[case.dtype], what)
        assert_tree_close(output.params, record.params, PARAM_RTOL[case.dtype], f"{what} params")
        check_metrics(output.metrics, record, SCALAR_RTOL[case.dtype], what)
    check_replicas(outputs, case.label)


def test_grid_covers_every_layout() -> None:
    """The grid is what the acceptance asks: every fixture layout with R in 1-4, M in 1, 2, 4."""
    assert len(ALL_CASES) == 1128
    layouts = {(c.fixture, c.world_size, c.accum_steps) for c in ALL_CASES}
    assert ("ragged", 3, 4) in layouts and ("seed", 2, 1) in layouts
    assert ("seed", 2, 2) not in layouts  # 2 rows cannot fill 4 microbatches
