"""The oracle: closed-form gradient vs finite differences, and the layout-invariance contract."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crosscheck.contract.fixture import NPZ_KEYS, Fixture
from crosscheck.contract.oracle import loss_and_grad, weighted_grad, weighted_loss
from crosscheck.contract.schemes import INTENDED_SCHEMES, SCHEMES, effective_weights
from crosscheck.fixtures.builtin import BUILTIN_FIXTURES, builtin_fixture, random_fixture
from crosscheck.judge.compare import FLOAT64_RTOL, tree_rel_err

# Central differences with step h have truncation error ~h^2 |f'''| / 6 ~ 1e-11 and rounding
# error ~eps |L| / h ~ 1e-16 * |L| / 1e-5: relative to the largest gradient entry both stay
# near 1e-9 on every fixture (|L| / max|g| < 1e3 even for `sum`). 1e-7 leaves two orders of
# margin while a single token weighted wrongly (>= 1e-4 of the gradient) would fail.
FD_RTOL = 1e-7
FD_STEP = 1e-5


def _probe_coordinates(grads: dict[str, np.ndarray], rng: np.random.Generator):
    """The 6 largest |g| entries and 10 random entries of each parameter."""
    for key, g in grads.items():
        flat = np.abs(g).ravel()
        picks = set(np.argsort(flat)[-6:].tolist())
        picks |= set(rng.choice(flat.size, size=min(10, flat.size), replace=False).tolist())
        for index in sorted(picks):
            yield key, np.unravel_index(index, g.shape)


def check_against_finite_differences(fixture: Fixture, scheme: str, R: int, M: int) -> float:
    """Max relative error of the closed-form gradient against central differences."""
    weights = effective_weights(scheme, fixture.layout(R, M))
    params = fixture.params()
    grads = weighted_grad(params, fixture.inputs, fixture.targets, weights)

    def loss_at(key: str, index: tuple, step: float) -> float:
        shifted = {k: v.copy() for k, v in params.items()}
        shifted[key][index] += step
        return weighted_loss(shifted, fixture.inputs, fixture.targets, weights)

    scale = max(max(np.abs(g).max() for g in grads.values()), 1e-300)
    worst = 0.0
    rng = np.random.default_rng(0)
    for key, index in _probe_coordinates(grads, rng):
        fd = (loss_at(key, index, FD_STEP) - loss_at(key, index, -FD_STEP)) / (2 * FD_STEP)
        worst = max(worst, abs(fd - grads[key][index]) / scale)
    # One random direction over every parameter at once checks the coordinates not probed.
    direction = {k: rng.standard_normal(v.shape) for k, v in params.items()}
    plus = {k: params[k] + FD_STEP * direction[k] for k in params}
    minus = {k: params[k] - FD_STEP * direction[k] for k in params}
    fd = (
        weighted_loss(plus, fixture.inputs, fixture.targets, weights)
        - weighted_loss(minus, fixture.inputs, fixture.targets, weights)
    ) / (2 * FD_STEP)
    analytic = sum(float(np.sum(grads[k] * direction[k])) for k in params)
    norm = np.sqrt(sum(float(np.sum(d * d)) for d in direction.values()))
    return max(worst, abs(fd - analytic) / (scale * norm))


@pytest.mark.parametrize("fixture_name", list(BUILTIN_FIXTURES))
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_gradient_matches_finite_differences(fixture_name, scheme):
    fixture = builtin_fixture(fixture_name)
    R, M = fixture.valid_layouts()[-1]  # the finest layout: matters for accidental schemes
    assert check_against_finite_differences(fixture, scheme, R, M) <= FD_RTOL


@pytest.mark.parametrize("fixture_name", list(BUILTIN_FIXTURES))
@pytest.mark.parametrize("scheme", INTENDED_SCHEMES)
def test_intended_gradient_is_identical_across_layouts(fixture_name, scheme):
    fixture = builtin_fixture(fixture_name)
    reference = loss_and_grad(fixture, scheme, 1, 1)
    for R, M in fixture.valid_layouts():
        result = loss_and_grad(fixture, scheme, R, M)
        assert tree_rel_err(result.grads, reference.grads).max_rel_err <= FLOAT64_RTOL, (R, M)
        assert abs(result.loss - reference.loss) <= FLOAT64_RTOL * abs(reference.loss)
        assert result.denominator == reference.denominator


@pytest.mark.parametrize("fixture_name", ["seed", "ragged", "packed", "multimodal"])
@pytest.mark.parametrize("scheme", ["rank_mean", "microbatch_mean"])
def test_accidental_gradient_changes_with_the_layout(fixture_name, scheme):
    fixture = builtin_fixture(fixture_name)
    reference = loss_and_grad(fixture, scheme, 1, 1).grads
    errors = [
        tree_rel_err(loss_and_grad(fixture, scheme, R, M).grads, reference).max_rel_err
        for R, M in fixture.valid_layouts()
        if (R, M) != (1, 1) and (scheme == "microbatch_mean" or R > 1)
    ]
    assert errors and min(errors) > 1e-3  # far outside any rounding


def test_seed_rank_mean_is_the_nine_to_one_update():
    seed = builtin_fixture("seed")
    rank = loss_and_grad(seed, "rank_mean", 2, 1)
    token = loss_and_grad(seed, "token_mean", 2, 1)
    assert rank.rank_valid_tokens.tolist() == [100, 900]
    assert token.denominator == 1000.0
    # (G_A/100 + G_B/900)/2 written out from the per-rank gradient sums
    sums_a = weighted_grad(seed.params(), seed.inputs[:1], seed.targets[:1], seed.valid[:1] * 1.0)
    sums_b = weighted_grad(seed.params(), seed.inputs[1:], seed.targets[1:], seed.valid[1:] * 1.0)
    expected = {k: (sums_a[k] / 100 + sums_b[k] / 900) / 2 for k in sums_a}
    assert tree_rel_err(rank.grads, expected).max_rel_err <= FLOAT64_RTOL


def test_no_valid_token_gives_zero_gradient_and_a_flag():
    fixture = random_fixture(11, 4, 9, ignore_fraction=1.0)
    for scheme in SCHEMES:
        result = loss_and_grad(fixture, scheme, 2, 2)
        assert result.no_valid_tokens, scheme
        assert result.loss == 0.0
        for g in result.grads.values():
            assert np.isfinite(g).all() and not g.any()
    assert not loss_and_grad(builtin_fixture("packed"), "token_mean").no_valid_tokens


@pytest.mark.parametrize(
    "scheme", ["token_mean", "sequence_mean", "row_mean", "weighted_mean", "sum"]
)
def test_empty_rows_contribute_nothing(scheme):
    """Dropping the rows without a valid target leaves the objective and gradient unchanged."""
    fixture = builtin_fixture("empty-rank")
    kept = Fixture(
        name="empty-rank-kept",
        description="",
        **{
            k: getattr(fixture, k)[:4] if k not in ("embed", "unembed") else getattr(fixture, k)
            for k in NPZ_KEYS
        },
    )
    full = loss_and_grad(fixture, scheme, 2, 1)
    assert np.isfinite(full.loss)
    assert full.rank_valid_tokens.tolist()[1] == 0 and full.rank_loss_sums[1] == 0.0
    alone = loss_and_grad(kept, scheme, 1, 1)
    assert tree_rel_err(full.grads, alone.grads).max_rel_err <= FLOAT64_RTOL
    assert abs(full.loss - alone.loss) <= FLOAT64_RTOL * abs(alone.loss)


@st.composite
def fixtures_and_layouts(draw):
    """A random fixture of any small shape and one of its valid layouts."""
    R = draw(st.integers(1, 4))
    M = draw(st.integers(1, 4))
    rows = R * M * draw(st.integers(1, 3))
    seq_len = draw(st.integers(1, 12))
    fixture = random_fixture(
        draw(st.integers(0, 2**31 - 1)),
        rows,
        seq_len,
        vocab_size=draw(st.integers(2, 12)),
        hidden_size=draw(st.integers(1, 5)),
        max_segments=draw(st.integers(1, 4)),
        ignore_fraction=draw(st.sampled_from([0.0, 0.3, 0.9, 1.0])),
    )
    return fixture, R, M


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=fixtures_and_layouts(), scheme=st.sampled_from(list(SCHEMES)))
def test_property_gradient_matches_finite_differences(case, scheme):
    fixture, R, M = case
    assert check_against_finite_differences(fixture, scheme, R, M) <= FD_RTOL


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=fixtures_and_layouts(), scheme=st.sampled_from(INTENDED_SCHEMES))
def test_property_intended_gradient_is_layout_invariant(case, scheme):
    fixture, R, M = case
    reference = loss_and_grad(fixture, scheme, 1, 1)
    result = loss_and_grad(fixture, scheme, R, M)
    assert tree_rel_err(result.grads, reference.grads).max_rel_err <= FLOAT64_RTOL
    assert np.isfinite(result.loss)
    assert result.no_valid_tokens == (not np.any(reference.token_weights))


def test_shared_token_terms_are_computed_once_per_value_and_read_only():
    """loss_and_grad shares l_t and e_t between calls with equal params and batch (every
    scheme and layout of a fixture's first update): by value, never by object, and never
    between different values, however close."""
    from crosscheck.contract.oracle import _shared_token_terms, token_terms

    fixture = builtin_fixture("packed")
    params = fixture.params()
    shared = _shared_token_terms(
        {k: v.copy() for k, v in params.items()}, fixture.inputs.copy(), fixture.targets.copy()
    )
    assert _shared_token_terms(params, fixture.inputs, fixture.targets) is shared
    fresh_terms = token_terms(params, fixture.inputs, fixture.targets)
    for fresh, kept in zip(fresh_terms, shared, strict=True):
        assert np.array_equal(fresh, kept)
        assert not kept.flags.writeable
    nudged = {**params, "embed": params["embed"].copy()}
    nudged["embed"][0, 0] = np.nextafter(nudged["embed"][0, 0], np.inf)
    other = _shared_token_terms(nudged, fixture.inputs, fixture.targets)
    assert other is not shared
    assert np.array_equal(other.errors, token_terms(nudged, fixture.inputs, fixture.targets).errors)
    relabelled = fixture.targets.copy()
    relabelled[0, 1] = -100 if relabelled[0, 1] != -100 else 1
    assert _shared_token_terms(params, fixture.inputs, relabelled) is not shared
