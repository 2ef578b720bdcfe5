"""The JAX model, per-token loss and per-microbatch (a_t, d) against the numpy contract.

Runs in float32 in this process (the float64 path of the same code is covered by the
front-end matrix, tests/jax_matrix.py). Also: bad input fails with an error naming what and
where, and ignored targets never produce a NaN.
"""

from __future__ import annotations

import doctest
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_impl
import jax_impl.token_weighted
from crosscheck import BUILTIN_FIXTURES, INTENDED_SCHEMES, builtin_fixture, get_scheme
from crosscheck import random_fixture as make_random_fixture
from crosscheck.contract.oracle import token_terms
from jax_impl.spec_counts import rank_spec_terms

# float32 against float64: a_t = 1/n and l_t are single roundings of O(1) values (~6e-8 each);
# 1e-6 relative admits that and nothing a wrong group or count could produce (>= 1/T ~ 1e-3).
F32_ELEMENT_RTOL = 1e-6


def numpy_microbatches(fixture, R: int, M: int):
    return [mb for _, _, mb in fixture.layout(R, M).microbatches()]


FIXTURES = [*BUILTIN_FIXTURES, "random"]


def get_fixture(name: str):
    if name == "random":
        return make_random_fixture(7, num_rows=12, seq_len=9, max_segments=4)
    return builtin_fixture(name)


def laid_out_batch(fixture, R: int, M: int) -> jax_impl.Batch:
    """The fixture's rows laid out over (R, M) by jax_impl (the crosscheck layout's split)."""
    arrays = {k: getattr(fixture, k) for k in ("inputs", "targets", "segment_ids", "weights")}
    return jax_impl.lay_out_global_batch(arrays, R, M, vocab_size=fixture.vocab_size)


def spec_terms(specs: tuple[jax_impl.SchemeSpec, ...], batch: jax_impl.Batch) -> tuple:
    """Each spec's a_t and D's parts per microbatch, the ranks under a named vmap (one
    program for all of `specs`)."""

    def per_rank(rank_batch: jax_impl.Batch) -> tuple:
        return tuple(rank_spec_terms(spec, rank_batch, "data")[0] for spec in specs)

    return jax.vmap(per_rank, axis_name="data")(batch)


@pytest.mark.parametrize("fixture_name", FIXTURES)
def test_scheme_terms_match_the_contract(fixture_name: str) -> None:
    """Every scheme's a_t and d, per microbatch, each spec in its own program and all specs
    in one program alike."""
    # The v1 enum and its lax.switch are gone: the same a_t and d checked through the spec
    # path, one program per spec and one program holding every scheme's spec.
    fixture = get_fixture(fixture_name)
    M = 2 if fixture.num_rows % 2 == 0 else 1
    laid_out = fixture.layout(1, M)
    batch = laid_out_batch(fixture, 1, M)
    specs = tuple(jax_impl.named_spec(name) for name in INTENDED_SCHEMES)
    together = jax.jit(lambda b: spec_terms(specs, b))(batch)
    for scheme_name, spec, joint in zip(INTENDED_SCHEMES, specs, together, strict=True):
        contract = get_scheme(scheme_name)
        # The contract's a_t, and each microbatch's d: its spec's D at microbatch scope.
        a = contract.token_weights(laid_out)
        d_want = replace(contract, scope="microbatch").unit_denominators(laid_out)
        (alone,) = jax.jit(lambda b, spec=spec: spec_terms((spec,), b))(batch)
        # [1, M, B, T] stacks: the rank axis first, then the microbatches.
        for terms in (alone, joint):
            for _, m, _ in laid_out.microbatches():
                np.testing.assert_allclose(
                    terms.token_weights[0, m], a[0, m], rtol=F32_ELEMENT_RTOL,
                    err_msg=f"{fixture.name}/{scheme_name}: a_t of microbatch {m}",
                )  # fmt: skip
                parts = terms.parts
                d = int(parts.mb_count[0, m]) + float(parts.mb_weight.value()[0, m])
                if scheme_name != "sum":  # sum: D fixed to 1, no d per microbatch
                    assert d == pytest.approx(d_want[m], rel=F32_ELEMENT_RTOL), (
                        f"{fixture.name}/{scheme_name}: d of microbatch {m} = {d}, contract "
                        f"{d_want[m]}"
                    )


def test_counts_stay_in_the_integer_channel() -> None:
    """Counting schemes carry d as int32 (exact past 2^24), weighted_mean as a float pair in
    the denominator dtype (float32 here, x64 off)."""
    # The v1 enum is gone: the same channels checked for every v1 name's spec.
    batch = laid_out_batch(builtin_fixture("packed"), 1, 1)
    for name in INTENDED_SCHEMES:
        (terms,) = spec_terms((jax_impl.named_spec(name),), batch)
        count, weight_sum = terms.parts.mb_count, terms.parts.mb_weight
        assert count.dtype == jnp.int32
        assert weight_sum.hi.dtype == weight_sum.lo.dtype == jnp.float32
        if name == "weighted_mean":
            assert int(count[0, 0]) == 0 and float(weight_sum.value()[0, 0]) > 0
        else:
            assert float(weight_sum.value()[0, 0]) == 0


def test_model_loads_numpy_params_and_matches_the_oracle_losses() -> None:
    fixture = builtin_fixture("multimodal")
    params = jax_impl.params_from_numpy(fixture.params(), jnp.float32)
    model = jax_impl.BilinearLM(vocab_size=fixture.vocab_size, hidden_size=fixture.hidden_size)
    initialized = model.init(jax.random.key(0), fixture.inputs[:1])["params"]
    assert {k: v.shape for k, v in initialized.items()} == {
        "embed": fixture.embed.shape,
        "unembed": fixture.unembed.shape,
    }
    # The fixture's numpy dict is a valid params collection as it is (float32 without x64).
    logits = model.apply({"params": fixture.params()}, fixture.inputs)
    np.testing.assert_array_equal(logits, model.apply({"params": params}, fixture.inputs))
    np.testing.assert_allclose(
        logits, fixture.embed[fixture.inputs] @ fixture.unembed, rtol=1e-5, atol=1e-5
    )  # float32 matmul of O(1) values over H = 12 terms
    losses = jax_impl.token_losses(logits, fixture.targets)
    expected = token_terms(fixture.params(), fixture.inputs, fixture.targets).losses
    np.testing.assert_allclose(losses, expected, rtol=F32_ELEMENT_RTOL, atol=1e-6)


def test_ignored_targets_give_zero_loss_and_finite_zero_gradients() -> None:
    """A microbatch with no valid target: loss 0, d 0, gradient exactly 0, never NaN."""
    fixture = builtin_fixture("empty-rank")
    params = jax_impl.params_from_numpy(fixture.params(), jnp.float32)
    rows = slice(4, 8)  # every target of these rows is ignored
    arrays = {k: getattr(fixture, k)[rows] for k in ("inputs", "targets", "segment_ids", "weights")}
    batch = jax_impl.lay_out_global_batch(arrays, 1, 1, vocab_size=fixture.vocab_size)
    mb = jax.tree.map(lambda x: x[0, 0], batch)
    assert (fixture.targets[rows] == jax_impl.IGNORE_INDEX).all()
    # The traced scheme index is gone: one program computes every scheme's loss sum, d and
    # gradient (microbatch_loss refuses sum, whose D is fixed: no d of a micro-step).
    local = [s for s in INTENDED_SCHEMES if s != "sum"]
    with pytest.raises(ValueError, match="its D is fixed"):
        jax_impl.microbatch_loss(params, mb, "sum")

    @jax.jit
    def loss_and_grads(p):
        def loss_sum(p, scheme):
            out = jax_impl.microbatch_loss(p, mb, scheme)
            return out.loss_sum, out

        return [jax.value_and_grad(loss_sum, has_aux=True)(p, s) for s in local]

    for scheme, ((value, aux), grads) in zip(local, loss_and_grads(params), strict=True):
        d = int(aux.count) + float(aux.weight_sum)
        # constant's d counts every position of the microbatch, ignored or not.
        positions = fixture.targets[rows].size
        assert float(value) == 0.0 and d == (positions if scheme == "constant" else 0), scheme
        for name, g in grads.items():
            assert np.isfinite(g).all() and not np.any(g), f"{scheme}: {name} gradient"
    # Every scheme, sum included, in one sweep of the step: loss 0 and gradient exactly 0.
    configs = [
        jax_impl.StepConfig(optimizer=optax.sgd(0.1), scheme=scheme) for scheme in INTENDED_SCHEMES
    ]
    outs = jax_impl.make_pmap_sweep(configs, 1)([params] * len(configs), batch)
    for scheme, out in zip(INTENDED_SCHEMES, outs, strict=True):
        assert float(out.loss) == 0.0, scheme
        for name, g in out.grads.items():
            assert np.isfinite(g).all() and not np.any(g), f"{scheme} step: {name} gradient"
    mean = jax_impl.local_mean_loss(params, mb)
    assert float(mean) == 0.0


def test_microbatch_loss_docstring_example() -> None:
    failures, tried = doctest.testmod(jax_impl.token_weighted, verbose=False)
    assert tried > 0 and failures == 0


def test_bad_input_names_what_and_where() -> None:
    fixture = builtin_fixture("packed")
    batch = {k: np.array(getattr(fixture, k)) for k in ("inputs", "targets", "segment_ids")}
    batch["weights"] = np.array(fixture.weights)
    V = fixture.vocab_size
    batch["targets"][3, 5] = V + 2
    with pytest.raises(ValueError, match=r"targets\[3, 5\] = 42"):
        jax_impl.validate_global_batch(batch, V)
    batch["targets"][3, 5] = -100
    batch["inputs"][1, 2] = -1
    with pytest.raises(ValueError, match=r"inputs\[1, 2\] = -1 is outside \[0, 40\)"):
        jax_impl.validate_global_batch(batch, V)
    batch["inputs"][1, 2] = 0
    batch["weights"][0, 0] = np.nan
    with pytest.raises(ValueError, match=r"weights\[0, 0\]"):
        jax_impl.validate_global_batch(batch, V)
    batch["weights"][0, 0] = 1.0
    valid_row, valid_pos = (int(i) for i in np.argwhere(batch["targets"] != -100)[0])
    batch["segment_ids"][valid_row, valid_pos] = 0
    with pytest.raises(ValueError, match=rf"segment_ids\[{valid_row}, {valid_pos}\] = 0"):
        jax_impl.validate_global_batch(batch, V)
    batch["segment_ids"][valid_row, valid_pos] = 1
    # Laid out, the message also says which rank and microbatch hold the row.
    batch["weights"][5, 2] = -1.0
    with pytest.raises(
        ValueError,
        match=r"weights\[5, 2\] = -1\.0 is not finite and >= 0 \(rank 1, microbatch 0, row 1 "
        r"of that microbatch\)",
    ):
        jax_impl.lay_out_global_batch(batch, 2, 2, vocab_size=V)
    batch["weights"][5, 2] = 1.0
    with pytest.raises(ValueError, match="targets must be integers, got float64 holding whole"):
        jax_impl.validate_global_batch(dict(batch, targets=batch["targets"] * 1.0), V)
    with pytest.raises(ValueError, match="weights must be floating point"):
        jax_impl.validate_global_batch(dict(batch, weights=np.ones((8, 64), np.int32)), V)
    with pytest.raises(ValueError, match="8 rows cannot be split over world_size=3"):
        jax_impl.lay_out_global_batch(batch, 3, 1, vocab_size=V)
    # The v1 enum is gone: an unknown name, or a number, is refused by the spec lookup.
    with pytest.raises(ValueError, match=r"unknown spec name 'token-mean'; known: .*token_mean"):
        jax_impl.named_spec("token-mean")
    with pytest.raises(ValueError, match="a spec is a dict, a SchemeSpec or a name, got 9"):
        jax_impl.parse_spec(9)
    with pytest.raises(ValueError, match="embed must be"):
        jax_impl.params_from_numpy({"embed": fixture.embed, "unembed": fixture.embed}, jnp.float32)
    with pytest.raises(RuntimeError, match="world_size=9 needs 9 devices, found 8"):
        jax_impl.require_devices(9)


def test_configs_refuse_what_their_front_end_cannot_do() -> None:
    with pytest.raises(ValueError, match="postnorm reduces unnormalized sums"):
        jax_impl.StepConfig(optimizer=optax.sgd(0.1), strategy="postnorm", collective="pmean")
    with pytest.raises(ValueError, match="'precount-ish' is not a valid Strategy"):
        jax_impl.StepConfig(optimizer=optax.sgd(0.1), strategy="precount-ish")
    config = jax_impl.StepConfig(optimizer=optax.sgd(0.1), collective="pmean")
    with pytest.raises(ValueError, match="global-view jit writes the global sum directly"):
        jax_impl.make_global_update(config, jax_impl.data_mesh(2))
    batch = jax_impl.lay_out_global_batch(
        {k: getattr(builtin_fixture("packed"), k) for k in ("inputs", "targets", "segment_ids",
                                                            "weights")},
        2, 1, vocab_size=40,
    )  # fmt: skip
    update = jax_impl.make_pmap_update(jax_impl.StepConfig(optimizer=optax.sgd(0.1)), 4)
    params = jax_impl.params_from_numpy(builtin_fixture("packed").params(), jnp.float32)
    with pytest.raises(ValueError, match=r"batch.inputs must be \[R=4, M, B, T\]"):
        update(params, optax.sgd(0.1).init(params), batch)
