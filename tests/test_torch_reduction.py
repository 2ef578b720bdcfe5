"""The reduction-path probe, and precount with a wrong s being caught.

precount backpropagates (sum a_t l_t) s / D and is right only when s is the reduce factor of
the gradient reduction actually in use. The probe measures that factor on the wrapped model:
plain DDP averages ("mean, factor R"), the postnorm hook sums ("sum"). A precount step that assumes
s = 1 under DDP's averaging is the missing-world-size bug (docs/bugs.md, transformers#37474): its
gradient is the intended one divided by R, and the comparison with the oracle must fail.
"""

from __future__ import annotations

import numpy as np
import pytest
from torch_world import WORLD_SIZES, world_results

from crosscheck import FLOAT64_RTOL, builtin_fixture, loss_and_grad, tree_rel_err

MULTI_RANK = [R for R in WORLD_SIZES if R > 1]


def _output(world_size: int, strategy: str):
    # Any case of the strategy shares its world size's wrapped model and probe.
    label = f"ragged-R{world_size}-M1-token_mean-{strategy}-float64"
    return world_results(world_size)[label]


@pytest.mark.parametrize("world_size", MULTI_RANK)
def test_probe_reports_ddp_mean(world_size: int) -> None:
    for output in _output(world_size, "precount"):
        assert str(output.reduction) == f"mean, factor {world_size}", f"rank {output.rank}"
        assert output.reduce_factor == world_size  # precount's s is the probed factor


@pytest.mark.parametrize("world_size", MULTI_RANK)
def test_probe_reports_postnorm_hook_sum(world_size: int) -> None:
    for output in _output(world_size, "postnorm"):
        assert str(output.reduction) == "sum", f"rank {output.rank}"
        assert output.reduction.reduce_factor == 1


def test_probe_at_one_rank_is_factor_one() -> None:
    # With one rank a mean and a sum are the same reduction: s = 1 either way.
    for strategy in ("precount", "postnorm"):
        (output,) = _output(1, strategy)
        assert output.reduction.reduce_factor == 1 and str(output.reduction) == "sum"


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_probe_float32_and_float64_agree(dtype: str) -> None:
    label = f"ragged-R4-M1-token_mean-precount-{dtype}"
    assert all(str(out.reduction) == "mean, factor 4" for out in world_results(4)[label])


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_wrong_reduce_factor_is_caught(world_size: int) -> None:
    """s = 1 under DDP's mean: gradient / R. Caught (R > 1), and named as a pure 1/R scale."""
    (output, *_) = world_results(world_size)[f"wrong-s-R{world_size}"]
    assert output.reduce_factor == 1.0
    grads = output.updates[0].grads
    expected = loss_and_grad(builtin_fixture("ragged"), "token_mean", world_size, 1).grads
    err = tree_rel_err(grads, expected).max_rel_err
    if world_size == 1:
        # One rank: averaging divides by 1, so s = 1 happens to be right.
        assert err <= FLOAT64_RTOL  # float64 rounding only, as in the main grid
        return
    # The miss is the whole 1 - 1/R of the gradient, far above any tolerance ...
    assert err > 0.4 and np.isclose(err, 1 - 1 / world_size, rtol=1e-9)
    # ... and it is exactly a scale: R times the gradient is the intended one.
    scaled = {name: world_size * g for name, g in grads.items()}
    assert tree_rel_err(scaled, expected).max_rel_err <= FLOAT64_RTOL
