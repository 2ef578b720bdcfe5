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


def _gathered_both_ways(rank: int, world_size: int, vocab_size: int, hidden_size: int):
    """One rank: an FSDP2-sharded model's params and made-up gradients, made whole by
    `numpy_full` (one all-gather for all four) and by FSDP2's own ``full_tensor`` each."""
    import numpy as np
    import torch

    from torch_impl.fsdp import shard_fsdp2
    from torch_impl.model import BilinearLM, local_grads, numpy_full

    rng = np.random.default_rng(7)
    params = {
        "embed": rng.standard_normal((vocab_size, hidden_size)),
        "unembed": rng.standard_normal((hidden_size, vocab_size)),
    }
    model = shard_fsdp2(BilinearLM.from_numpy(params), world_size=world_size)
    for p in model.parameters():
        # A gradient of the parameter's own placement, different on every row.
        p.grad = p.detach() * 3.0 + 1.0
    grads = local_grads(model)
    ours = numpy_full(
        {
            **{f"grads.{k}": v for k, v in grads.items()},
            **{name: p.detach() for name, p in model.named_parameters()},
        }
    )
    theirs = {
        name: p.detach().full_tensor().to(torch.float64).numpy()
        for name, p in model.named_parameters()
    }
    theirs |= {f"grads.{k}": v.full_tensor().to(torch.float64).numpy() for k, v in grads.items()}
    return ours, theirs, params


@pytest.mark.parametrize(
    "world_size, vocab_size, hidden_size",
    # 10 rows over 3 ranks: shards of 4, 4 and 2 rows; 3 rows over 4 ranks: one rank holds
    # none. Both are torch.chunk's uneven pieces, which the one-buffer gather must put back.
    [(3, 10, 3), (4, 6, 3), (2, 40, 12)],
)
def test_one_gather_makes_fsdp2_tensors_whole_as_full_tensor_does(
    world_size: int, vocab_size: int, hidden_size: int
) -> None:
    from torch_impl.harness.launcher import launch

    per_rank = launch(_gathered_both_ways, world_size, (vocab_size, hidden_size), timeout_s=120)
    for rank, (ours, theirs, params) in enumerate(per_rank):
        assert sorted(ours) == sorted(theirs), f"rank {rank}"
        for key, value in theirs.items():
            # Bit for bit: both only move float64 values (no arithmetic on the way).
            assert ours[key].shape == value.shape, f"rank {rank} {key}"
            assert (ours[key] == value).all(), f"rank {rank} {key}"
        for key, value in params.items():
            assert (ours[key] == value).all(), f"rank {rank} {key} is not the loaded param"
