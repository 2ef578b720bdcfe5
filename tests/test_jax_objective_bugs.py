"""The multi-term bug patterns as buggy JAX steps, named by `diagnose_objective`; float64.

x64 is global to a process and the mesh needs 8 host devices, so the JAX side runs in its own
process (as in tests/test_jax_objective.py): this file run as a script computes every step's
gradient and pickles it; the tests diagnose them here against the numpy oracle.
"""

from __future__ import annotations

import numpy as np
import pytest
from child_env import write_worker_results, x64_worker_results
from test_objective_oracle import TOP_K, make_params

from crosscheck.diagnosis.objective_diagnosis import diagnose_objective
from crosscheck.fixtures.builtin import builtin_fixture

FIXTURE = "packed"
TERMS = [
    {"kind": "ce"},
    {"kind": "z_loss", "coefficient": 0.1},
    {"kind": "mtp", "coefficient": 0.3},
    {"kind": "moe_lb", "coefficient": 0.5, "top_k": TOP_K},
]
CORRECT_LAYOUTS = [(R, M) for R in (1, 2, 4) for M in (1, 2)]
#: Layouts where each pattern shows: R M > 1 for the scopes and local statistics, R > 1 for
#: the world-size factor; the others show at every layout.
BUG_LAYOUTS = [(2, 2), (4, 1)]
BUGS = [
    ("sibling-term-scope", "z_loss"),
    ("shifted-aux-count", "mtp"),
    ("aux-world-size-factor", "moe_lb"),
    ("aux-global-count-local-stats", "moe_lb"),
    ("aux-coefficient-twice", "z_loss"),
]
#: Where a pattern coincides with the intended objective: the step is correct there.
COINCIDING = [("aux-world-size-factor", "moe_lb", (1, 2)), ("sibling-term-scope", "z_loss", (1, 1))]
#: A pattern of a term meant per microbatch runs on TERMS with the load balancing per
#: microbatch (a MoE model's own router loss), at layouts with R > 1 and M > 1 (x R M is the
#: world-size factor x R at M = 1).
LOCAL_TERMS = [{**t, "scope": "microbatch"} if t["kind"] == "moe_lb" else t for t in TERMS]
LOCAL_BUGS = [("aux-summed-over-microbatches", "moe_lb")]
LOCAL_BUG_LAYOUTS = [(2, 2), (2, 4)]
#: Where a pattern is another's on the same term: (pattern, target, layout), both names fit.
AMBIGUOUS = [("aux-summed-over-microbatches", "moe_lb", (4, 1))]
#: Every buggy step either framework runs: (pattern, target, layout).
BUG_RUNS = [
    *((p, t, layout) for p, t in BUGS for layout in BUG_LAYOUTS),
    *((p, t, layout) for p, t in LOCAL_BUGS for layout in LOCAL_BUG_LAYOUTS),
    *COINCIDING,
    *AMBIGUOUS,
]


def terms_of(pattern: str) -> list[dict]:
    """The objective a pattern's step runs on."""
    return LOCAL_TERMS if pattern in dict(LOCAL_BUGS) else TERMS


def jax_results() -> dict:
    """Run in the child: every step's gradient, as numpy."""
    import jax

    jax.config.update("jax_enable_x64", True)
    from jax_impl.batch import lay_out_global_batch
    from jax_impl.harness.objective_bugs import make_objective_bug_fn
    from jax_impl.objective import make_objective_fn
    from jax_impl.shard_map_step import data_mesh

    fixture = builtin_fixture(FIXTURE)
    params = make_params(fixture.vocab_size)
    arrays = {k: getattr(fixture, k) for k in ("inputs", "targets", "segment_ids", "weights")}

    def batch(R: int, M: int):
        return lay_out_global_batch(arrays, R, M, vocab_size=fixture.vocab_size)

    results = {}
    for R, M in CORRECT_LAYOUTS:
        out = make_objective_fn(TERMS, data_mesh(R))(params, batch(R, M))
        results["intended", None, (R, M)] = jax.tree.map(np.asarray, out.grads)
    for pattern, target, (R, M) in BUG_RUNS:
        fn = make_objective_bug_fn(pattern, terms_of(pattern), target, data_mesh(R))
        grads = fn(params, batch(R, M))
        results[pattern, target, (R, M)] = jax.tree.map(np.asarray, grads)
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return x64_worker_results(__file__, tmp_path_factory.mktemp("jax_objective_bugs"), timeout=240)


def diagnose(grads, R: int, M: int, terms=TERMS):
    fixture = builtin_fixture(FIXTURE)
    params = make_params(fixture.vocab_size)
    return diagnose_objective(params, fixture.layout(R, M), terms, grads)


@pytest.mark.parametrize(("R", "M"), CORRECT_LAYOUTS)
def test_the_correct_jax_step_is_named_intended_at_every_layout(results, R, M):
    d = diagnose(results["intended", None, (R, M)], R, M)
    assert d.best_match == "intended", (d.explanation, d.candidate_errors)
    assert d.intended_error <= 1e-13
    assert all(abs(s - 1) <= 1e-12 for s in d.term_scales.values()), d.term_scales


@pytest.mark.parametrize("layout", BUG_LAYOUTS)
@pytest.mark.parametrize(("pattern", "target"), BUGS)
def test_each_buggy_jax_step_is_detected_and_named(results, pattern, target, layout):
    d = diagnose(results[pattern, target, layout], *layout)
    assert not d.intended_fits
    assert d.intended_error >= 1e-6  # far beyond rounding: a real error
    assert d.best_match == f"{pattern}({target})", (d.explanation, d.candidate_errors)
    assert d.candidate_errors[d.best_match] <= 1e-12


@pytest.mark.parametrize("layout", LOCAL_BUG_LAYOUTS)
@pytest.mark.parametrize(("pattern", "target"), LOCAL_BUGS)
def test_each_buggy_jax_step_of_a_microbatch_term_is_detected_and_named(
    results, pattern, target, layout
):
    d = diagnose(results[pattern, target, layout], *layout, LOCAL_TERMS)
    assert not d.intended_fits
    assert d.intended_error >= 1e-6
    assert d.best_match == f"{pattern}({target})", (d.explanation, d.candidate_errors)
    assert d.candidate_errors[d.best_match] <= 1e-12
    R, M = layout  # the router loss summed over the R M forwards instead of averaged
    assert abs(d.term_scales[target] - R * M) <= 1e-9 and abs(d.term_scales["ce"] - 1) <= 1e-12


@pytest.mark.parametrize(("pattern", "target", "layout"), AMBIGUOUS)
def test_a_jax_pattern_another_explains_as_well_is_ambiguous(results, pattern, target, layout):
    """At M = 1, x R M is x R: the world-size factor fits as well, and neither is named."""
    d = diagnose(results[pattern, target, layout], *layout, terms_of(pattern))
    assert d.best_match == "ambiguous", (d.explanation, d.candidate_errors)
    assert set(d.explanations) == {f"{pattern}({target})", f"aux-world-size-factor({target})"}


@pytest.mark.parametrize(("pattern", "target", "layout"), COINCIDING)
def test_a_pattern_that_coincides_with_the_intended_objective_names_nothing(
    results, pattern, target, layout
):
    d = diagnose(results[pattern, target, layout], *layout)
    assert d.best_match == "intended", (d.explanation, d.candidate_errors)


def test_jax_sibling_scope_recovers_the_local_unit_weights(results):
    """At (4, 1) the z-loss of rank r weighs n / (R n_r) of its intended weight."""
    fixture = builtin_fixture(FIXTURE)
    batch = fixture.layout(4, 1)
    d = diagnose(results["sibling-term-scope", "z_loss", (4, 1)], 4, 1)
    n_r = (batch.targets != -100).reshape(4, -1).sum(axis=1)
    np.testing.assert_allclose(d.rank_weights["z_loss"], n_r.sum() / (4 * n_r), rtol=1e-9)
    np.testing.assert_allclose(d.rank_weights["ce"], 1.0, rtol=1e-9)
    assert d.residual <= 1e-13


if __name__ == "__main__":
    write_worker_results(jax_results)
