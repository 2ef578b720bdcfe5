"""The multi-term bug patterns as buggy torch DDP steps on real gloo processes, named by
`diagnose_objective`; float64.

One launch per world size R in {1, 2, 4} runs every case of that size (starting a gloo group
costs seconds): the correct step at M in {1, 2} and each pattern at the layouts of `BUG_LAYOUTS`
(`LOCAL_BUG_LAYOUTS` for a pattern of a microbatch-scope term) with that R. Rank 0's gradient
is diagnosed here against the numpy oracle; every rank must hold the same bytes (one
all-reduce leaves the same on each).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from test_jax_objective_bugs import (
    AMBIGUOUS,
    BUG_LAYOUTS,
    BUGS,
    CORRECT_LAYOUTS,
    FIXTURE,
    LOCAL_BUG_LAYOUTS,
    LOCAL_BUGS,
    TERMS,
    terms_of,
)
from test_objective_oracle import make_params

from crosscheck.contract.fixture import BATCH_KEYS
from crosscheck.diagnosis.objective_diagnosis import diagnose_objective
from crosscheck.fixtures.builtin import builtin_fixture
from torch_impl.harness.launcher import launch
from torch_impl.harness.objective_bugs import (
    INTENDED,
    ObjectiveBugCase,
    check_target,
    run_objective_bug_cases,
)
from torch_impl.objective_terms import parse_terms

#: R = 4 with a dozen cases takes seconds on two cores; the bound only catches a hang.
LAUNCH_TIMEOUT_S = 180.0
#: Where torch's DDP idiom coincides with the intended objective: the step is correct there.
COINCIDING = [("aux-world-size-factor", "moe_lb", (1, 2)), ("sibling-term-scope", "z_loss", (1, 1))]
#: The world-size factor on a per-token term: each rank evaluates the gathered rows' term.
PER_TOKEN_FACTOR = ("aux-world-size-factor", "mtp", (2, 2))


def _case(pattern: str, target: str | None, R: int, M: int) -> ObjectiveBugCase:
    fixture = builtin_fixture(FIXTURE)
    return ObjectiveBugCase(
        label=f"{pattern}({target}) R={R},M={M}",
        pattern=pattern,
        target=target,
        batch={k: np.asarray(getattr(fixture, k)) for k in BATCH_KEYS},
        params=make_params(fixture.vocab_size),
        terms=terms_of(pattern),
        accum_steps=M,
        vocab_size=fixture.vocab_size,
    )


def _cases(R: int) -> list[tuple[str, str | None, tuple[int, int]]]:
    runs = [(INTENDED, None, layout) for layout in CORRECT_LAYOUTS]
    runs += [(p, t, layout) for p, t in BUGS for layout in BUG_LAYOUTS] + COINCIDING
    runs += [(p, t, layout) for p, t in LOCAL_BUGS for layout in LOCAL_BUG_LAYOUTS] + AMBIGUOUS
    runs.append(PER_TOKEN_FACTOR)
    return [run for run in runs if run[2][0] == R]


@functools.cache
def world_results(R: int) -> dict:
    """{(pattern, target, layout): rank 0's grads} of every case of world size R, one launch."""
    keys = _cases(R)
    per_rank = launch(
        run_objective_bug_cases,
        R,
        ([_case(p, t, *layout) for p, t, layout in keys],),
        timeout_s=LAUNCH_TIMEOUT_S,
    )
    for rank, outputs in enumerate(per_rank[1:], start=1):
        for first, other in zip(per_rank[0], outputs, strict=True):
            for name, g in first.grads.items():
                assert np.array_equal(other.grads[name], g), (first.label, rank, name)
    return {key: out.grads for key, out in zip(keys, per_rank[0], strict=True)}


def diagnose(key):
    (R, M) = key[2]
    fixture = builtin_fixture(FIXTURE)
    grads = world_results(R)[key]
    terms = terms_of(key[0])
    return diagnose_objective(make_params(fixture.vocab_size), fixture.layout(R, M), terms, grads)


@pytest.mark.parametrize(("R", "M"), CORRECT_LAYOUTS)
def test_the_correct_torch_step_is_named_intended_at_every_layout(R, M):
    d = diagnose((INTENDED, None, (R, M)))
    assert d.best_match == "intended", (d.explanation, d.candidate_errors)
    assert d.intended_error <= 1e-13
    assert all(abs(s - 1) <= 1e-12 for s in d.term_scales.values()), d.term_scales


@pytest.mark.parametrize("layout", BUG_LAYOUTS)
@pytest.mark.parametrize(("pattern", "target"), BUGS)
def test_each_buggy_torch_step_is_detected_and_named(pattern, target, layout):
    d = diagnose((pattern, target, layout))
    assert not d.intended_fits
    assert d.intended_error >= 1e-6  # far beyond rounding: a real error
    assert d.best_match == f"{pattern}({target})", (d.explanation, d.candidate_errors)
    assert d.candidate_errors[d.best_match] <= 1e-12


@pytest.mark.parametrize("layout", LOCAL_BUG_LAYOUTS)
@pytest.mark.parametrize(("pattern", "target"), LOCAL_BUGS)
def test_each_buggy_torch_step_of_a_microbatch_term_is_detected_and_named(pattern, target, layout):
    d = diagnose((pattern, target, layout))
    assert not d.intended_fits
    assert d.intended_error >= 1e-6
    assert d.best_match == f"{pattern}({target})", (d.explanation, d.candidate_errors)
    assert d.candidate_errors[d.best_match] <= 1e-12
    R, M = layout  # the router loss summed over the R M forwards instead of averaged
    assert abs(d.term_scales[target] - R * M) <= 1e-9 and abs(d.term_scales["ce"] - 1) <= 1e-12


@pytest.mark.parametrize(("pattern", "target", "layout"), AMBIGUOUS)
def test_a_torch_pattern_another_explains_as_well_is_ambiguous(pattern, target, layout):
    """At M = 1, x R M is x R: the world-size factor fits as well, and neither is named."""
    d = diagnose((pattern, target, layout))
    assert d.best_match == "ambiguous", (d.explanation, d.candidate_errors)
    assert set(d.explanations) == {f"{pattern}({target})", f"aux-world-size-factor({target})"}


@pytest.mark.parametrize(("pattern", "target", "layout"), COINCIDING)
def test_a_torch_pattern_that_coincides_with_the_intended_objective_names_nothing(
    pattern, target, layout
):
    d = diagnose((pattern, target, layout))
    assert d.best_match == "intended", (d.explanation, d.candidate_errors)


def test_the_world_size_factor_on_a_per_token_term_is_named_with_scale_r():
    d = diagnose(PER_TOKEN_FACTOR)
    assert d.best_match == "aux-world-size-factor(mtp)", (d.explanation, d.candidate_errors)
    assert abs(d.term_scales["mtp"] - 2) <= 1e-12 and abs(d.term_scales["ce"] - 1) <= 1e-12


def test_torch_sibling_scope_recovers_the_local_unit_weights():
    """At (2, 2) the z-loss of microbatch u weighs n / (R M n_u) of its intended weight."""
    fixture = builtin_fixture(FIXTURE)
    batch = fixture.layout(2, 2)
    d = diagnose(("sibling-term-scope", "z_loss", (2, 2)))
    n_u = (batch.targets != -100).reshape(2, 2, -1).sum(axis=2)
    np.testing.assert_allclose(d.unit_weights["z_loss"], n_u.sum() / (4 * n_u), rtol=1e-9)
    np.testing.assert_allclose(d.unit_weights["ce"], 1.0, rtol=1e-9)


@pytest.mark.parametrize(
    ("pattern", "target", "why"),
    [
        ("no-such-bug", "z_loss", "unknown pattern"),
        ("sibling-term-scope", "ce", "auxiliary"),
        ("shifted-aux-count", "z_loss", "mtp"),
        ("aux-global-count-local-stats", "mtp", "moe_lb"),
        ("sibling-term-scope", "moe_lb", "token-mean"),
        ("aux-summed-over-microbatches", "moe_lb", "microbatch scope"),  # TERMS': update
        ("aux-summed-over-microbatches", "z_loss", "moe_lb"),
    ],
)
def test_a_pattern_refuses_a_target_it_is_not_written_for(pattern, target, why):
    parsed = parse_terms(TERMS)
    hit = next(t for t in parsed if t.name == target)
    with pytest.raises(ValueError, match=why):
        check_target(pattern, hit, parsed[0])
