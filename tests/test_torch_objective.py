"""torch_impl.objective under DDP on real gloo processes vs the numpy closed-form oracle.

Every objective of `OBJECTIVES` runs at every layout (R in {1, 2, 4}) x (M in {1, 2}) on the
``packed`` fixture with the whole model family's params (E = 4 experts, top-2), and the
terms grouped by prompt group and document (`GROUPED_TERMS`) on the fixtures whose groups
and documents cross ranks, in one launch per world size (tests/torch_world.py explains why:
starting a gloo group costs seconds). Each rank returns its reduced gradients and update log;
the tests compare them with `crosscheck.contract.objective.objective_loss_and_grad` on the
same layout.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from test_objective_oracle import (
    GROUPED_FIXTURES,
    GROUPED_TERMS,
    MIN_TOP_K_MARGIN,
    TOP_K,
    E,
    full_objective,
    make_params,
)

from crosscheck.contract.objective import objective_loss_and_grad
from crosscheck.contract.objective_terms import top_k_margin
from crosscheck.contract.spec import get_spec
from crosscheck.fixtures.builtin import builtin_fixture
from torch_impl.batch import BATCH_KEYS, OPTIONAL_KEYS, context_microbatches, rank_microbatches
from torch_impl.harness.launcher import launch
from torch_impl.objective import (
    FROZEN_PARAMS,
    TRAINED_PARAMS,
    ObjectiveLM,
    objective_update,
    wrap_ddp,
)
from torch_impl.objective_terms import parse_terms

# Both sides compute in float64 from the same numbers and differ only in the order of their
# sums and where they divide (the oracle forms c_t = a_t / D / K per token, torch scales each
# microbatch's sum by s / (D K) and DDP divides by R): a few ulps per operation, ~1e-15 of the
# largest entry over the ~500 tokens here (measured <= 3e-15). 1e-12 leaves two and a half
# orders of margin, while one token weighted wrongly moves a gradient by ~1/258 relative and a
# term at the wrong scope by far more.
RTOL = 1e-12
#: Every launch must finish within this; R = 4 on two cores takes a few seconds.
LAUNCH_TIMEOUT_S = 240.0
FIXTURE = "packed"
WORLD_SIZES = (1, 2, 4)
LAYOUTS = [(R, M) for R in WORLD_SIZES for M in (1, 2)]
SEQUENCE_MEAN = get_spec("sequence_mean").to_dict()
OBJECTIVES: dict[str, list[dict]] = {
    "ce": [{"kind": "ce"}],
    "z_loss": [{"kind": "z_loss", "coefficient": 1e-2}],
    "entropy": [{"kind": "entropy", "coefficient": -0.7}],
    "ref_kl": [{"kind": "ref_kl"}],
    "mtp": [{"kind": "mtp"}],
    "moe_lb": [{"kind": "moe_lb", "top_k": TOP_K}],
    "moe_lb_microbatch": [{"kind": "moe_lb", "scope": "microbatch", "top_k": TOP_K}],
    "full": full_objective("update"),
    "full_moe_microbatch": full_objective("microbatch"),
    # Siblings normalized more locally and the row/segment means: their own unit denominators.
    "scopes": [
        {"kind": "ce"},
        {"kind": "ce", "name": "ce_local", "coefficient": 0.2, "scheme": {"scope": "microbatch"}},
        # The spec's full dict form, every default written out, reads the same.
        {"kind": "entropy", "coefficient": 0.1, "scheme": get_spec("rank_mean").to_dict()},
        {"kind": "mtp", "coefficient": 0.3, "scheme": SEQUENCE_MEAN},
        {"kind": "z_loss", "coefficient": 0.05, "scheme": get_spec("row_mean").to_dict()},
    ],
}


def fixture_and_params(name: str = FIXTURE):
    fixture = builtin_fixture(name)
    return fixture, make_params(fixture.vocab_size)


def _run_objectives(rank: int, world_size: int, jobs: list[tuple]) -> dict:
    """On each rank: every (label, terms, M, fixture[, (C, order)]) job as one update on a
    fresh DDP model; with (C, order), under context parallel: the world is R x C processes
    and this one holds its data rank's rows at its context rank's positions."""
    out = {}
    for label, terms, M, name, *context in jobs:
        fixture, params = fixture_and_params(name)
        # The contract v2 fields too: the group and document ids the grouped terms count.
        arrays = {key: getattr(fixture, key) for key in BATCH_KEYS + OPTIONAL_KEYS}
        module = ObjectiveLM(params, dtype=torch.float64)
        ddp = wrap_ddp(module, terms)
        if context:
            (C, order), R = context[0], world_size // context[0][0]
            microbatches = context_microbatches(arrays, rank, R, C, M, order)
        else:
            microbatches = rank_microbatches(arrays, rank, world_size, M)
        log = objective_update(ddp, microbatches, terms, vocab_size=fixture.vocab_size)
        grads = {
            name: None if p.grad is None else p.grad.numpy().copy()
            for name, p in module.named_parameters()
        }
        out[label] = {"log": log, "grads": grads}
    return out


def label(name: str, M: int) -> str:
    return f"{name}-M{M}"


@functools.cache
def world_results(world_size: int) -> list[dict]:
    """Every rank's outputs for every objective at both M, from one launch of R processes."""
    jobs = [(label(n, M), terms, M, FIXTURE) for M in (1, 2) for n, terms in OBJECTIVES.items()]
    jobs += [(label(f, M), GROUPED_TERMS, M, f) for M in (1, 2) for f in GROUPED_FIXTURES]
    jobs += [
        (context_label(name, layout), terms, layout[1], fixture, layout[2:])
        for layout in CONTEXT_LAYOUTS
        if layout[0] * layout[2] == world_size
        for name, terms, fixture in CONTEXT_OBJECTIVES
    ]
    return launch(_run_objectives, world_size, (jobs,), timeout_s=LAUNCH_TIMEOUT_S)


#: (R, M, C, order) under context parallel, R C <= 4 processes: both orders, C in {2, 4}.
CONTEXT_LAYOUTS = [(1, 2, 2, "zigzag"), (2, 1, 2, "contiguous"), (1, 1, 4, "zigzag")]
#: (name, terms, fixture): every kind at update scope (mtp shifted across the context split,
#: moe_lb's counts over every shard), moe_lb per data rank's microbatch, local scopes (per
#: process), and the grouped terms on the fixtures whose groups and documents cross ranks.
CONTEXT_OBJECTIVES = [
    ("full", OBJECTIVES["full"], FIXTURE),
    ("full_moe_microbatch", OBJECTIVES["full_moe_microbatch"], FIXTURE),
    ("scopes", OBJECTIVES["scopes"], FIXTURE),
    *((f"grouped-{f}", GROUPED_TERMS, f) for f in GROUPED_FIXTURES),
]


def context_label(name: str, layout: tuple) -> str:
    R, M, C, order = layout
    return f"{name}-R{R}-M{M}-C{C}-{order}"


def rel_err(actual: np.ndarray, expected: np.ndarray) -> float:
    """max |a - b| / max |b|; exact agreement required where b is all zero."""
    scale = float(np.abs(expected).max())
    diff = float(np.abs(actual - expected).max())
    return diff / scale if scale else diff


def test_the_fixture_keeps_every_top_k_pick_away_from_a_tie():
    """The counts are piecewise constant; rounding must not cross a tie of the router."""
    fixture, params = fixture_and_params()
    router_logits = params["embed"][fixture.inputs] @ params["router"]
    assert params["router"].shape[1] == E
    assert top_k_margin(router_logits, fixture.segment_ids > 0, TOP_K) >= MIN_TOP_K_MARGIN


#: A weight sum or power sum is a float sum whose order differs between torch and the oracle
#: (per microbatch, then over them): a few ulps apart at most. Counts are compared exactly.
FLOAT_DENOMINATOR_RTOL = 1e-14


def assert_denominators_equal(got, expected: np.ndarray, name: str) -> None:
    """D_u bit for bit where it is an integer count (k n^2 / E is one rounding of an exact
    product on both sides, so it too), within FLOAT_DENOMINATOR_RTOL where it is a float sum."""
    assert len(got) == len(expected), name
    for a, b in zip(got, expected.tolist(), strict=True):
        if float(b).is_integer():
            assert a == b, (name, a, b)
        else:
            assert abs(a - b) <= FLOAT_DENOMINATOR_RTOL * abs(b), (name, a, b)


def assert_matches_the_oracle(outputs: list[dict], expected) -> None:
    """Rank 0's gradients, total and terms against the oracle; every rank the same."""
    got = outputs[0]
    for key, g in expected.grads.items():
        grad = got["grads"][key]
        if grad is None:  # a param no term reads: DDP leaves its grad unset, the oracle 0
            assert not g.any(), key
            continue
        assert rel_err(grad, g) <= RTOL, (key, rel_err(grad, g))
    log = got["log"]
    assert abs(log.loss - expected.loss) <= RTOL * abs(expected.loss)
    assert [t.name for t in log.terms] == [t.name for t in expected.terms]
    for term, oracle in zip(log.terms, expected.terms, strict=True):
        assert abs(term.loss - oracle.loss) <= RTOL * abs(oracle.loss), term.name
        assert term.count == oracle.count, term.name
        assert_denominators_equal(term.denominators, oracle.denominators, term.name)
    for output in outputs:
        # The frozen reference is read by ref_kl but never gets a gradient.
        assert all(output["grads"][p] is None for p in FROZEN_PARAMS)
        # DDP hands every rank the same reduced buffer.
        for key in TRAINED_PARAMS:
            a, b = output["grads"][key], got["grads"][key]
            assert (a is None and b is None) or np.array_equal(a, b), key
        assert output["log"] == log


@pytest.mark.parametrize("name", list(OBJECTIVES))
@pytest.mark.parametrize(("R", "M"), LAYOUTS)
def test_ddp_objective_matches_the_oracle(R, M, name):
    fixture, params = fixture_and_params()
    expected = objective_loss_and_grad(params, fixture.layout(R, M), OBJECTIVES[name])
    assert_matches_the_oracle([per_rank[label(name, M)] for per_rank in world_results(R)], expected)


@pytest.mark.parametrize("fixture_name", GROUPED_FIXTURES)
@pytest.mark.parametrize(("R", "M"), LAYOUTS)
def test_group_and_document_terms_match_the_oracle(R, M, fixture_name):
    """Prompt groups (rollouts) and documents (continued-documents) cross microbatches and
    ranks: each term's counts are the update's, reduced before the backward."""
    fixture, params = fixture_and_params(fixture_name)
    expected = objective_loss_and_grad(params, fixture.layout(R, M), GROUPED_TERMS)
    outputs = [per_rank[label(fixture_name, M)] for per_rank in world_results(R)]
    assert_matches_the_oracle(outputs, expected)


@pytest.mark.parametrize(("name", "terms", "fixture_name"), CONTEXT_OBJECTIVES)
@pytest.mark.parametrize(("R", "M", "C", "order"), CONTEXT_LAYOUTS)
def test_objectives_under_context_parallel_match_the_oracle(
    R, M, C, order, name, terms, fixture_name
):
    """Every term keeps its own counts across the context shards (verl#6836): z_loss and ce
    their tokens over every process, mtp its targets shifted on whole rows, moe_lb its
    router counts over every shard of its unit; against the oracle on the same layout."""
    fixture, params = fixture_and_params(fixture_name)
    layout = (R, M, C, order)
    expected = objective_loss_and_grad(params, fixture.layout(*layout), terms)
    outputs = [per_rank[context_label(name, layout)] for per_rank in world_results(R * C)]
    assert_matches_the_oracle(outputs, expected)


def test_update_scope_moe_lb_is_layout_invariant_and_microbatch_scope_is_not():
    losses = {
        (R, M): world_results(R)[0][label(name, M)]["log"].term("moe_lb").loss
        for R, M in LAYOUTS
        for name in ("moe_lb",)
    }
    reference = losses[1, 1]
    assert all(abs(v - reference) <= RTOL * reference for v in losses.values()), losses
    local = [world_results(R)[0][label("moe_lb_microbatch", M)]["log"] for R, M in ((1, 1), (4, 2))]
    assert local[0].term("moe_lb").loss == pytest.approx(reference, rel=RTOL)
    assert abs(local[1].term("moe_lb").loss - reference) >= 1e-4 * reference
    assert len(local[1].term("moe_lb").denominators) == 8  # one D_u per (rank, microbatch)


def test_mtp_counts_its_own_shifted_targets():
    log = world_results(2)[0][label("full", 2)]["log"]
    assert log.term("mtp").count < log.term("ce").count
    assert log.term("mtp").denominators == (log.term("mtp").count,)


def test_frozen_reference_is_not_trained_but_read():
    fixture, params = fixture_and_params()
    module = ObjectiveLM(params)
    assert [n for n, p in module.named_parameters() if not p.requires_grad] == list(FROZEN_PARAMS)
    arrays = {key: getattr(fixture, key) for key in BATCH_KEYS}
    # Without a process group: R = 1, no collective; moving the reference moves ref_kl.
    base = objective_update(
        module,
        rank_microbatches(arrays, 0, 1, 1),
        [{"kind": "ref_kl"}],
        vocab_size=fixture.vocab_size,
    )
    moved = ObjectiveLM(dict(params, ref_unembed=params["ref_unembed"] * 1.1))
    other = objective_update(
        moved,
        rank_microbatches(arrays, 0, 1, 1),
        [{"kind": "ref_kl"}],
        vocab_size=fixture.vocab_size,
    )
    assert other.loss != base.loss
    assert module.ref_embed.grad is None and module.ref_unembed.grad is None


@pytest.mark.parametrize(
    ("terms", "message"),
    [
        ([{"kind": "kl"}], "kind must be one of"),
        ([{"kind": "ce", "coefficient": True}], "real number"),
        ([{"kind": "ce", "coefficient": float("inf")}], "finite"),
        ([{"kind": "ce", "typo": 1}], "unknown keys"),
        ([{"kind": "ce", "scope": "microbatch"}], "scheme's 'scope'"),
        ([{"kind": "ce", "scheme": {"scope": "everywhere"}}], "'ce'.*scope must be one of"),
        ([{"kind": "ce", "scheme": {"weight": {"group": "team"}}}], "group must be one of"),
        ([{"kind": "ce", "scheme": {"denominator": {"kind": "configured"}}}], "value"),
        ([{"kind": "ce", "scheme": {"weight": {"sign": 1}}}], "unknown key"),
        ([{"kind": "ce", "scheme": "token_mean"}], "scheme-spec dict"),
        ([{"kind": "moe_lb"}], "positive integer"),
        ([{"kind": "moe_lb", "top_k": 2, "scope": "rank"}], "update or microbatch"),
        ([{"kind": "moe_lb", "top_k": 2, "scheme": {"scope": "rank"}}], "takes no scheme"),
        ([], "at least one term"),
        ({"kind": "ce"}, "list of terms"),
        ([{"kind": "ce"}, {"kind": "ce"}], "unique"),
    ],
)
def test_bad_terms_are_value_errors(terms, message):
    with pytest.raises(ValueError, match=message):
        parse_terms(terms)


def test_missing_params_and_top_k_are_value_errors():
    fixture, params = fixture_and_params()
    arrays = {key: getattr(fixture, key) for key in BATCH_KEYS}
    batch = rank_microbatches(arrays, 0, 1, 1)
    no_router = ObjectiveLM({k: v for k, v in params.items() if k != "router"})
    with pytest.raises(ValueError, match=r"needs params \['router'\]"):
        objective_update(no_router, batch, full_objective(), vocab_size=fixture.vocab_size)
    with pytest.raises(ValueError, match="top_k = 5"):
        objective_update(
            ObjectiveLM(params),
            batch,
            [{"kind": "moe_lb", "top_k": 5}],
            vocab_size=fixture.vocab_size,
        )
    with pytest.raises(ValueError, match="needs 'embed'"):
        ObjectiveLM({"unembed": params["unembed"]})
