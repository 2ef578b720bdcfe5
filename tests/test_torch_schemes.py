"""torch's per-microbatch (sum a_t l_t, d) against the numpy contract, and input validation.

In-process, no process group: every microbatch of every built-in fixture under every layout
with R, M in 1-4, each intended scheme read as torch's own spec (``torch_impl.update``'s plan:
a_t per microbatch, each rank's share of D), compared with crosscheck's token weights and
denominators and the oracle's per-token losses. Bad inputs must fail naming the rank,
microbatch, row and position.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from crosscheck import BUILTIN_FIXTURES, INTENDED_SCHEMES, builtin_fixture, get_scheme
from crosscheck.contract.oracle import token_terms
from torch_impl.batch import BATCH_KEYS, BatchError, rank_microbatches
from torch_impl.harness.cases import UpdateCase
from torch_impl.losses import microbatch_loss
from torch_impl.model import BilinearLM, numpy_params
from torch_impl.optimizers import OptimizerSpec
from torch_impl.spec import get_spec
from torch_impl.update import layout_plans

# float64 throughout: the weights are exact (counts, 1/n, soft weights copied) and the loss
# sum adds at most a few thousand O(1) terms in a different order: ~1e-13 relative at worst.
RTOL = 1e-12

FIXTURE_LAYOUTS = [
    (name, R, M)
    for name in BUILTIN_FIXTURES
    for R, M in builtin_fixture(name).valid_layouts(max_world_size=4, max_accum_steps=4)
]


def _batch(fixture) -> dict[str, np.ndarray]:
    return {key: getattr(fixture, key) for key in BATCH_KEYS}


@pytest.mark.parametrize(
    ("fixture", "world_size", "accum_steps"),
    FIXTURE_LAYOUTS,
    ids=[f"{f}-R{R}-M{M}" for f, R, M in FIXTURE_LAYOUTS],
)
@pytest.mark.parametrize("scheme", INTENDED_SCHEMES)
def test_microbatch_terms_match_contract(
    fixture: str, world_size: int, accum_steps: int, scheme: str
) -> None:
    fx = builtin_fixture(fixture)
    model = BilinearLM.from_numpy(fx.params())
    laid_out = fx.layout(world_size, accum_steps)
    reference = get_scheme(scheme)
    # The numpy spec's a_t, each rank's share of D (the spec's D at rank scope) and D.
    a_all = reference.token_weights(laid_out)
    d_ranks = replace(reference, scope="rank").unit_denominators(laid_out)
    plans = layout_plans(scheme, _batch(fx), world_size, accum_steps)
    for rank, (microbatches, view, plan) in enumerate(plans):
        for batch, weights in zip(microbatches, plan.weights, strict=True):
            where = f"{fixture} R={world_size} M={accum_steps} {batch.where}"
            mb = laid_out.microbatch(rank, batch.microbatch)
            a = a_all[rank, batch.microbatch]
            losses = token_terms(fx.params(), mb.inputs, mb.targets).losses
            expected_sum = math.fsum((a * losses).ravel().tolist())
            with torch.no_grad():
                out = microbatch_loss(model, batch, weights, fx.vocab_size)
            got = float(out.weighted_sum)
            assert abs(got - expected_sum) <= RTOL * max(abs(expected_sum), 1.0), where
            np.testing.assert_array_equal(weights.numpy(), a, err_msg=where)
            assert out.valid_tokens == int(mb.valid.sum())
        if plan.fixed is None:
            # Counts are exact; weighted_mean's share is a float sum in another order.
            assert view.update_share() == pytest.approx(d_ranks[rank], rel=1e-15)
    D = plans[0][2].denominator([view.update_share() for _, view, _ in plans])
    assert pytest.approx(reference.global_denominator(laid_out), rel=1e-15) == D


def test_fixed_denominators() -> None:
    batch = _batch(builtin_fixture("packed"))

    def denominator(name: str) -> float:
        plans = layout_plans(name, batch, 2, 2)
        return plans[0][2].denominator([view.update_share() for _, view, _ in plans])

    assert denominator("sum") == 1.0
    assert (
        denominator("constant") == 8 * 64
    )  # slots: every target position of the batch, padding too
    assert denominator("constant:4096") == 4096.0
    with pytest.raises(ValueError, match="must be finite and > 0"):
        get_spec("constant:0")
    with pytest.raises(ValueError, match="unknown spec 'rank-mean'"):
        get_spec("rank-mean")


def test_model_round_trips_params_and_names() -> None:
    fx = builtin_fixture("packed")
    model = BilinearLM.from_numpy(fx.params(), torch.float32)
    assert [name for name, _ in model.named_parameters()] == ["embed", "unembed"]
    assert model.embed.shape == (40, 12) and model.unembed.shape == (12, 40)
    assert model.embed.dtype == torch.float32
    back = numpy_params(model)
    np.testing.assert_array_equal(back["embed"], fx.embed.astype(np.float32))
    assert not fx.embed.flags.writeable  # the fixture stayed read-only; we copied


def _bad_batch(**changes) -> dict[str, np.ndarray]:
    batch = {key: np.array(value) for key, value in _batch(builtin_fixture("packed")).items()}
    for key, (row, pos, value) in changes.items():
        batch[key][row, pos] = value
    return batch


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"targets": (5, 7, 40)},
            "rank 1, microbatch 0, row 1 (global row 5), position 7: target 40 is neither -100",
        ),
        (
            {"inputs": (2, 0, -1)},
            "rank 0, microbatch 1, row 0 (global row 2), position 0: input token -1 is outside",
        ),
        (
            {"weights": (7, 3, -0.5)},
            "rank 1, microbatch 1, row 1 (global row 7), position 3: weight -0.5 must be finite",
        ),
        (
            {"weights": (0, 1, np.nan)},
            "rank 0, microbatch 0, row 0 (global row 0), position 1: weight nan must be finite",
        ),
        (
            {"segment_ids": (3, 0, 0)},
            "rank 0, microbatch 1, row 1 (global row 3), position 0: valid target in segment 0",
        ),
        (
            {"segment_ids": (4, 9, -3)},
            "rank 1, microbatch 0, row 0 (global row 4), position 9: segment id -3 is negative",
        ),
        (
            {"targets": (6, 2, -101)},
            "rank 1, microbatch 1, row 0 (global row 6), position 2: target -101 is neither -100",
        ),
    ],
)
def test_bad_input_names_rank_microbatch_row_position(change: dict, message: str) -> None:
    batch = _bad_batch(**change)
    model = BilinearLM.from_numpy(builtin_fixture("packed").params())
    with pytest.raises(BatchError) as failure:
        for rank in range(2):
            for mb in rank_microbatches(batch, rank, 2, 2):
                microbatch_loss(model, mb, mb.valid.to(torch.float64), 40)
    assert message in str(failure.value)


def test_layout_errors_say_what_and_why() -> None:
    batch = _batch(builtin_fixture("packed"))
    with pytest.raises(BatchError, match=r"8 rows .* world_size=3 x accum_steps=1"):
        rank_microbatches(batch, 0, 3, 1)
    with pytest.raises(BatchError, match="rank 2 is not in a world of size 2"):
        rank_microbatches(batch, 2, 2, 1)
    floats = dict(batch, targets=batch["targets"].astype(np.float64))
    with pytest.raises(BatchError, match="targets must be integers, got float64 holding whole"):
        rank_microbatches(floats, 0, 1, 1)
    with pytest.raises(BatchError, match="weights must be floating point"):
        rank_microbatches(dict(batch, weights=np.ones((8, 64), dtype=np.int64)), 0, 1, 1)
    with pytest.raises(BatchError, match=r"inputs has shape \(8, 63\), targets have \(8, 64\)"):
        rank_microbatches(dict(batch, inputs=batch["inputs"][:, :-1]), 0, 2, 1)


def test_case_options_are_checked_up_front() -> None:
    fx = builtin_fixture("packed")
    common = dict(
        label="c",
        batch=_batch(fx),
        params=fx.params(),
        scheme="token_mean",
        accum_steps=1,
        optimizer=OptimizerSpec(name="sgd", learning_rate=0.1),
    )
    with pytest.raises(ValueError, match="strategy must be one of"):
        UpdateCase(strategy="postnrom", **common)
    with pytest.raises(ValueError, match="postnorm needs a DDP comm hook"):
        UpdateCase(strategy="postnorm", front_end="fsdp2", **common)
    # bfloat16 runs (tests/test_torch_denominators.py); float16 has bf16's precision problem
    # without its range (a count above 65504 is inf), so the reference does not offer it.
    with pytest.raises(ValueError, match="dtype must be one of"):
        UpdateCase(strategy="precount", dtype="float16", **common)
