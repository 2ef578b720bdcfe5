"""The multi-term oracle: closed forms vs finite differences, moe_lb scopes, mtp counts."""

from __future__ import annotations

import math

import numpy as np
import pytest

from crosscheck.contract.layout import IGNORE_INDEX, Layout, lay_out
from crosscheck.contract.objective import objective_loss, objective_loss_and_grad
from crosscheck.contract.objective_terms import (
    FROZEN_PARAMS,
    Term,
    mtp_targets,
    parse_objective,
    top_k_margin,
    top_k_picks,
)
from crosscheck.contract.oracle import weighted_grad, weighted_loss
from crosscheck.contract.row_fields import default_row_fields
from crosscheck.contract.spec import get_spec
from crosscheck.fixtures.builtin import builtin_fixture

# Central differences with step h have truncation error ~h^2 |f'''| / 6 ~ 1e-11 and rounding
# error ~eps |L| / h ~ 1e-16 * 30 / 1e-5 = 3e-10 (|L| <= 30 here, the z-loss being the
# largest term): relative to the largest gradient entry (>= 1e-2 on every objective below)
# both stay under 1e-8. 1e-7 leaves an order of margin, while a term weighted wrongly, or a
# logit gradient missing a factor, moves the gradient by far more.
FD_RTOL = 1e-7
FD_STEP = 1e-5
# The largest change of a router probability under any probe below is ~FD_STEP * |h| |router|
# ~ 1e-4; the fixtures' top-k margins must stay far above it (and a fortiori above rounding),
# or a finite difference would cross a tie where the counts, held constant by the closed
# form, jump.
MIN_TOP_K_MARGIN = 1e-3
E, TOP_K, HIDDEN = 4, 2, 5
LAYOUTS = [(R, M) for R in (1, 2, 4) for M in (1, 2)]
PER_TOKEN = ["ce", "z_loss", "entropy", "ref_kl", "mtp"]


def make_params(vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Small random params of the whole model family (logits of order 1)."""
    rng = np.random.default_rng(seed)
    scale = 1 / np.sqrt(HIDDEN)
    return {
        "embed": rng.standard_normal((vocab, HIDDEN)),
        "unembed": rng.standard_normal((HIDDEN, vocab)) * scale,
        "mtp_unembed": rng.standard_normal((HIDDEN, vocab)) * scale,
        "router": rng.standard_normal((HIDDEN, E)),
        "ref_embed": rng.standard_normal((vocab, HIDDEN)),
        "ref_unembed": rng.standard_normal((HIDDEN, vocab)) * scale,
    }


@pytest.fixture(scope="module")
def packed():
    fixture = builtin_fixture("packed")
    params = make_params(fixture.vocab_size)
    router_logits = params["embed"][fixture.inputs] @ params["router"]
    margin = top_k_margin(router_logits, fixture.segment_ids > 0, TOP_K)
    assert margin >= MIN_TOP_K_MARGIN, margin
    return fixture, params


def fd_error(params, batch, terms) -> float:
    """Max error of the closed-form gradient vs central differences, relative to max |g|."""
    grads = objective_loss_and_grad(params, batch, terms).grads
    scale = max(float(np.abs(g).max()) for g in grads.values())
    assert scale >= 1e-2, scale  # the FD_RTOL budget above assumes it

    def fd(direction: dict[str, np.ndarray]) -> float:
        plus = {k: v + FD_STEP * direction.get(k, 0.0) for k, v in params.items()}
        minus = {k: v - FD_STEP * direction.get(k, 0.0) for k, v in params.items()}
        return (objective_loss(plus, batch, terms) - objective_loss(minus, batch, terms)) / (
            2 * FD_STEP
        )

    rng = np.random.default_rng(1)
    worst = 0.0
    for key, g in grads.items():
        flat = np.abs(g).ravel()
        picks = set(np.argsort(flat)[-4:].tolist())
        picks |= set(rng.choice(flat.size, size=min(6, flat.size), replace=False).tolist())
        for index in sorted(picks):
            unit = np.zeros_like(g)
            unit.flat[index] = 1.0
            worst = max(worst, abs(fd({key: unit}) - g.flat[index]) / scale)
    # One random direction over every trained param at once covers the unprobed entries.
    direction = {k: rng.standard_normal(g.shape) for k, g in grads.items()}
    norm = math.sqrt(sum(float(np.sum(d * d)) for d in direction.values()))
    analytic = sum(float(np.sum(grads[k] * direction[k])) for k in grads)
    return max(worst, abs(fd(direction) - analytic) / (scale * norm))


@pytest.mark.parametrize("kind", PER_TOKEN)
def test_each_per_token_term_matches_finite_differences(packed, kind):
    fixture, params = packed
    terms = [{"kind": kind, "coefficient": -0.7 if kind == "entropy" else 1.0}]
    assert fd_error(params, fixture.layout(2, 2), terms) <= FD_RTOL


@pytest.mark.parametrize("scope", ["update", "microbatch"])
def test_moe_lb_matches_finite_differences(packed, scope):
    fixture, params = packed
    terms = [{"kind": "moe_lb", "scope": scope, "top_k": TOP_K}]
    assert fd_error(params, fixture.layout(4, 2), terms) <= FD_RTOL


def full_objective(moe_scope: str = "update") -> list[dict]:
    return [
        {"kind": "ce"},
        {"kind": "z_loss", "coefficient": 1e-2},
        {"kind": "entropy", "coefficient": -0.3},
        {"kind": "ref_kl", "coefficient": 0.5},
        {"kind": "mtp", "coefficient": 0.3},
        {"kind": "moe_lb", "coefficient": 0.8, "scope": moe_scope, "top_k": TOP_K},
    ]


@pytest.mark.parametrize("moe_scope", ["update", "microbatch"])
def test_full_objective_matches_finite_differences(packed, moe_scope):
    fixture, params = packed
    assert fd_error(params, fixture.layout(2, 2), full_objective(moe_scope)) <= FD_RTOL


def test_total_is_the_coefficient_weighted_sum_of_the_terms(packed):
    fixture, params = packed
    result = objective_loss_and_grad(params, fixture.layout(2, 1), full_objective())
    assert [t.name for t in result.terms] == [t["kind"] for t in full_objective()]
    expected = math.fsum(t.coefficient * t.loss for t in result.terms)
    assert result.loss == expected
    # Each term alone, times its coefficient, adds up to the whole gradient.
    summed = {k: np.zeros_like(g) for k, g in result.grads.items()}
    for term in full_objective():
        unit = dict(term, coefficient=1.0)
        alone = objective_loss_and_grad(params, fixture.layout(2, 1), [unit]).grads
        for k in summed:
            summed[k] += alone[k] * term.get("coefficient", 1.0)
    for k, g in result.grads.items():
        np.testing.assert_allclose(summed[k], g, rtol=1e-12, atol=1e-15)


def test_ce_term_is_the_single_term_oracle(packed):
    """ce with token_mean is contract v1's objective: the same numbers as oracle.py."""
    fixture, params = packed
    result = objective_loss_and_grad(params, fixture.layout(4, 2), [{"kind": "ce"}])
    weights = fixture.valid / fixture.num_valid_tokens
    expected = weighted_grad(params, fixture.inputs, fixture.targets, weights)
    assert result.loss == pytest.approx(
        weighted_loss(params, fixture.inputs, fixture.targets, weights), rel=1e-14
    )
    for k in ("embed", "unembed"):
        np.testing.assert_allclose(result.grads[k], expected[k], rtol=1e-12, atol=1e-16)
    assert result.term("ce").count == fixture.num_valid_tokens
    assert result.term("ce").denominators.tolist() == [fixture.num_valid_tokens]


def test_moe_lb_update_scope_is_layout_invariant(packed):
    fixture, params = packed
    terms = [{"kind": "moe_lb", "top_k": TOP_K}]
    reference = objective_loss_and_grad(params, fixture.layout(1, 1), terms)
    for R, M in LAYOUTS:
        result = objective_loss_and_grad(params, fixture.layout(R, M), terms)
        assert abs(result.loss - reference.loss) <= 1e-12 * abs(reference.loss), (R, M)
        for k, g in reference.grads.items():
            err = np.abs(result.grads[k] - g).max() / np.abs(g).max() if g.any() else 0.0
            assert err <= 1e-12, (R, M, k)


def test_moe_lb_microbatch_scope_depends_on_the_layout(packed):
    fixture, params = packed
    update = [{"kind": "moe_lb", "top_k": TOP_K}]
    local = [{"kind": "moe_lb", "top_k": TOP_K, "scope": "microbatch"}]
    # One microbatch: the two scopes are the same unit.
    one = objective_loss_and_grad(params, fixture.layout(1, 1), local)
    assert one.loss == pytest.approx(objective_loss(params, fixture.layout(1, 1), update), 1e-14)
    # The units are the R M microbatches: layouts with one R M split the rows alike.
    by_units: dict[int, set[float]] = {}
    for R, M in LAYOUTS:
        loss = objective_loss(params, fixture.layout(R, M), local)
        by_units.setdefault(R * M, set()).add(round(loss, 12))
    assert all(len(v) == 1 for v in by_units.values()), by_units
    distinct = sorted(v.pop() for v in by_units.values())
    assert len(distinct) == 4 and min(np.diff(distinct)) >= 1e-4, distinct
    finest = objective_loss_and_grad(params, fixture.layout(4, 2), local).term("moe_lb")
    assert finest.denominators.shape == (8,)


def test_moe_lb_is_switch_load_balancing_from_its_definition(packed):
    """LB_u = E sum_e f_ue P_ue written out token by token, per unit, at the finest layout."""
    fixture, params = packed
    batch = fixture.layout(4, 2)
    term = objective_loss_and_grad(
        params, batch, [{"kind": "moe_lb", "top_k": TOP_K, "scope": "microbatch"}]
    ).term("moe_lb")
    per_unit = []
    for _, _, mb in batch.microbatches():
        real = mb.segment_ids > 0
        z = params["embed"][mb.inputs[real]] @ params["router"]
        pi = np.exp(z - z.max(axis=1, keepdims=True))
        pi /= pi.sum(axis=1, keepdims=True)
        n = len(pi)
        f = np.zeros(E)
        for probs in pi:
            for e in sorted(range(E), key=lambda e: (-probs[e], e))[:TOP_K]:
                f[e] += 1 / (TOP_K * n)
        per_unit.append(E * float(f @ pi.mean(axis=0)))
    assert term.loss == pytest.approx(sum(per_unit) / len(per_unit), rel=1e-13)
    assert term.count == int((fixture.segment_ids > 0).sum())


def test_mtp_counts_fewer_targets_than_ce_on_packed_segments(packed):
    fixture, params = packed
    result = objective_loss_and_grad(params, fixture.layout(2, 2), full_objective())
    segments = fixture.segment_ids
    rows = np.nonzero(segments)[0]  # row-major, as segments[segments > 0]
    documents = set(zip(rows.tolist(), segments[segments > 0].tolist(), strict=True))
    # packed ignores only each document's last target, so y' loses one more per document.
    ce, mtp = result.term("ce").count, result.term("mtp").count
    assert mtp < ce
    assert mtp == ce - len(documents)
    assert result.term("mtp").denominators.tolist() == [mtp]


def test_mtp_targets_shift_inside_the_segment_only():
    N = IGNORE_INDEX
    targets = np.array([[5, 6, N, 7, 8, N, N, N]])
    segments = np.array([[1, 1, 1, 2, 2, 2, 0, 0]])
    assert mtp_targets(targets, segments).tolist() == [[6, N, N, 8, N, N, N, N]]


def test_frozen_reference_gets_no_gradient(packed):
    fixture, params = packed
    batch = fixture.layout(2, 2)
    result = objective_loss_and_grad(params, batch, full_objective())
    assert set(result.grads) == {"embed", "unembed", "mtp_unembed", "router"}
    assert not set(FROZEN_PARAMS) & set(result.grads)
    # The reference is read (moving it moves ref_kl), it is only not trained.
    moved = dict(params, ref_unembed=params["ref_unembed"] * 1.1)
    assert objective_loss(moved, batch, full_objective()) != result.loss


def test_a_param_no_term_reads_gets_a_zero_gradient(packed):
    fixture, params = packed
    grads = objective_loss_and_grad(params, fixture.layout(1, 1), [{"kind": "ce"}]).grads
    assert not grads["router"].any() and not grads["mtp_unembed"].any()
    assert grads["unembed"].any()


def test_top_k_ties_go_to_the_lower_expert():
    probs = np.array([[0.1, 0.3, 0.3, 0.3], [0.25, 0.25, 0.25, 0.25]])
    assert top_k_picks(probs, 2).tolist() == [
        [False, True, True, False],
        [True, True, False, False],
    ]


def test_hand_built_small_vocab_batch(packed):
    """A V = 11 batch with a prompt span and padding, laid out by hand."""
    rng = np.random.default_rng(7)
    inputs = rng.integers(0, 11, size=(4, 9))
    segments = np.array([[1] * 9, [1] * 5 + [2] * 4, [1] * 6 + [0] * 3, [3] * 7 + [0] * 2])
    targets = np.where(segments > 0, rng.integers(0, 11, size=(4, 9)), IGNORE_INDEX)
    targets[0, :3] = IGNORE_INDEX  # a prompt
    targets[1, 4] = IGNORE_INDEX  # a document boundary
    batch = lay_out(
        inputs, targets, segments, np.ones((4, 9)), Layout(2, 2), **default_row_fields(segments)
    )
    params = make_params(11, seed=7)
    router_logits = params["embed"][inputs] @ params["router"]
    assert top_k_margin(router_logits, segments > 0, TOP_K) >= MIN_TOP_K_MARGIN
    assert fd_error(params, batch, full_objective("microbatch")) <= FD_RTOL
    # Laid out without contract v2's row fields, the batch means their defaults.
    bare = lay_out(inputs, targets, segments, np.ones((4, 9)), Layout(2, 2))
    terms = [*full_objective(), {"kind": "ce", "name": "rows", "scheme": get_spec("row_mean")}]
    with_fields = objective_loss_and_grad(params, batch, terms)
    without = objective_loss_and_grad(params, bare, terms)
    assert without.loss == with_fields.loss
    assert all(np.array_equal(without.grads[k], g) for k, g in with_fields.grads.items())


@pytest.mark.parametrize(
    ("term", "message"),
    [
        ({"kind": "kl"}, "kind must be one of"),
        ({"coefficient": 1.0}, "needs a 'kind'"),
        ({"kind": "ce", "coefficient": True}, "real number"),
        ({"kind": "ce", "coefficient": float("nan")}, "finite"),
        ({"kind": "ce", "scope": "microbatch"}, "scheme's 'scope'"),
        ({"kind": "ce", "top_k": 2}, "moe_lb terms only"),
        ({"kind": "ce", "scheme": "token_mean"}, "scheme-spec dict"),
        ({"kind": "ce", "weight": 1}, "unknown keys"),
        ({"kind": "ce", "scheme": {"scope": "everywhere"}}, "term 'ce': scheme spec: scope"),
        ({"kind": "mtp", "scheme": {"denominator": {"kind": "configured"}}}, "needs a value"),
        ({"kind": "moe_lb"}, "needs top_k"),
        ({"kind": "moe_lb", "top_k": 0}, "positive integer"),
        ({"kind": "moe_lb", "top_k": 2, "scope": "rank"}, "update or microbatch"),
        ({"kind": "moe_lb", "top_k": 2, "scheme": {"scope": "rank"}}, "takes no scheme"),
    ],
)
def test_bad_terms_are_value_errors(term, message):
    with pytest.raises(ValueError, match=message):
        Term.from_data(term)


def test_bad_objectives_are_value_errors(packed):
    fixture, params = packed
    with pytest.raises(ValueError, match="at least one term"):
        parse_objective([])
    with pytest.raises(ValueError, match="list of terms"):
        parse_objective({"kind": "ce"})
    with pytest.raises(ValueError, match="unique"):
        parse_objective([{"kind": "ce"}, {"kind": "ce", "coefficient": 2.0}])
    two_ce = [{"kind": "ce"}, {"kind": "ce", "name": "ce_2"}]
    assert [t.name for t in parse_objective(two_ce)] == ["ce", "ce_2"]
    no_router = {k: v for k, v in params.items() if k != "router"}
    with pytest.raises(ValueError, match=r"needs params \['router'\]"):
        objective_loss_and_grad(no_router, fixture.layout(1, 1), full_objective())
    with pytest.raises(ValueError, match="top_k = 5"):
        objective_loss_and_grad(params, fixture.layout(1, 1), [{"kind": "moe_lb", "top_k": 5}])


def test_term_round_trips_through_its_data():
    term = Term.from_data({"kind": "moe_lb", "top_k": 2, "coefficient": -1, "name": "lb"})
    assert term.coefficient == -1.0 and isinstance(term.coefficient, float)
    assert Term.from_data(term.to_data()) == term
    spec = {"denominator": {"kind": "one"}}
    ce = Term.from_data({"kind": "ce", "scheme": spec})
    spec["denominator"]["kind"] = "tokens"  # the term keeps its own copy
    assert ce.scheme == {"denominator": {"kind": "one"}}


#: Per-token terms under v2 specs that read every row field of the rollouts fixture.
SPEC_TERMS = [
    {"kind": "ce", "scheme": get_spec("sample_rows_mean").to_dict()},
    {"kind": "entropy", "coefficient": -0.5, "scheme": get_spec("group_token_mean").to_dict()},
    {"kind": "mtp", "coefficient": 0.4, "scheme": get_spec("sequence_mean").to_dict()},
    {"kind": "z_loss", "coefficient": 0.05, "scheme": {"scope": "microbatch"}},
    {"kind": "ref_kl", "scheme": get_spec("signed_row_weight_mean").to_dict()},
    {"kind": "moe_lb", "coefficient": 0.5, "top_k": TOP_K},
]


#: Per-token terms whose groups are prompt groups or documents that cross rows, microbatches
#: and ranks on GROUPED_FIXTURES (and length powers, token weights): the torch and JAX objective
#: tests hold their implementations to the oracle with these.
GROUPED_TERMS = [
    {"kind": "ce", "scheme": get_spec("group_token_mean").to_dict()},
    {"kind": "entropy", "coefficient": -0.5, "scheme": get_spec("document_mean").to_dict()},
    {"kind": "mtp", "coefficient": 0.4, "scheme": get_spec("document_mean").to_dict()},
    # The groups' token means over the groups present in each microbatch: local D_u.
    {
        "kind": "z_loss",
        "coefficient": 0.05,
        "scheme": get_spec("group_token_mean").to_dict() | {"scope": "microbatch"},
    },
    {"kind": "ref_kl", "coefficient": 0.5, "scheme": get_spec("length_power:0.5").to_dict()},
    {
        "kind": "ce",
        "name": "ce_weighted",
        "coefficient": 0.2,
        "scheme": get_spec("weighted_mean").to_dict(),
    },
]
GROUPED_FIXTURES = ("rollouts", "continued-documents")


@pytest.mark.parametrize("fixture_name", GROUPED_FIXTURES)
def test_grouped_terms_count_across_ranks_on_their_fixtures(fixture_name):
    """A group or document count taken per microbatch changes the objective there, so the
    implementations' agreement with the oracle on these fixtures tests the global counts."""
    fixture = builtin_fixture(fixture_name)
    params = make_params(fixture.vocab_size)
    local = [
        dict(
            t,
            scheme=t["scheme"] | {"weight": t["scheme"]["weight"] | {"count_scope": "microbatch"}},
        )
        for t in GROUPED_TERMS
    ]
    batch = fixture.layout(4, 2)
    intended = objective_loss_and_grad(params, batch, GROUPED_TERMS).grads["unembed"]
    miscounted = objective_loss_and_grad(params, batch, local).grads["unembed"]
    assert np.abs(miscounted - intended).max() >= 1e-3 * np.abs(intended).max()


@pytest.fixture(scope="module")
def rollouts():
    fixture = builtin_fixture("rollouts")  # groups across ranks, a sample mask, signed weights
    params = make_params(fixture.vocab_size)
    router_logits = params["embed"][fixture.inputs] @ params["router"]
    assert top_k_margin(router_logits, fixture.segment_ids > 0, TOP_K) >= MIN_TOP_K_MARGIN
    return fixture, params


def test_spec_weighted_objective_matches_finite_differences(rollouts):
    fixture, params = rollouts
    assert fd_error(params, fixture.layout(2, 2), SPEC_TERMS) <= FD_RTOL


def test_term_weights_and_denominators_are_the_specs(rollouts):
    fixture, params = rollouts
    batch = fixture.layout(4, 2)
    result = objective_loss_and_grad(params, batch, SPEC_TERMS)
    shifted = batch._replace(targets=mtp_targets(batch.targets, batch.segment_ids))
    for term, data in zip(result.terms, SPEC_TERMS[:-1], strict=False):
        spec = get_spec(data["scheme"])
        on = shifted if term.kind == "mtp" else batch
        np.testing.assert_array_equal(term.token_weights, spec.effective_weights(on))
        assert term.denominators.tolist() == spec.unit_denominators(on)
    # sample_rows_mean counts only the rows its sample mask keeps.
    kept = fixture.valid & (fixture.sample_mask[:, None] != 0)
    assert result.term("ce").count == np.count_nonzero(kept) < fixture.num_valid_tokens
    assert result.term("z_loss").denominators.shape == (8,)  # one D_u per microbatch


def test_a_sibling_term_normalized_more_locally_depends_on_the_layout(rollouts):
    fixture, params = rollouts
    main = [{"kind": "ce"}, {"kind": "z_loss", "coefficient": 0.1}]
    local = [main[0], dict(main[1], scheme={"scope": "rank"})]
    base = objective_loss(params, fixture.layout(1, 1), main)
    assert objective_loss(params, fixture.layout(4, 1), main) == pytest.approx(base, rel=1e-13)
    assert objective_loss(params, fixture.layout(1, 1), local) == pytest.approx(base, rel=1e-13)
    assert abs(objective_loss(params, fixture.layout(4, 1), local) - base) >= 1e-6 * base
