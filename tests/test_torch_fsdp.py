"""FSDP2 (fully_shard on CPU with gloo) as a second front-end, precount with the probed s.

FSDP2's default reduce-scatter averages (s = R); set_gradient_divide_factor(1.0) sums (s = 1).
Both must give the oracle's gradient and, after two AdamW updates with clipping, its params.
The case is `ragged` (layouts for every R in 1-4) with sequence_mean at M = 2.
"""

from __future__ import annotations

import functools

import pytest
from torch_world import ADAMW, DTYPES, MAX_GRAD_NORM, NUM_UPDATES, WORLD_SIZES, world_results

from crosscheck import FLOAT32_RTOL, FLOAT64_RTOL, assert_tree_close, builtin_fixture
from crosscheck.contract.optimizers import train

# As in the DDP grid (tests/test_torch_ddp.py): float64 rounding only; float32 accumulated
# rounding of ~1e-6 in gradients and AdamW-updated params.
RTOL = {"float64": FLOAT64_RTOL, "float32": FLOAT32_RTOL}


@functools.cache
def oracle(world_size: int):
    return train(
        builtin_fixture("ragged"),
        "sequence_mean",
        world_size,
        2,
        num_updates=NUM_UPDATES,
        optimizer=ADAMW,
        max_grad_norm=MAX_GRAD_NORM,
        clip_convention="torch",
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("divide_factor", [None, 1.0], ids=["default", "divide1"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_fsdp2_matches_oracle(world_size: int, divide_factor: float | None, dtype: str) -> None:
    label = f"fsdp2-divide{divide_factor}-R{world_size}-{dtype}"
    outputs = world_results(world_size)[label]
    summed = divide_factor == 1.0 or world_size == 1
    expected_path = "sum" if summed else f"mean, factor {world_size}"
    for output in outputs:
        assert str(output.reduction) == expected_path, f"{label}, rank {output.rank}"
        for update, record in enumerate(oracle(world_size), start=1):
            got = output.updates[update - 1]
            what = f"{label}, rank {output.rank}, update {update}"
            assert_tree_close(got.grads, record.result.grads, RTOL[dtype], what)
            assert_tree_close(got.params, record.params, RTOL[dtype], f"{what} params")
            assert got.metrics.global_denominator == record.result.denominator
            # Norms of DTensor gradients (clip_grad_norm_ all-reduces the shards' squares).
            assert abs(got.metrics.grad_norm - record.grad_norm) <= RTOL[dtype] * record.grad_norm
            assert abs(got.metrics.clipped_grad_norm - record.clipped_grad_norm) <= (
                RTOL[dtype] * record.clipped_grad_norm
            )
