"""jax_impl.objective (shard_map, autodiff) vs the numpy closed-form oracle, float64, 1e-12.

x64 is global to a process and the mesh needs 8 host devices, so the JAX side runs in its own
process: this file run as a script (`python tests/test_jax_objective.py --out F`) computes the
objective at every layout, and the terms grouped by prompt group and document
(`GROUPED_TERMS`) on the fixtures whose groups and documents cross ranks, and pickles the
results; the test compares them with `crosscheck.contract.objective` computed here.
"""

from __future__ import annotations

import numpy as np
import pytest
from child_env import write_worker_results, x64_worker_results
from test_objective_oracle import GROUPED_FIXTURES, GROUPED_TERMS, TOP_K, make_params

from crosscheck.contract.objective import objective_loss_and_grad
from crosscheck.contract.spec import get_spec
from crosscheck.fixtures.builtin import builtin_fixture
from jax_impl.objective import parse_terms

# Both sides compute in float64 from the same numbers; they differ only in the order of
# their sums and where they divide: a few ulps per token, far below 1e-12 over ~500 tokens.
RTOL = 1e-12
RANK_MEAN = get_spec("rank_mean").to_dict()
LAYOUTS = [(R, M) for R in (1, 2, 4) for M in (1, 2)]
#: Groups and documents split over microbatches (R = 1), and over ranks too: one compile per
#: layout serves both fixtures (their id ranges are laid out to the same static size).
GROUPED_LAYOUTS = [(1, 2), (2, 2), (4, 2)]
#: (R, M, C, order) under context parallel: both orders, C in {2, 4}.
CONTEXT_LAYOUTS = [(2, 1, 2, "zigzag"), (1, 2, 4, "contiguous"), (2, 2, 2, "zigzag")]
BATCH_FIELDS = ("inputs", "targets", "segment_ids", "weights")
TERMS = [
    {"kind": "ce"},
    {"kind": "z_loss", "coefficient": 1e-2},
    {"kind": "entropy", "coefficient": -0.3},
    {"kind": "ref_kl", "coefficient": 0.5},
    {"kind": "mtp", "coefficient": 0.3},
    # Siblings normalized more locally: their own unit denominators, per rank or microbatch.
    {"kind": "ce", "name": "ce_local", "coefficient": 0.2, "scheme": {"scope": "microbatch"}},
    # The spec's full dict form, every default written out, reads the same.
    {"kind": "entropy", "name": "entropy_rank", "coefficient": 0.1, "scheme": RANK_MEAN},
    {"kind": "moe_lb", "coefficient": 0.8, "top_k": TOP_K},
    {"kind": "moe_lb", "name": "moe_lb_local", "scope": "microbatch", "top_k": TOP_K},
]


def jax_results() -> dict:
    """Run in the child: the JAX objective at every layout, as numpy."""
    import jax

    jax.config.update("jax_enable_x64", True)
    from jax_impl.batch import lay_out_global_batch
    from jax_impl.context_parallel import context_mesh, lay_out_context_parallel
    from jax_impl.objective import make_objective_fn
    from jax_impl.shard_map_step import data_mesh

    fixture = builtin_fixture("packed")
    params = make_params(fixture.vocab_size)
    arrays = {k: getattr(fixture, k) for k in BATCH_FIELDS}
    results = {}
    for R, M in LAYOUTS:
        batch = lay_out_global_batch(arrays, R, M, vocab_size=fixture.vocab_size)
        out = make_objective_fn(TERMS, data_mesh(R))(params, batch)
        results[R, M] = jax.tree.map(np.asarray, out._asdict())
    grouped = [builtin_fixture(name) for name in GROUPED_FIXTURES]
    fields = ("group_ids", "document_ids", "row_weights", "sample_mask")
    sizes = {
        "num_groups": max(int(f.group_ids.max()) + 1 for f in grouped),
        "num_documents": max(int(f.document_ids.max()) + 1 for f in grouped),
    }
    for R, M in GROUPED_LAYOUTS:
        objective = make_objective_fn(GROUPED_TERMS, data_mesh(R))
        for fixture in grouped:
            arrays = {k: getattr(fixture, k) for k in (*arrays, *fields)}
            batch = lay_out_global_batch(arrays, R, M, vocab_size=fixture.vocab_size, **sizes)
            out = objective(make_params(fixture.vocab_size), batch)
            results[fixture.name, R, M] = jax.tree.map(np.asarray, out._asdict())
    for R, M, C, order in CONTEXT_LAYOUTS:
        mesh = context_mesh(R, C)
        for name, terms, fixtures in (
            ("terms", TERMS, ["packed"]),
            ("grouped", GROUPED_TERMS, grouped),
        ):
            objective = make_objective_fn(terms, mesh, context_order=order)
            for fixture in (builtin_fixture(f) if isinstance(f, str) else f for f in fixtures):
                arrays = {k: getattr(fixture, k) for k in (*BATCH_FIELDS, *fields)}
                # The grouped fixtures share their id ranges' static sizes (one compile).
                shared = sizes if name == "grouped" else {}
                batch = lay_out_context_parallel(
                    arrays, R, M, C, order, vocab_size=fixture.vocab_size, **shared
                )
                out = objective(make_params(fixture.vocab_size), batch)
                key = (name, fixture.name, R, M, C, order)
                results[key] = jax.tree.map(np.asarray, out._asdict())
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return x64_worker_results(__file__, tmp_path_factory.mktemp("jax_objective"), timeout=240)


def rel_err(actual: np.ndarray, expected: np.ndarray) -> float:
    scale = np.abs(expected).max()
    return float(np.abs(actual - expected).max() / scale) if scale else float(np.abs(actual).max())


@pytest.mark.parametrize(("R", "M"), LAYOUTS)
def test_jax_objective_matches_the_oracle(results, R, M):
    fixture = builtin_fixture("packed")
    params = make_params(fixture.vocab_size)
    expected = objective_loss_and_grad(params, fixture.layout(R, M), TERMS)
    got = results[R, M]
    assert rel_err(got["loss"], np.float64(expected.loss)) <= RTOL
    assert set(got["grads"]) == set(expected.grads) == {"embed", "unembed", "mtp_unembed", "router"}
    for key, g in expected.grads.items():
        assert rel_err(got["grads"][key], g) <= RTOL, key
    for i, term in enumerate(expected.terms):
        assert rel_err(got["term_losses"][i], np.float64(term.loss)) <= RTOL, term.name
        assert int(got["term_counts"][i]) == term.count, term.name
        np.testing.assert_array_equal(got["term_denominators"][i], term.denominators)


def term_loss(results: dict, layout: tuple[int, int], name: str) -> float:
    names = [t.get("name", t["kind"]) for t in TERMS]
    return float(results[layout]["term_losses"][names.index(name)])


@pytest.mark.parametrize("fixture_name", GROUPED_FIXTURES)
@pytest.mark.parametrize(("R", "M"), GROUPED_LAYOUTS)
def test_group_and_document_terms_match_the_oracle(results, R, M, fixture_name):
    """Prompt groups (rollouts) and documents (continued-documents) cross microbatches and
    ranks: each term's counts are the update's, reduced before the backward."""
    fixture = builtin_fixture(fixture_name)
    expected = objective_loss_and_grad(
        make_params(fixture.vocab_size), fixture.layout(R, M), GROUPED_TERMS
    )
    got = results[fixture_name, R, M]
    for key, g in expected.grads.items():
        assert rel_err(got["grads"][key], g) <= RTOL, key
    assert abs(float(got["loss"]) - expected.loss) <= RTOL * abs(expected.loss)
    for k, term in enumerate(expected.terms):
        assert abs(got["term_losses"][k] - term.loss) <= RTOL * abs(term.loss), term.name
        assert int(got["term_counts"][k]) == term.count, term.name
        # Counts exact; weight and power sums are float sums in another order: a few ulps.
        np.testing.assert_allclose(got["term_denominators"][k], term.denominators, rtol=1e-14)


@pytest.mark.parametrize(("R", "M", "C", "order"), CONTEXT_LAYOUTS)
def test_objectives_under_context_parallel_match_the_oracle(results, R, M, C, order):
    """Every term keeps its own counts across the context shards (verl#6836): each per-token
    term's over every process, mtp's targets shifted on whole rows across the split, moe_lb's
    router counts over every shard of its unit (the whole update, or its data rank's
    microbatch); local scopes per process. Against the oracle on the same layout."""
    for name, terms, fixture_names in (
        ("terms", TERMS, ["packed"]),
        ("grouped", GROUPED_TERMS, GROUPED_FIXTURES),
    ):
        for fixture_name in fixture_names:
            fixture = builtin_fixture(fixture_name)
            expected = objective_loss_and_grad(
                make_params(fixture.vocab_size), fixture.layout(R, M, C, order), terms
            )
            got = results[name, fixture_name, R, M, C, order]
            where = f"{name} on {fixture_name}"
            for key, g in expected.grads.items():
                assert rel_err(got["grads"][key], g) <= RTOL, (where, key)
            for k, term in enumerate(expected.terms):
                assert abs(got["term_losses"][k] - term.loss) <= RTOL * abs(term.loss), term.name
                assert int(got["term_counts"][k]) == term.count, (where, term.name)
                # Counts exact; weight and power sums in another order: a few ulps.
                np.testing.assert_allclose(
                    got["term_denominators"][k], term.denominators, rtol=1e-14, err_msg=where
                )


def test_microbatch_scope_moe_lb_differs_across_layouts_in_jax_too(results):
    local = [term_loss(results, layout, "moe_lb_local") for layout in ((1, 1), (4, 2))]
    assert abs(local[0] - local[1]) >= 1e-4 * local[0]
    update = [term_loss(results, layout, "moe_lb") for layout in LAYOUTS]
    assert max(update) - min(update) <= RTOL * update[0]


@pytest.mark.parametrize(
    ("term", "message"),
    [
        ({"kind": "ce", "scheme": {"scope": "everywhere"}}, "'ce'.*allowed values"),
        ({"kind": "ce", "scheme": {"weight": {"group": "team"}}}, "allowed values"),
        ({"kind": "ce", "scheme": {"weight": {"sign": 1}}}, "unknown key"),
        ({"kind": "ce", "scheme": "token_mean"}, "scheme-spec dict"),
        ({"kind": "ce", "scope": "microbatch"}, "scheme's 'scope'"),
        ({"kind": "ce", "coefficient": True}, "not a number"),
        ({"kind": "moe_lb"}, "positive top_k"),
        ({"kind": "moe_lb", "top_k": 2, "scheme": {"scope": "rank"}}, "takes no scheme"),
        ({"kind": "ce", "top_k": 2, "typo": 1}, "unknown keys"),
    ],
)
def test_jax_refuses_bad_terms(term, message):
    with pytest.raises(ValueError, match=message):
        parse_terms([term])
    scopes = [t.scope for t in parse_terms([{"kind": "ce", "scheme": RANK_MEAN}, {"kind": "mtp"}])]
    assert scopes == ["rank", "update"]


if __name__ == "__main__":
    write_worker_results(jax_results)
