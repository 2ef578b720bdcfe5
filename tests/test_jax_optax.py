"""optax accumulation: the token-weighted transformation against optax.MultiSteps.

`token_weighted_accumulation` fed each micro-step's gradient of sum_t a_t l_t and its d must
reproduce the oracle's token_mean (or weighted_mean) AdamW updates; optax.MultiSteps fed the
gradient of each microbatch's own mean must reproduce the oracle's accidental
microbatch_mean, and so miss token_mean. Single device and pmap (psum per micro-step); float32
in this process (float32 tolerance from crosscheck.judge.compare).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_impl
from crosscheck import FLOAT32_RTOL, AdamWConfig, builtin_fixture, train, tree_rel_err

ADAMW = AdamWConfig()
MAX_GRAD_NORM = 1.0
NUM_UPDATES = 2
# microbatch_mean vs token_mean on these fixtures differ by >= 1e-2 relative in the params
# after two updates; 1e-3 is far above float32 noise (1e-6) and far below that gap.
DIFFERENT = 1e-3


def inner_optimizer() -> optax.GradientTransformation:
    """Clip the accumulated gradient, then AdamW with the oracle's hyperparameters."""
    adamw = optax.adamw(
        ADAMW.learning_rate,
        b1=ADAMW.b1,
        b2=ADAMW.b2,
        eps=ADAMW.eps,
        weight_decay=ADAMW.weight_decay,
    )
    return optax.chain(optax.clip_by_global_norm(MAX_GRAD_NORM), adamw)


def microbatches(fixture_name: str, R: int, M: int) -> jax_impl.Batch:
    fixture = builtin_fixture(fixture_name)
    arrays = {k: getattr(fixture, k) for k in ("inputs", "targets", "segment_ids", "weights")}
    return jax_impl.lay_out_global_batch(arrays, R, M, vocab_size=fixture.vocab_size)


def oracle_params(fixture: str, scheme: str, R: int, M: int) -> list[dict]:
    records = train(
        builtin_fixture(fixture), scheme, R, M, num_updates=NUM_UPDATES, optimizer=ADAMW,
        max_grad_norm=MAX_GRAD_NORM, clip_convention="optax",
    )  # fmt: skip
    return [r.params for r in records]


def unnormalized_grads(params, mb: jax_impl.Batch, scheme: str):
    """Gradient of sum_t a_t l_t and this microbatch's d (count or weight sum)."""

    def loss(p):
        out = jax_impl.microbatch_loss(p, mb, scheme)
        return out.loss_sum, out

    grads, out = jax.grad(loss, has_aux=True)(params)
    d = out.weight_sum if scheme == "weighted_mean" else out.count
    return grads, d


def mean_grads(params, mb: jax_impl.Batch):
    """What most loops backpropagate: this microbatch's own token mean."""
    return jax.grad(jax_impl.local_mean_loss)(params, mb)


def run(fixture: str, R: int, M: int, micro_step) -> list[dict]:
    """NUM_UPDATES updates of M micro-steps each; params after each update (rank 0's)."""
    batch = microbatches(fixture, R, M)
    params = jax_impl.params_from_numpy(builtin_fixture(fixture).params(), jnp.float32)
    state = None
    history = []
    for _ in range(NUM_UPDATES):
        for m in range(M):
            mb = jax.tree.map(lambda x, m=m: x[:, m] if R > 1 else x[0, m], batch)
            params, state = micro_step(params, state, mb)
        history.append({k: np.asarray(v) for k, v in params.items()})
    return history


def single_device(opt: optax.GradientTransformation, grads_fn):
    @jax.jit
    def step(params, state, mb):
        grads, extra = grads_fn(params, mb)
        updates, state = opt.update(grads, state, params, **extra)
        return optax.apply_updates(params, updates), state

    return lambda params, state, mb: step(params, opt.init(params) if state is None else state, mb)


def data_parallel(opt: optax.GradientTransformation, grads_fn, R: int, reduce):
    """pmap over R ranks: each micro-step's gradient (and d) reduced across ranks first."""

    def step(params, state, mb):
        grads, extra = grads_fn(params, mb)
        grads, extra = reduce((grads, extra), "ranks")
        updates, state = opt.update(grads, state, params, **extra)
        return optax.apply_updates(params, updates), state

    devices = jax_impl.require_devices(R)
    mapped = jax.pmap(step, "ranks", in_axes=(None, None, 0), devices=devices)
    # Rank 0's copy, on rank 0's device: every call then sees inputs placed alike (one compile).
    first = functools.partial(jax.tree.map, lambda x: x.addressable_data(0)[0])

    def micro_step(params, state, mb):
        params = jax.device_put(params, devices[0])
        return first(mapped(params, opt.init(params) if state is None else state, mb))

    return micro_step


def token_weighted(scheme: str):
    def grads_fn(params, mb):
        grads, d = unnormalized_grads(params, mb, scheme)
        return grads, {"denominator": d}

    return grads_fn


def multisteps_grads(params, mb):
    return mean_grads(params, mb), {}


def assert_params_match(got: list[dict], want: list[dict], what: str) -> None:
    for update, (g, w) in enumerate(zip(got, want, strict=True)):
        err = tree_rel_err(g, w)
        assert err.max_rel_err <= FLOAT32_RTOL, f"{what}, update {update}: {err.describe()}"


@pytest.mark.parametrize(
    ("fixture", "scheme", "M", "denominator_dtype"),
    [
        ("ragged", "token_mean", 4, jnp.int32),
        ("empty-rank", "token_mean", 2, jnp.int32),  # second microbatch has no valid token
        ("soft-weights", "weighted_mean", 2, jnp.float32),
    ],
)
def test_token_weighted_accumulation_reproduces_the_intended_scheme(
    fixture: str, scheme: str, M: int, denominator_dtype
) -> None:
    opt = jax_impl.token_weighted_accumulation(
        inner_optimizer(), M, denominator_dtype=denominator_dtype
    )
    got = run(fixture, 1, M, single_device(opt, token_weighted(scheme)))
    assert_params_match(got, oracle_params(fixture, scheme, 1, M), f"{fixture}/{scheme}")


@pytest.mark.parametrize(("fixture", "M"), [("ragged", 4), ("empty-rank", 2)])
def test_multisteps_with_a_mean_loss_is_microbatch_mean(fixture: str, M: int) -> None:
    opt = optax.MultiSteps(inner_optimizer(), every_k_schedule=M)
    got = run(fixture, 1, M, single_device(opt, multisteps_grads))
    assert_params_match(got, oracle_params(fixture, "microbatch_mean", 1, M), "MultiSteps")
    # ... and therefore not the token mean the loss was meant to be.
    token_mean = oracle_params(fixture, "token_mean", 1, M)
    assert tree_rel_err(got[-1], token_mean[-1]).max_rel_err > DIFFERENT


def test_under_pmap_token_weighted_matches_and_multisteps_does_not() -> None:
    """Real DP use: psum of the gradient sum and d (token-weighted) vs pmean of mean-loss
    gradients (MultiSteps), at R = 2 ranks x M = 2 micro-steps on the ragged fixture."""
    R, M = 2, 2
    opt = jax_impl.token_weighted_accumulation(inner_optimizer(), M)
    got = run("ragged", R, M, data_parallel(opt, token_weighted("token_mean"), R, jax.lax.psum))
    assert_params_match(got, oracle_params("ragged", "token_mean", R, M), "token-weighted, pmap")
    opt = optax.MultiSteps(inner_optimizer(), every_k_schedule=M)
    got = run("ragged", R, M, data_parallel(opt, multisteps_grads, R, jax.lax.pmean))
    assert_params_match(got, oracle_params("ragged", "microbatch_mean", R, M), "MultiSteps, pmap")


def test_token_weighted_accumulation_refuses_a_missing_or_inexact_denominator() -> None:
    params = {"w": jnp.ones(3)}
    opt = jax_impl.token_weighted_accumulation(optax.sgd(0.1), 2)
    state = opt.init(params)
    with pytest.raises(TypeError, match="needs denominator=d"):
        opt.update(params, state, params)
    with pytest.raises(TypeError, match=r"pass denominator_dtype=jnp\.float32"):
        opt.update(params, state, params, denominator=jnp.float32(2.5))
    with pytest.raises(ValueError, match="accum_steps must be >= 1"):
        jax_impl.token_weighted_accumulation(optax.sgd(0.1), 0)


def test_token_weighted_accumulation_emits_zeros_until_the_last_micro_step() -> None:
    params = {"w": jnp.zeros(2)}
    opt = jax_impl.token_weighted_accumulation(optax.sgd(1.0), 3)
    state = opt.init(params)
    # Micro-steps with gradient sums (1, 1), (2, 0), (0, 0) and counts 1, 3, 0: the update is
    # -(3, 1) / 4 (token-weighted), not -((1, 1) / 1 + (2, 0) / 3 + 0) / 3 (equal weights).
    for grad, d, expected in [
        ((1, 1), 1, (0, 0)),
        ((2, 0), 3, (0, 0)),
        ((0, 0), 0, (-0.75, -0.25)),
    ]:
        updates, state = opt.update(
            {"w": jnp.array(grad, jnp.float32)}, state, params, denominator=d
        )
        np.testing.assert_array_equal(updates["w"], np.array(expected, np.float32))
    assert int(state.mini_step) == 0 and int(state.gradient_step) == 1
    assert int(state.denominator_sum) == 0 and not np.any(state.grad_sum["w"])
