"""Every denominator of torch_impl is exact, whatever the params' dtype, bf16 included.

docs/contract.md: D must stay exact. Integer counts stop being exact in float32 past 2^24 and in
bf16 past 256, and a weight sum rounded to bf16 keeps 8 significant bits. torch_impl keeps every
count an integer, every d, D, weight sum and loss sum in float64, and divides by D in float64 before
casting to the params' dtype. The tests run the real steps (DDP precount, DDP postnorm with its comm
hook, FSDP2 precount) on R = 2 gloo processes, all in one launch, and check:

* bf16 params: token_mean's D is the numpy count exactly and weighted_mean's D is the float64
  sum of the weights, through precount's count collective, postnorm's carry inside a bf16
  gradient bucket and FSDP2; the plain mean-loss loop (the accidental schemes) divides by an
  exact count too;
* float64: weighted_mean on dedup-seed and dedup-packed, whose integer weights sum past 2^24,
  has the oracle's D exactly and the oracle's gradient to 1e-12;
* float32: there D stays exact as well (postnorm carries it in float32 limbs), and postnorm
  divides by that exact D, not by D rounded to float32.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import pytest
import torch
from resume_grid import resume_case
from torch.nn.parallel import DistributedDataParallel

from crosscheck import FLOAT32_RTOL, FLOAT64_RTOL, Fixture, assert_tree_close, builtin_fixture
from crosscheck.contract.cases import ResumeCase, ResumeOutput, TrainSettings
from crosscheck.contract.layout import IGNORE_INDEX
from crosscheck.contract.oracle import loss_and_grad
from crosscheck.judge.compare import BFLOAT16_RTOL
from crosscheck.run.torch_runner import run_resume
from torch_impl.batch import BATCH_KEYS, rank_microbatches
from torch_impl.comm_hooks import PostnormState, sum_and_carry_hook
from torch_impl.division import divide_exactly
from torch_impl.harness.cases import RankOutput, UpdateCase, run_cases
from torch_impl.harness.launcher import launch
from torch_impl.losses import microbatch_loss, token_losses
from torch_impl.mean_loss import accumulate_mean_loss
from torch_impl.model import BilinearLM, numpy_grads
from torch_impl.optimizers import OptimizerSpec
from torch_impl.spec import DenominatorSpec, get_spec
from torch_impl.update import accumulate_postnorm, layout_plans

WORLD_SIZE = 2
#: Each launch must finish within this: the whole module's cases take a few seconds.
LAUNCH_TIMEOUT_S = 240.0
#: The only update of every case; the gradient checked is the reduced one, before any step.
SGD = OptimizerSpec(name="sgd", learning_rate=0.1)
TWO_TO_24 = 2.0**24

# bf16 gradients against the float64 oracle: docs/contract.md's bf16 tolerance. The params and the
# logits are rounded to bf16 (2^-9 relative each) and the backward and the gradient
# all-reduce run in bf16: one bf16 forward and backward is already 5e-3 to 9e-3 off on the
# built-in fixtures, the bf16 matrix of `crosscheck run` measures <= 1.5e-2 and these cases
# <= 1.4e-2. It only guards against a gross error; the denominators are held far tighter.
BF16_GRAD_RTOL = BFLOAT16_RTOL
# float64: docs/contract.md's 1e-12 (a handful of reductions of O(1) terms; measured ~1e-15).
FLOAT64_GRAD_RTOL = FLOAT64_RTOL
# float32: docs/contract.md's 1e-5 (float32 rounding accumulated over ~1000 tokens, ~1e-6).
FLOAT32_GRAD_RTOL = FLOAT32_RTOL
# A weight sum D (weighted_mean) against numpy's: the contract asks for float32 or better
# (2^-24 = 6e-8). On CPU torch_impl sums in float64, so it is held to float64: both sides add
# the same at most 512 float64 weights, only in another order, which moves the sum by at most
# n eps = 512 x 1.1e-16 = 6e-14 (measured: a few ulps, ~1e-16). A weight sum carried in bf16
# would be off by up to 2e-3, in float32 by up to 6e-8: both fail this.
WEIGHT_SUM_RTOL = 1e-13
# The mean-loss loop's per-microbatch mean (F.cross_entropy, reduction="mean", on logits upcast
# to float32) against sum / count from the token_mean run of the same bf16 params: the same
# float32 per-token losses, summed in float32 by torch and in float64 by torch_impl. 899
# float32 additions can drift by at most n eps = 899 x 6e-8 = 5.4e-5 relative; a token count
# kept in bf16 (899 counted as 900) is 1.1e-3 off. 1e-4 lies between.
MEAN_LOSS_RTOL = 1e-4


@functools.cache
def seed_899() -> Fixture:
    """`seed` with one more target of row 1 ignored: rank 1 holds 899 valid tokens at R = 2.

    Neither 899 nor D = 100 + 899 = 999 is a bf16 number (bf16 spaces integers 4 apart in
    [512, 1024)): a count or a D that passed through bf16 anywhere would be off by one.
    """
    base = builtin_fixture("seed")
    targets = np.array(base.targets)
    row = 1
    position = int(np.flatnonzero(targets[row] != IGNORE_INDEX)[-1])
    targets[row, position] = IGNORE_INDEX
    return dataclasses.replace(
        base,
        name="seed-899",
        description="seed with rank 1 holding 899 valid targets, not a bf16 number",
        targets=targets,
    )


def fixture_named(name: str) -> Fixture:
    return seed_899() if name == "seed-899" else builtin_fixture(name)


#: (fixture, scheme, accum_steps) of the bf16 checks; each runs under every STEP.
BF16_RUNS = [("seed-899", "token_mean", 1), ("soft-weights", "weighted_mean", 2)]
#: (strategy, front-end): the real steps every denominator goes through.
STEPS = [("precount", "ddp"), ("postnorm", "ddp"), ("precount", "fsdp2")]
#: (fixture, accum_steps) whose weighted_mean D passes 2^24 (25165513 and 24606923).
DEDUP_RUNS = [("dedup-seed", 1), ("dedup-packed", 2)]
DEDUP_STRATEGIES = ["precount", "postnorm"]
DEDUP_DTYPES = ["float64", "float32"]


#: Every case of the module: one SGD update, unclipped (the tests read its gradient and D).
ONE_SGD_UPDATE = {"optimizer": SGD, "num_updates": 1, "max_grad_norm": None}


def label(fixture: str, scheme: str, strategy: str, front_end: str, dtype: str) -> str:
    return f"{fixture}-{scheme}-{strategy}-{front_end}-{dtype}"


def _case(
    fixture: str, scheme: str, strategy: str, front_end: str, dtype: str, accum_steps: int
) -> UpdateCase:
    fx = fixture_named(fixture)
    return UpdateCase(
        label=label(fixture, scheme, strategy, front_end, dtype),
        batch={key: np.asarray(getattr(fx, key)) for key in BATCH_KEYS},
        params=fx.params(),
        **ONE_SGD_UPDATE,
        scheme=scheme,
        strategy=strategy,
        accum_steps=accum_steps,
        dtype=dtype,
        front_end=front_end,
    )


def cases() -> list[UpdateCase]:
    """Every case of the module, for one launch of WORLD_SIZE ranks."""
    out = [
        _case(fixture, scheme, strategy, front_end, "bfloat16", M)
        for fixture, scheme, M in BF16_RUNS
        for strategy, front_end in STEPS
    ]
    # The plain reduction="mean" loop on the same bf16 params: rank_mean at M = 1.
    out.append(_case("seed-899", "token_mean", "mean_loss", "ddp", "bfloat16", 1))
    out += [
        _case(fixture, "weighted_mean", strategy, "ddp", dtype, M)
        for fixture, M in DEDUP_RUNS
        for strategy in DEDUP_STRATEGIES
        for dtype in DEDUP_DTYPES
    ]
    return out


def _postnorm_division(
    rank: int, world_size: int
) -> dict[str, tuple[dict[str, np.ndarray], float]]:
    """float32 postnorm on dedup-seed at (R, 1): weighted_mean, and the same step with D = 1.

    Both runs sum the same unnormalized gradients bit for bit (same params, same a_t, a fresh
    DDP with the same buckets); the first then divides by D = 25165513, the second by 1.
    Returns scheme name -> (float32 gradients, D).
    """
    fixture = builtin_fixture("dedup-seed")
    batch = {key: np.asarray(getattr(fixture, key)) for key in BATCH_KEYS}
    microbatches = rank_microbatches(batch, rank, world_size, 1)
    normalized = get_spec("weighted_mean")
    # weighted_mean's a_t over D = 1: the same unnormalized sum, not divided.
    unnormalized = dataclasses.replace(
        normalized, denominator=DenominatorSpec(kind="one"), name="weighted_sum"
    )
    out = {}
    for scheme in (normalized, unnormalized):
        ddp = DistributedDataParallel(BilinearLM.from_numpy(fixture.params(), torch.float32))
        state = PostnormState(rank=rank, world_size=world_size)
        ddp.register_comm_hook(state, sum_and_carry_hook)
        done = accumulate_postnorm(
            ddp, microbatches, scheme, vocab_size=fixture.vocab_size, hook_state=state
        )
        grads = {
            name.rsplit(".", 1)[-1]: p.grad.detach().numpy().copy()
            for name, p in ddp.named_parameters()
        }
        out[scheme.name] = (grads, done.global_denominator)
    return out


def _run(rank: int, world_size: int, module_cases: list[UpdateCase]) -> tuple:
    """A launch target: every case, then the division check, on this rank."""
    return run_cases(rank, world_size, module_cases), _postnorm_division(rank, world_size)


@functools.cache
def results() -> tuple[dict[str, list[RankOutput]], list[dict]]:
    """label -> every rank's output; and every rank's `_postnorm_division`."""
    module_cases = cases()
    per_rank = launch(_run, WORLD_SIZE, (module_cases,), timeout_s=LAUNCH_TIMEOUT_S)
    outputs = {
        case.label: [outputs[i] for outputs, _ in per_rank] for i, case in enumerate(module_cases)
    }
    return outputs, [division for _, division in per_rank]


def numpy_weight_sum(fixture: Fixture) -> float:
    """D of weighted_mean from the fixture alone: the exact float64 sum of w_t v_t."""
    return math.fsum((fixture.weights * fixture.valid).ravel().tolist())


def rank_counts(fixture: Fixture) -> list[int]:
    """Valid targets per rank at R = WORLD_SIZE, counted by numpy."""
    rows = fixture.num_rows // WORLD_SIZE
    return [int(fixture.valid[r * rows : (r + 1) * rows].sum()) for r in range(WORLD_SIZE)]


@pytest.mark.parametrize(("strategy", "front_end"), STEPS)
def test_bf16_token_count_is_exact(strategy: str, front_end: str) -> None:
    """bf16 params, token_mean: D = 999 and the per-rank counts (100, 899), exactly."""
    fx = seed_899()
    name = label("seed-899", "token_mean", strategy, front_end, "bfloat16")
    counts = rank_counts(fx)
    assert counts == [100, 899]  # the fixture is what the test needs
    expected_D = float(sum(counts))
    for output in results()[0][name]:
        metrics = output.updates[0].metrics
        what = f"{name}, rank {output.rank}"
        assert list(metrics.rank_valid_tokens) == counts, f"{what}: valid tokens"
        assert list(metrics.rank_denominators) == [float(n) for n in counts], f"{what}: d"
        assert metrics.global_denominator == expected_D, (
            f"{what}: D = {metrics.global_denominator!r}, the numpy count is {expected_D!r}"
        )
        oracle = loss_and_grad(fx, "token_mean", WORLD_SIZE, 1)
        assert oracle.denominator == expected_D
        assert_tree_close(output.updates[0].grads, oracle.grads, BF16_GRAD_RTOL, what)


@pytest.mark.parametrize(("strategy", "front_end"), STEPS)
def test_bf16_weight_sum_is_float64(strategy: str, front_end: str) -> None:
    """bf16 params, weighted_mean on soft-weights at (2, 2): D is numpy's float64 weight sum."""
    fx = builtin_fixture("soft-weights")
    name = label("soft-weights", "weighted_mean", strategy, front_end, "bfloat16")
    expected_D = numpy_weight_sum(fx)
    oracle = loss_and_grad(fx, "weighted_mean", WORLD_SIZE, 2)
    rows = fx.num_rows // WORLD_SIZE
    for output in results()[0][name]:
        metrics = output.updates[0].metrics
        what = f"{name}, rank {output.rank}"
        D = metrics.global_denominator
        assert abs(D - expected_D) <= WEIGHT_SUM_RTOL * expected_D, (
            f"{what}: D = {D!r}, numpy's weight sum is {expected_D!r}"
        )
        for rank, d in enumerate(metrics.rank_denominators):
            part = (
                fx.weights[rank * rows : (rank + 1) * rows]
                * fx.valid[rank * rows : (rank + 1) * rows]
            )
            expected_d = math.fsum(part.ravel().tolist())
            assert abs(d - expected_d) <= WEIGHT_SUM_RTOL * expected_d, f"{what}: rank {rank} d"
        assert_tree_close(output.updates[0].grads, oracle.grads, BF16_GRAD_RTOL, what)


def test_bf16_mean_loss_divides_by_the_exact_count() -> None:
    """The accidental loop's mean is float32 and divides by 899 on rank 1, not by bf16's 900.

    Without the upcast of the logits both the mean and its token count would be bf16.
    """
    counted = results()[0][label("seed-899", "token_mean", "precount", "ddp", "bfloat16")]
    mean_loop = results()[0][label("seed-899", "token_mean", "mean_loss", "ddp", "bfloat16")]
    for reference, output in zip(counted, mean_loop, strict=True):
        metrics = reference.updates[0].metrics
        rank = output.rank
        (mean,) = output.updates[0].mean_losses  # M = 1: one mean per rank
        expected = metrics.rank_loss_sums[rank] / metrics.rank_valid_tokens[rank]
        assert abs(mean - expected) <= MEAN_LOSS_RTOL * abs(expected), (
            f"rank {rank}: mean loss {mean!r}, sum / {metrics.rank_valid_tokens[rank]} valid "
            f"tokens = {expected!r}"
        )


#: dtype -> the gradient tolerance of the dedup runs.
DEDUP_GRAD_RTOL = {"float64": FLOAT64_GRAD_RTOL, "float32": FLOAT32_GRAD_RTOL}


@pytest.mark.parametrize("dtype", DEDUP_DTYPES)
@pytest.mark.parametrize("strategy", DEDUP_STRATEGIES)
@pytest.mark.parametrize(("fixture", "accum_steps"), DEDUP_RUNS)
def test_denominator_past_two_to_the_24(
    fixture: str, accum_steps: int, strategy: str, dtype: str
) -> None:
    """weighted_mean with integer weights summing past 2^24: D exact and the gradient within the
    dtype's tolerance. float64: every partial sum is an integer below 2^53, so D is exact;
    float32 params: D stays exact too (precount: float64 slots; postnorm: limbs)."""
    fx = builtin_fixture(fixture)
    oracle = loss_and_grad(fx, "weighted_mean", WORLD_SIZE, accum_steps)
    assert oracle.denominator > TWO_TO_24 and oracle.denominator == numpy_weight_sum(fx)
    # Odd totals: no float32 number equals them, so any float32 rounding of D shows.
    assert oracle.denominator % 2 == 1
    name = label(fixture, "weighted_mean", strategy, "ddp", dtype)
    for output in results()[0][name]:
        metrics = output.updates[0].metrics
        what = f"{name}, rank {output.rank}"
        assert metrics.global_denominator == oracle.denominator, (
            f"{what}: D = {metrics.global_denominator!r}, the oracle's is {oracle.denominator!r}"
        )
        assert_tree_close(output.updates[0].grads, oracle.grads, DEDUP_GRAD_RTOL[dtype], what)


def test_float32_postnorm_divides_by_the_exact_denominator() -> None:
    """postnorm's quotient is G / D with the exact D, in float64, cast to float32: bit for bit.

    G, the unnormalized float32 sum, comes from the same step with D = 1. Dividing by D
    rounded to float32 (25165512, what ``grad.div_(D)`` does) changes about half the entries.
    """
    expected_D = numpy_weight_sum(builtin_fixture("dedup-seed"))
    for rank, division in enumerate(results()[1]):
        grads, D = division["weighted_mean"]
        sums, one = division["weighted_sum"]
        assert D == expected_D == 25165513.0 and one == 1.0, f"rank {rank}: D = {D!r}"
        for name, grad in grads.items():
            assert grad.dtype == np.float32
            exact = (sums[name].astype(np.float64) / expected_D).astype(np.float32)
            mismatched = int(np.sum(grad != exact))
            assert mismatched == 0, (
                f"rank {rank}: {mismatched} of {grad.size} {name} entries are not "
                f"float32(G / {expected_D:.0f})"
            )


def test_float32_division_by_a_float32_exact_denominator_is_correctly_rounded() -> None:
    """D exact in float32 (every count below 2^24) divides the float32 gradient in place: one
    IEEE division, numpy's float32 quotient bit for bit. An odd D past 2^24 still divides in
    float64 and casts, never by D rounded to float32."""
    grad = torch.randn(100_000, generator=torch.Generator().manual_seed(0), dtype=torch.float32)
    for D in (977.0, 2.0**24, 1.5):
        quotient = grad.clone()
        divide_exactly(quotient, D)
        assert np.array_equal(quotient.numpy(), grad.numpy() / np.float32(D)), D
    odd = 25165513.0  # dedup-seed's D: float32 would round it to 25165512
    quotient = grad.clone()
    divide_exactly(quotient, odd)
    exact = (grad.numpy().astype(np.float64) / odd).astype(np.float32)
    assert np.array_equal(quotient.numpy(), exact)
    assert not np.array_equal(exact, grad.numpy() / np.float32(odd))


def test_bf16_microbatch_terms_are_float64() -> None:
    """In-process: a bf16 model's per-token losses are float32, a_t, d and the sum float64."""
    fx = builtin_fixture("soft-weights")
    model = BilinearLM.from_numpy(fx.params(), torch.bfloat16)
    batch = {key: np.asarray(getattr(fx, key)) for key in BATCH_KEYS}
    ((microbatches, weighted, plan),) = layout_plans("weighted_mean", batch, 1, 1)
    ((_, counted_view, counted_plan),) = layout_plans("token_mean", batch, 1, 1)
    (microbatch,) = microbatches
    with torch.no_grad():
        losses = token_losses(model(microbatch.inputs), microbatch.targets)
        out = microbatch_loss(model, microbatch, plan.weights[0], fx.vocab_size)
        counted = microbatch_loss(model, microbatch, counted_plan.weights[0], fx.vocab_size)
    assert losses.dtype == torch.float32  # upcast from the bf16 logits, as HF's logits.float()
    assert plan.weights[0].dtype == torch.float64 and out.weighted_sum.dtype == torch.float64
    # d is computed from the float64 weights alone, in float64: numpy's sum up to summation
    # order (WEIGHT_SUM_RTOL); the count is an int.
    expected_D = numpy_weight_sum(fx)
    assert abs(weighted.update_share() - expected_D) <= WEIGHT_SUM_RTOL * expected_D
    assert counted_view.update_share() == float(fx.valid.sum()) and counted.valid_tokens == 138
    # The logged sum is float64 of the float32 losses: summing them in float64 here agrees to
    # float64 rounding of 512 terms (WEIGHT_SUM_RTOL), whatever bf16 did to the logits.
    weights = torch.where(
        microbatch.valid, microbatch.weights, torch.zeros_like(microbatch.weights)
    )
    expected = math.fsum((weights * losses.to(torch.float64)).ravel().tolist())
    assert abs(float(out.weighted_sum) - expected) <= WEIGHT_SUM_RTOL * abs(expected)


def test_bf16_mean_loss_gradient_uses_the_exact_count() -> None:
    """In-process, rank 1's microbatch of seed-899 (899 valid tokens) in a bf16 model.

    The mean-loss loop (rank_mean = token_mean on one microbatch) and the token sum divided by
    the exact count backpropagate the same float32 seed round32(1/899) per token through the
    same float32 cross-entropy and the same bf16 model, so their gradients are equal bit for
    bit. A mean over bf16 logits divides by a bf16 count (899 -> 900) and differs in most
    entries.
    """
    fx = seed_899()
    batch = {key: np.asarray(getattr(fx, key)) for key in BATCH_KEYS}
    (microbatch,) = rank_microbatches(batch, 1, WORLD_SIZE, 1)
    assert int(microbatch.valid.sum()) == 899
    mean_model = BilinearLM.from_numpy(fx.params(), torch.bfloat16)
    accumulate_mean_loss(mean_model, [microbatch], vocab_size=fx.vocab_size)
    sum_model = BilinearLM.from_numpy(fx.params(), torch.bfloat16)
    weights = microbatch.valid.to(torch.float64)  # token_mean's a_t
    out = microbatch_loss(sum_model, microbatch, weights, fx.vocab_size)
    denominator = float(microbatch.valid.sum())
    (out.weighted_sum / denominator).backward()
    assert denominator == 899.0
    for name, grad in numpy_grads(mean_model).items():
        expected = numpy_grads(sum_model)[name]
        mismatched = int(np.sum(grad != expected))
        assert mismatched == 0, f"{mismatched} of {grad.size} {name} entries differ"


@pytest.mark.parametrize("strategy", DEDUP_STRATEGIES)
def test_bf16_resume_inside_an_update_is_exact(strategy: str) -> None:
    """bf16, weighted_mean on soft-weights at (2, 2): stop after update 1 + 1 microbatch,
    checkpoint, resume in fresh processes: the params after update 3 are the uninterrupted
    run's, bit for bit.

    The partial sums (d, loss sum, valid tokens) travel as float64 and int in the checkpoint,
    the partial bf16 gradient as it was; at R = 2 every all-reduce adds two numbers, which no
    reordering can change. So nothing may differ: a partial d saved in bf16 would move D.
    """
    layout = (WORLD_SIZE, 2)
    case = resume_case(
        "torch-ddp", "soft-weights", "weighted_mean", strategy, (layout, 1, layout), "bfloat16"
    )
    assert case.num_updates == 3
    reports: dict[ResumeCase, ResumeOutput | BaseException] = {}
    run_resume([case], TrainSettings(num_updates=3), reports.__setitem__)
    output = reports[case]
    if isinstance(output, BaseException):
        raise output
    for name, value in output.resumed.items():
        assert np.isfinite(value).all(), f"{case.describe()}: {name} is not finite"
        mismatched = int(np.sum(value != output.uninterrupted[name]))
        assert mismatched == 0, (
            f"{case.describe()}: {mismatched} of {value.size} {name} entries after update 3 "
            "differ from the uninterrupted run"
        )
