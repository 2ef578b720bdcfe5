"""Reproduced bugs and edge cases under pmap and shard_map, against the oracle.

- rank_mean and microbatch_mean, as real loops compute them (each unit's own mean, then
  pmean: their specs under precount with pmean), reproduce the oracle's accidental schemes,
  including the seed example's 9x.
- A mis-scaled reduction factor s is caught by the same comparison the matrix uses: the tests
  of tests/jax_matrix.py can fail.
- An update without a single valid target (D = 0) gives zero gradients, never NaN, in every
  front-end.
- shard_map's autodiff already sums the gradient of replicated params over ranks, which is
  why jax_impl casts params to rank-varying before jax.grad.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax_matrix import (
    ADAMW,
    MAX_GRAD_NORM,
    NUM_UPDATES,
    adamw,
    build_sweep,
    failures,
    oracle,
    run_updates,
    verdict,
)

import jax_impl
from crosscheck import FLOAT32_RTOL, Fixture, builtin_fixture, loss_and_grad, train, tree_rel_err
from crosscheck.contract.schemes import Constant

# All at R = 2 (one compiled sweep per front-end): the seed's 100 vs 900 tokens, ragged
# microbatch counts, and a whole empty rank.
LAYOUTS = [("seed", 2, 1), ("ragged", 2, 4), ("empty-rank", 2, 2)]


def sweep_configs(world_size: int) -> list[jax_impl.StepConfig]:
    """Two reproduced bugs, a wrong s, and the intended step, in one program per layout."""
    optimizer = adamw()
    common = {"optimizer": optimizer, "max_grad_norm": MAX_GRAD_NORM}
    # The hand-written accidental gradients are gone: the same loops as the specs' naive step
    # (each unit's own mean, averaged by pmean).
    naive = {"strategy": "precount", "collective": "pmean"}
    return [
        jax_impl.StepConfig(scheme="rank_mean", **naive, **common),
        jax_impl.StepConfig(scheme="microbatch_mean", **naive, **common),
        # pmean averages the ranks but s = 1: transformers#37474, gradient R times too small.
        jax_impl.StepConfig(collective="pmean", reduce_factor=1, **common),
        jax_impl.StepConfig(collective="pmean", **common),
    ]


def laid_out(fixture: Fixture, R: int, M: int):
    arrays = {k: getattr(fixture, k) for k in ("inputs", "targets", "segment_ids", "weights")}
    return jax_impl.lay_out_global_batch(arrays, R, M, vocab_size=fixture.vocab_size)


def record(front_end: str, fixture: str, scheme: str, R: int, M: int, history, want) -> dict:
    case = {
        "front_end": front_end,
        "dtype": "float32",
        "fixture": fixture,
        "scheme": scheme,
        "strategy": "as-written",
        "optimizer": "adamw",
        "world_size": R,
        "accum_steps": M,
    }
    return verdict(case, history, want)


@pytest.mark.parametrize("front_end", ["pmap", "shard_map"])
def test_reproduced_bugs_match_the_oracle_and_a_wrong_s_is_caught(front_end: str) -> None:
    records, caught = [], []
    for world_size in sorted({R for _, R, _ in LAYOUTS}):
        configs = sweep_configs(world_size)
        sweep, place = build_sweep(front_end, configs, world_size)
        for name, R, M in (layout for layout in LAYOUTS if layout[1] == world_size):
            fixture = builtin_fixture(name)
            batch, params = place(
                laid_out(fixture, R, M), jax_impl.params_from_numpy(fixture.params(), "float32")
            )
            histories = run_updates(sweep, configs, params, batch)
            for scheme, history in zip(
                ["rank_mean", "microbatch_mean"], histories[:2], strict=True
            ):
                want = oracle(name, scheme, R, M, "adamw")
                records.append(record(front_end, name, scheme, R, M, history, want))
            token_mean = oracle(name, "token_mean", R, M, "adamw")
            records.append(record(front_end, name, "token_mean", R, M, histories[3], token_mean))
            wrong_s = record(front_end, name, "token_mean", R, M, histories[2], token_mean)
            first_update = tree_rel_err(histories[2][0]["grads"], token_mean[0].result.grads)
            caught.append((name, R, wrong_s, first_update.max_rel_err))
            for history in histories:
                for update in history:
                    assert all(np.isfinite(g).all() for g in update["grads"].values())
    assert not failures(records), "\n".join(failures(records))
    for name, R, wrong, first_update_err in caught:
        assert "grads" in wrong["failed"], f"{name}: a wrong s went unnoticed"
        # The first update's gradient is scaled by 1/R: relative error 1 - 1/R (float32).
        assert first_update_err == pytest.approx(1 - 1 / R, rel=1e-5)


def test_seed_rank_mean_weighs_the_short_rank_nine_times() -> None:
    """The seed example: per-token weights on the 100-token rank are 9x the 900-token rank's."""
    fixture = builtin_fixture("seed")
    # The hand-written rank_mean gradient is gone: the same loop as the rank_mean spec's step.
    config = jax_impl.StepConfig(
        optimizer=optax.sgd(0.0), scheme="rank_mean", strategy="precount", collective="pmean"
    )
    gradients = jax_impl.make_pmap_gradients(config, 2)
    params = jax_impl.params_from_numpy(fixture.params(), "float32")
    out = gradients(params, laid_out(fixture, 2, 1))
    np.testing.assert_array_equal(out.rank_valid_tokens, [100, 900])
    # Each rank's loss sum is its own mean; the objective averages them: (l_A + l_B) / 2.
    assert float(out.loss) == pytest.approx(float(np.mean(out.rank_loss_sums)), rel=1e-6)


def no_valid_targets() -> Fixture:
    base = builtin_fixture("empty-rank")
    return dataclasses.replace(
        base,
        name="no-valid-targets",
        description="every target ignored: D = 0",
        targets=np.full_like(base.targets, jax_impl.IGNORE_INDEX),
    )


@pytest.mark.parametrize("front_end", ["pmap", "shard_map", "jit"])
def test_an_update_without_valid_targets_is_zero_not_nan(front_end: str) -> None:
    fixture, R, M = no_valid_targets(), 2, 2
    optimizer = adamw()
    schemes = ("token_mean", "sequence_mean", "row_mean", "weighted_mean")
    strategies = ("precount", "postnorm")
    # Every scheme and strategy side by side in one sweep (the scheme is in the config).
    configs = [
        jax_impl.StepConfig(
            optimizer=optimizer, scheme=scheme, strategy=s, max_grad_norm=MAX_GRAD_NORM
        )
        for scheme in schemes
        for s in strategies
    ]
    sweep, place = build_sweep(front_end, configs, R)
    batch, params = place(
        laid_out(fixture, R, M), jax_impl.params_from_numpy(fixture.params(), "float32")
    )
    histories = run_updates(sweep, configs, params, batch)
    for i, scheme in enumerate(schemes):
        want = train(
            fixture, scheme, R, M, num_updates=NUM_UPDATES, optimizer=ADAMW,
            max_grad_norm=MAX_GRAD_NORM, clip_convention="optax",
        )  # fmt: skip
        assert all(r.result.no_valid_tokens for r in want)
        for history in histories[i * len(strategies) : (i + 1) * len(strategies)]:
            result = record(front_end, fixture.name, scheme, R, M, history, want)
            assert not result["failed"], result
            for update in history:
                assert float(update["global_denominator"]) == 0.0 and float(update["loss"]) == 0
                assert not any(np.any(g) for g in update["grads"].values())


def test_shard_map_autodiff_sums_gradients_of_replicated_params() -> None:
    """jax.grad of a rank's loss w.r.t. replicated (P()) params inside shard_map returns the
    sum over ranks; after pcast to varying it is the rank's own. A step that then psums again
    counts every rank R times, which jax_impl.shard_map_step avoids."""
    mesh = jax_impl.data_mesh(2)
    x = jax.device_put(jnp.array([1.0, 2.0]), NamedSharding(mesh, P("data")))
    w = jax.device_put(jnp.array(3.0), NamedSharding(mesh, P()))

    def grads(w, x):
        as_given = jax.grad(lambda w: jnp.sum(w * x))(w)
        local = jax.grad(lambda w: jnp.sum(w * x))(jax.lax.pcast(w, ("data",), to="varying"))
        return as_given[None], local[None]

    as_given, local = jax.jit(
        jax.shard_map(grads, mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data"))
    )(w, x)
    np.testing.assert_array_equal(as_given, [3.0, 3.0])  # 1 + 2 on both ranks
    np.testing.assert_array_equal(local, [1.0, 2.0])


def test_constant_with_an_explicit_normalizer_divides_by_it() -> None:
    """constant(C): D = C for the update instead of the N x T target slots."""
    fixture, R, M, C = builtin_fixture("packed"), 2, 2, 300.0
    config = jax_impl.StepConfig(
        optimizer=optax.sgd(0.0), scheme=f"constant:{C}", collective="pmean"
    )
    gradients = jax_impl.make_pmap_gradients(config, R)
    params = jax_impl.params_from_numpy(fixture.params(), "float32")
    out = gradients(params, laid_out(fixture, R, M))
    want = loss_and_grad(fixture, Constant(normalizer=C), R, M)
    assert float(out.global_denominator) == C
    err = tree_rel_err({k: np.asarray(v) for k, v in out.grads.items()}, want.grads)
    assert err.max_rel_err <= FLOAT32_RTOL, err.describe()
