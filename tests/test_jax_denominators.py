"""The JAX reference keeps every denominator out of the params' dtype (`jax_impl.denominators`).

Through the real step functions (pmap, shard_map and global-view jit, precount and postnorm;
also jax.distributed processes and the resumable loop):

- bfloat16 params: counts stay exact integers (token_mean's D is ragged's 549, which bfloat16
  would round to 548), weighted_mean's D is the float32 sum of the weights (bfloat16 would be
  off by ~2e-3), the accidental schemes divide by exact local counts, and gradients match the
  float64 oracle at the bf16 tolerance.
- float32 params, x64 off, weights summing past 2^24 (dedup-seed, dedup-packed): D is the
  exact weight sum rounded once, the same number at every layout and front-end, where a
  running float32 sum of the same weights is off by several units.
- float64 params under x64, the same fixtures: D is the exact integer and the gradient matches
  the oracle at 1e-12. x64 is global in JAX, so this runs in its own process (this file run as
  a script, `python tests/test_jax_denominators.py --x64 --out OUT.json`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from child_env import jax_env, run_script
from jax_matrix import build_sweep

import jax_impl
from crosscheck import FLOAT32_RTOL, FLOAT64_RTOL, builtin_fixture, loss_and_grad, tree_rel_err
from crosscheck.contract.fixture import BATCH_KEYS, Fixture
from crosscheck.judge.compare import BFLOAT16_RTOL
from jax_impl.denominators import exact_sum

ROOT = Path(__file__).resolve().parents[1]
FRONT_ENDS = ("pmap", "shard_map", "jit")
STRATEGIES = ("precount", "postnorm")
#: The weight sums of these fixtures are integers past 2^24: every layout of their rows.
DEDUP_CASES = (
    ("dedup-seed", "weighted_mean", 1, 1),
    ("dedup-seed", "weighted_mean", 1, 2),
    ("dedup-seed", "weighted_mean", 2, 1),
    ("dedup-packed", "weighted_mean", 1, 4),
    ("dedup-packed", "weighted_mean", 2, 2),
    ("dedup-packed", "weighted_mean", 4, 1),
)
#: packed with one valid token of weight 2^24 and the others 1 (see `heavy_token_fixture`).
HEAVY_TOKEN = "heavy-token"
HEAVY_CASES = (
    (HEAVY_TOKEN, "weighted_mean", 1, 1),
    (HEAVY_TOKEN, "weighted_mean", 2, 2),
    (HEAVY_TOKEN, "weighted_mean", 4, 1),
)
#: Every step whose weight sum passes 2^24.
PAST_2_24_CASES = (*DEDUP_CASES, *HEAVY_CASES)
#: bfloat16 cases at (R, M) = (2, 2): a count bfloat16 cannot hold (549 -> 548) and two weight
#: sums it would round (195.36 -> 195, 24606923 -> 24641536).
BF16_CASES = (
    ("ragged", "token_mean", 2, 2),
    ("soft-weights", "weighted_mean", 2, 2),
    ("dedup-packed", "weighted_mean", 2, 2),
)
U32 = 2.0**-24  # float32 unit roundoff: the relative error of one rounding to nearest
# weighted_mean's D from float32 weights, relative to the float64 sum: the weights are rounded
# to float32 once each (all w_t >= 0, so at most U32 of W in total) and the pair's value once
# more (U32); its low part adds O(n U32^2). Two roundings, doubled for headroom: 4 U32. A
# bfloat16 weight sum is off by up to 2^-9 (1.4e-3 and 1.9e-3 on these fixtures).
WEIGHT_SUM_RTOL = 4 * U32
# rank_mean's and microbatch_mean's logged mean against token_mean's objective, both sum(l) / n
# from the same bfloat16 forward pass in float32: a division against a multiplication by 1 / n,
# two or three roundings of U32 each (16 U32 ~ 1e-6 leaves room); a local count rounded to
# bfloat16 (549 -> 548) is off by 1.8e-3.
LOCAL_MEAN_RTOL = 16 * U32
X64_TIMEOUT_S = 240  # compile-bound: 18 small sweeps in one fresh process, ~30 s on 2 cores
MULTIPROCESS_TIMEOUT_S = 180


@functools.cache
def heavy_token_fixture() -> Fixture:
    """packed, its first valid token weighing 2^24 and every other valid token 1.

    W = 2^24 + 230 is a float32 number, so D must be W exactly. A running float32 sum that
    meets the heavy token first stays at 2^24 (2^24 + 1 rounds back to it, ties to even), and
    so does every partial sum of a plain reduction that holds it: only sums that keep their
    rounding errors get W.
    """
    base = builtin_fixture("packed")
    weights = base.valid.astype(np.float64)
    row, pos = np.argwhere(base.valid)[0]
    weights[row, pos] = 2.0**24
    return dataclasses.replace(
        base,
        name=HEAVY_TOKEN,
        description="packed with one valid token of weight 2^24, the others 1",
        weights=weights,
    )


def get_fixture(name: str) -> Fixture:
    return heavy_token_fixture() if name == HEAVY_TOKEN else builtin_fixture(name)


def valid_weight_sum(fixture_name: str) -> float:
    """W = sum_t w_t v_t of a fixture, in float64 (exact for these fixtures' integers)."""
    fixture = get_fixture(fixture_name)
    return float(np.sum(np.where(fixture.valid, fixture.weights, 0.0)))


def rank_counts(fixture_name: str, R: int) -> list[int]:
    """Valid targets of each rank's contiguous rows, counted by numpy."""
    valid = builtin_fixture(fixture_name).valid
    return [int(block.sum()) for block in np.split(valid, R)]


def step_configs(front_end: str, schemes: Sequence[str]) -> list[jax_impl.StepConfig]:
    """precount and postnorm of each scheme, scheme by scheme (one sweep holds them all);
    precount reduces with pmean (s = R, as DDP) where there is a collective to choose,
    global-view jit has none."""
    optimizer = optax.sgd(0.1)  # unused: the tests read the reduced gradient and D
    collective = "psum" if front_end == "jit" else "pmean"
    return [
        config
        for scheme in schemes
        for config in (
            jax_impl.StepConfig(
                optimizer=optimizer, scheme=scheme, strategy="precount", collective=collective
            ),
            jax_impl.StepConfig(optimizer=optimizer, scheme=scheme, strategy="postnorm"),
        )
    ]


def step_records(
    dtype: str, cases: Sequence[tuple[str, str, int, int]], front_ends: Sequence[str]
) -> list[dict]:
    """One reduced gradient per front-end, case and strategy: what D was and how far the
    gradient is from the float64 oracle's. Plain JSON-able values (the x64 run returns them
    from its own process)."""
    records = []
    for front_end in front_ends:
        for world_size in sorted({R for _, _, R, _ in cases}):
            schemes = sorted({scheme for _, scheme, r, _ in cases if r == world_size})
            configs = step_configs(front_end, schemes)
            sweep, place = build_sweep(front_end, configs, world_size)
            for fixture_name, scheme, R, M in cases:
                if world_size != R:
                    continue
                fixture = get_fixture(fixture_name)
                arrays = {key: getattr(fixture, key) for key in BATCH_KEYS}
                # The weights in the denominator dtype (the default), whatever the params' dtype.
                laid_out = jax_impl.lay_out_global_batch(
                    arrays, R, M, vocab_size=fixture.vocab_size
                )
                batch, params = place(laid_out, jax_impl.params_from_numpy(fixture.params(), dtype))
                want = loss_and_grad(fixture, scheme, R, M)
                first = schemes.index(scheme) * len(STRATEGIES)
                outs = sweep([params] * len(configs), batch)[first : first + len(STRATEGIES)]
                for strategy, out in zip(STRATEGIES, outs, strict=True):
                    grads = {k: np.asarray(v, dtype=np.float64) for k, v in out.grads.items()}
                    records.append(
                        {
                            "case": f"{front_end} {fixture_name}/{scheme} {strategy} R={R} M={M}",
                            "fixture": fixture_name,
                            "D": float(out.global_denominator),
                            "D_dtype": str(out.global_denominator.dtype),
                            "loss_sum_dtype": str(out.rank_loss_sums.dtype),
                            "grads_dtype": str(out.grads["embed"].dtype),
                            "rank_valid_tokens": np.asarray(out.rank_valid_tokens).tolist(),
                            "grad_rel_err": tree_rel_err(grads, want.grads).max_rel_err,
                            "loss": float(out.loss),
                            "oracle_loss": float(want.loss),
                        }
                    )
    return records


# ---- bfloat16 params ------------------------------------------------------------------------


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_bf16_params_keep_an_exact_count_and_a_float32_weight_sum(front_end: str) -> None:
    """bfloat16 params, x64 off: D in float32 (an exact count, or the weight sum rounded to
    float32), the loss sums in float32, the gradient in bfloat16 and within the bf16
    tolerance of the float64 oracle."""
    records = step_records("bfloat16", BF16_CASES, [front_end])
    assert len(records) == len(BF16_CASES) * len(STRATEGIES)
    problems = []  # every failing case named, not only the first
    for r in records:
        what = r["case"]
        if r["fixture"] == "ragged":
            count = int(builtin_fixture("ragged").valid.sum())
            # Counts are integers: exact or wrong (549 is no bfloat16 number).
            if r["D"] != count:
                problems.append(f"{what}: token_mean D = {r['D']!r}, numpy counts {count}")
            if r["rank_valid_tokens"] != rank_counts("ragged", 2):
                problems.append(f"{what}: rank counts {r['rank_valid_tokens']}")
        else:
            W = valid_weight_sum(r["fixture"])
            rel = abs(r["D"] - W) / W
            if not rel <= WEIGHT_SUM_RTOL:  # `not <=`: a NaN D fails too
                problems.append(
                    f"{what}: weighted_mean D = {r['D']!r}, float64 weight sum {W!r}: relative "
                    f"error {rel:.2e} > {WEIGHT_SUM_RTOL:.2e} (float32 rounding)"
                )
        if r["D_dtype"] != "float32" or r["loss_sum_dtype"] != "float32":
            problems.append(
                f"{what}: D is {r['D_dtype']} and the loss sums {r['loss_sum_dtype']}; both "
                "must be float32 with bfloat16 params (never the params' dtype)"
            )
        if r["grads_dtype"] != "bfloat16":
            problems.append(f"{what}: gradient in {r['grads_dtype']}, params are bfloat16")
        # crosscheck.judge.compare's bf16 tolerance: params, logits and the backward matmuls are
        # rounded to 8 bits (2^-9 each); measured worst here ~1e-2.
        if not r["grad_rel_err"] <= BFLOAT16_RTOL:
            problems.append(f"{what}: gradient {r['grad_rel_err']:.2e} from the oracle's")
    assert not problems, f"{len(problems)} problem(s):\n" + "\n".join(problems)


def test_bf16_accidental_local_means_divide_by_exact_counts() -> None:
    """rank_mean and microbatch_mean with bfloat16 params on ragged at R = M = 1: their logged
    mean is sum(l) / 549, the intended token_mean's objective, not sum(l) / 548."""
    fixture = builtin_fixture("ragged")
    arrays = {key: getattr(fixture, key) for key in BATCH_KEYS}
    batch = jax_impl.lay_out_global_batch(arrays, 1, 1, vocab_size=fixture.vocab_size)
    params = jax_impl.params_from_numpy(fixture.params(), "bfloat16")
    common = {"optimizer": optax.sgd(0.1)}
    # The hand-written accidental gradients are gone: the same loops as the specs' naive step.
    naive = {"strategy": "precount", "collective": "pmean"}
    configs = [
        jax_impl.StepConfig(**common),
        jax_impl.StepConfig(scheme="rank_mean", **naive, **common),
        jax_impl.StepConfig(scheme="microbatch_mean", **naive, **common),
    ]
    token_mean, rank_mean, microbatch_mean = jax_impl.make_pmap_sweep(configs, 1)(
        [params] * 3, batch
    )
    assert float(token_mean.global_denominator) == 549  # an integer: exact or wrong
    want = float(token_mean.loss)
    for name, out in (("rank_mean", rank_mean), ("microbatch_mean", microbatch_mean)):
        assert out.loss.dtype == jnp.float32, f"{name}: loss in {out.loss.dtype}"
        assert int(out.rank_valid_tokens[0]) == 549, name
        rel = abs(float(out.loss) - want) / want
        assert rel <= LOCAL_MEAN_RTOL, (
            f"{name}: mean {float(out.loss)!r} vs token_mean's {want!r} (relative {rel:.2e}): "
            "the local count was not divided exactly"
        )


def test_bf16_multiprocess_keeps_exact_denominators(tmp_path: Path) -> None:
    """jax.distributed with two real processes, bfloat16 params: the same D as in-process."""
    from crosscheck.launch.workers import SMALL_PROGRAM_XLA_FLAGS
    from jax_impl.harness.multiprocess import launch_multiprocess

    cases = [("ragged", "token_mean", 2), ("dedup-packed", "weighted_mean", 2)]
    spec = {
        "x64": False,
        "optimizer": {"name": "sgd", "learning_rate": 0.1},
        "max_grad_norm": None,
        "num_updates": 1,
        "variants": [["precount", "pmean"], ["postnorm", "psum"]],
        "schemes": sorted({scheme for _, scheme, _ in cases}),
        "dtypes": ["bfloat16"],
        "cases": [
            {"fixture": str(builtin_fixture(name).save(tmp_path / f"{name}.npz")), "accum_steps": M}
            for name, _, M in cases
        ],
    }
    outputs = launch_multiprocess(
        spec,
        2,
        tmp_path / "run",
        timeout_s=MULTIPROCESS_TIMEOUT_S,
        extra_xla_flags=SMALL_PROGRAM_XLA_FLAGS,
    )
    for index, (name, scheme, M) in enumerate(cases):
        want = loss_and_grad(builtin_fixture(name), scheme, 2, M)
        for variant in ("precount-pmean", "postnorm-psum"):
            key = f"{index}/bfloat16/{variant}/{scheme}/0"
            for out in outputs:
                what = f"multiprocess {name}/{scheme} {variant} process {int(out['rank'])}"
                D = out[f"{key}/global_denominator"]
                assert D.dtype == np.float32, f"{what}: D in {D.dtype}"
                if scheme == "token_mean":
                    assert float(D) == want.denominator, f"{what}: D = {float(D)!r}"  # exact
                else:
                    rel = abs(float(D) - want.denominator) / want.denominator
                    assert rel <= WEIGHT_SUM_RTOL, f"{what}: D = {float(D)!r}, rel {rel:.2e}"
                grads = {k: out[f"{key}/grads.{k}"].astype(np.float64) for k in want.grads}
                err = tree_rel_err(grads, want.grads).max_rel_err
                assert err <= BFLOAT16_RTOL, f"{what}: gradient {err:.2e} from the oracle's"


def test_bf16_resume_mid_window_sums_weights_like_an_unbroken_window(tmp_path: Path) -> None:
    """The resumable loop with bfloat16 params, postnorm, stopped after 1 of 2 microbatches of
    update 2, checkpointed (the weight-sum pairs included) and restored: the same params,
    bit for bit, as the run that was never stopped (same additions in the same order)."""
    from jax_impl.checkpoint import batch_fingerprint
    from jax_impl.resume import ResumableLoop, restore_train_state, save_train_state

    fixture = builtin_fixture("dedup-packed")
    arrays = {key: getattr(fixture, key) for key in BATCH_KEYS}
    batch = jax_impl.lay_out_global_batch(arrays, 2, 2, vocab_size=fixture.vocab_size)
    params = jax_impl.params_from_numpy(fixture.params(), "bfloat16")
    config = jax_impl.StepConfig(
        optimizer=optax.adamw(1e-2), scheme="weighted_mean", strategy="postnorm"
    )
    loop = ResumableLoop(config, 2, 2)
    fingerprint = batch_fingerprint(arrays)
    unbroken = loop.run(loop.init(params), batch, until_updates=2)
    stopped = loop.run(loop.init(params), batch, until_updates=1, then_microbatches=1)
    # The partial window keeps no weight-sum pairs any more (postnorm reduces D's channels at
    # the window's end): its loss sums and saved D are checked to be float32, not bfloat16.
    assert stopped.partial.loss_sums.dtype == stopped.partial.denominator.dtype == np.float32
    save_train_state(tmp_path / "ckpt", loop, stopped, fingerprint)
    restored = restore_train_state(tmp_path / "ckpt", loop, params, fingerprint)
    resumed = loop.run(restored, batch, until_updates=2)
    for key in params:
        np.testing.assert_array_equal(
            np.asarray(resumed.params[key], np.float32),
            np.asarray(unbroken.params[key], np.float32),
            err_msg=f"{key}: resumed bfloat16 run differs from the unbroken one",
        )


# ---- float32 past 2^24 ----------------------------------------------------------------------


def test_float32_weight_sum_past_2_24_rounds_once() -> None:
    """float32 params, x64 off, integer weights summing past 2^24: D is the exact W rounded
    once, the same number at every layout, front-end and strategy. dedup-seed and
    dedup-packed sum to an odd W (halfway between two float32 numbers: either passes);
    heavy-token to a float32 number (D must be W). A running float32 sum misses all three."""
    records = step_records("float32", PAST_2_24_CASES, FRONT_ENDS)
    assert len(records) == len(PAST_2_24_CASES) * len(FRONT_ENDS) * len(STRATEGIES)
    problems = []
    for fixture_name in ("dedup-seed", "dedup-packed", HEAVY_TOKEN):
        W = valid_weight_sum(fixture_name)
        assert W > 2**24 and int(W) == W, f"{fixture_name}: W = {W}"
        # One rounding of the exact W: at most half the float32 spacing there (2 past 2^24).
        half_spacing = float(np.spacing(np.float32(W))) / 2
        fixture = get_fixture(fixture_name)
        weights = np.where(fixture.valid, fixture.weights, 0).astype(np.float32).ravel()
        running = float(np.cumsum(weights, dtype=np.float32)[-1])  # sequential float32 sum
        assert abs(running - W) > half_spacing, (
            f"{fixture_name}: a running float32 sum ({running!r}) is within half a spacing "
            f"of W = {W!r}: this check could not tell it from a sum that rounds once"
        )
        own = [r for r in records if r["fixture"] == fixture_name]
        for r in own:
            if r["D_dtype"] != "float32":
                problems.append(f"{r['case']}: D in {r['D_dtype']}")
            if not abs(r["D"] - W) <= half_spacing:
                problems.append(
                    f"{r['case']}: D = {r['D']!r}, exact W = {W!r}: off by {abs(r['D'] - W)}, "
                    f"more than one float32 rounding ({half_spacing}); a running float32 sum "
                    f"gives {running!r}"
                )
            # float32 end to end: crosscheck.judge.compare's float32 tolerance.
            if not r["grad_rel_err"] <= FLOAT32_RTOL:
                problems.append(f"{r['case']}: gradient {r['grad_rel_err']:.2e} from the oracle's")
        if len({r["D"] for r in own}) != 1:
            problems.append(f"{fixture_name}: D differs by layout: {sorted({r['D'] for r in own})}")
    assert not problems, f"{len(problems)} problem(s):\n" + "\n".join(problems)


# ---- float64 past 2^24 (x64, own process) ---------------------------------------------------


@pytest.mark.x64
def test_float64_weight_sum_past_2_24_is_exact(tmp_path: Path) -> None:
    """float64 params under x64, the weight sums past 2^24 of the float32 test: D is W exactly
    (integers below 2^53: no partial sum of these weights rounds) and the gradient matches the
    oracle at 1e-12, at every layout, front-end and strategy."""
    out = tmp_path / "x64.json"
    env = jax_env("--xla_force_host_platform_device_count=8")
    run_script(
        __file__, "--x64", "--out", str(out), env=env, timeout=X64_TIMEOUT_S, what="x64 process"
    )
    records = json.loads(out.read_text())
    assert len(records) == len(PAST_2_24_CASES) * len(FRONT_ENDS) * len(STRATEGIES)
    for r in records:
        W = valid_weight_sum(r["fixture"])
        assert r["D_dtype"] == "float64", f"{r['case']}: D in {r['D_dtype']}"
        # Integers: exact or wrong.
        assert r["D"] == W, f"{r['case']}: D = {r['D']!r}, exact W = {W!r}"
        # crosscheck.judge.compare's float64 tolerance: only the order of a few roundings differs.
        assert r["grad_rel_err"] <= FLOAT64_RTOL, (
            f"{r['case']}: gradient {r['grad_rel_err']:.2e} from the oracle's"
        )


# ---- the pieces -------------------------------------------------------------------------------


def test_exact_sum_keeps_what_a_running_sum_loses() -> None:
    """2^24 followed by 1000 ones: a running float32 sum stays at 2^24 (each + 1 rounds back),
    the pair holds 2^24 + 1000 exactly, under jit and vmap alike."""
    values = np.concatenate([[2.0**24], np.ones(1000)]).astype(np.float32)
    assert float(np.cumsum(values, dtype=np.float32)[-1]) == 2.0**24  # the running sum's loss
    pair = jax.jit(exact_sum)(jnp.asarray(values))
    assert float(pair.hi) + float(pair.lo) == 2**24 + 1000 and float(pair.value()) == 2**24 + 1000
    rows = jax.jit(jax.vmap(exact_sum))(jnp.stack([values, values[::-1]]))
    np.testing.assert_array_equal(np.asarray(rows.value()), [2**24 + 1000] * 2)


def test_narrow_weights_and_denominators_are_refused() -> None:
    """Weights or an accumulated denominator narrower than float32 fail with what to do."""
    fixture = builtin_fixture("soft-weights")
    arrays = {key: getattr(fixture, key) for key in BATCH_KEYS}
    with pytest.raises(ValueError, match="weights_dtype=float32"):
        jax_impl.lay_out_global_batch(arrays, 1, 1, vocab_size=40, weights_dtype="bfloat16")
    batch = jax_impl.lay_out_global_batch(arrays, 1, 1, vocab_size=40)
    narrow = dataclasses.replace(batch, weights=batch.weights.astype(jnp.bfloat16))
    params = jax_impl.params_from_numpy(fixture.params(), "float32")
    # scheme_terms is gone: the same refusal checked where the spec path reads the weights,
    # a micro-step's loss and d, and the step.
    with pytest.raises(ValueError, match="already rounded to 8 significant bits"):
        jax_impl.microbatch_loss(params, jax.tree.map(lambda x: x[0, 0], narrow), "weighted_mean")
    config = jax_impl.StepConfig(optimizer=optax.sgd(1.0), scheme="weighted_mean")
    with pytest.raises(ValueError, match="already rounded to 8 significant bits"):
        jax_impl.make_pmap_gradients(config, 1)(params, narrow)
    with pytest.raises(ValueError, match="denominator_dtype=bfloat16"):
        jax_impl.token_weighted_accumulation(optax.sgd(1.0), 1, denominator_dtype=jnp.bfloat16)


def test_token_weighted_divides_bf16_gradients_in_float32() -> None:
    """An emitted bfloat16 update is g / D formed in float32 and rounded once: with D = 1001
    (bfloat16 would hold 1000) it equals bf16(g / 1001) exactly. For these g, bf16(g / 1000)
    is another bfloat16 number."""
    opt = jax_impl.token_weighted_accumulation(optax.sgd(-1.0), 1)  # update = +g / D
    grads = {"w": jnp.asarray([3.0, 19.0, 37.0], jnp.bfloat16)}
    state = opt.init(grads)
    updates, _ = opt.update(grads, state, grads, denominator=jnp.int32(1001))
    want = (np.asarray(grads["w"], np.float32) / np.float32(1001)).astype(jnp.bfloat16)
    assert updates["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(updates["w"]), want)


def main(argv: Sequence[str] | None = None) -> int:
    """The x64 run: float64 steps whose weights sum past 2^24, records written as JSON."""
    parser = argparse.ArgumentParser(description="float64 dedup steps under x64")
    parser.add_argument("--x64", action="store_true", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    jax.config.update("jax_enable_x64", True)
    jax_impl.require_devices(4)  # fail, never skip, when the devices are missing
    args.out.write_text(json.dumps(step_records("float64", PAST_2_24_CASES, FRONT_ENDS)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
