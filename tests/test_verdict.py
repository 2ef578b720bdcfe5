"""Precision-aware verdicts on oracle-made gradients: rounding is not a bug, a skew is.

The gradients here are the oracle's, rounded to float32 or bf16 the way a step's output would
be, or reweighted as a bug would reweight them; real float32 and bf16 steps of both frameworks
are judged in tests/test_third_party.py and tests/test_verify_precision.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from crosscheck.contract.fixture import Fixture
from crosscheck.contract.oracle import loss_and_grad, weighted_grad
from crosscheck.contract.schemes import Constant, get_scheme
from crosscheck.diagnosis.diagnose import AMBIGUOUS, diagnose
from crosscheck.diagnosis.explain import FAMILY_FIXES, fix_text, guide
from crosscheck.diagnosis.naming import headline, minimal
from crosscheck.diagnosis.patterns import PATTERNS
from crosscheck.diagnosis.verdict import Z_SCORE, auto_levels, level_of, tolerance
from crosscheck.fixtures.builtin import builtin_fixture

LAYOUTS = ((2, 1), (1, 2), (2, 2), (4, 1), (2, 4))


def _grad(fixture: Fixture, weights: np.ndarray) -> dict[str, np.ndarray]:
    return weighted_grad(fixture.params(), fixture.inputs, fixture.targets, weights)


def _bf16(values: np.ndarray) -> np.ndarray:
    """Round to bfloat16 (nearest, ties to even) and back: the top 16 bits of a float32."""
    bits = np.asarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


def _rounded(grads: dict, dtype: str) -> dict:
    if dtype == "float64":
        return grads
    if dtype == "float32":
        return {k: v.astype(np.float32).astype(np.float64) for k, v in grads.items()}
    return {k: _bf16(v) for k, v in grads.items()}


def _intended(fixture: Fixture, R: int, M: int, scheme: str = "token_mean") -> np.ndarray:
    return loss_and_grad(fixture, scheme, R, M).token_weights


def _rank_share(fixture: Fixture, R: int, rank: int) -> np.ndarray:
    rows = fixture.num_rows // R
    return (np.arange(fixture.num_rows) // rows == rank)[:, None]


def test_levels_are_chosen_from_the_noise_finest_first():
    assert level_of(1e-15, auto_levels("float64")) == "float64"
    assert level_of(5e-8, auto_levels("float64")) == "float32"
    # bf16 noise is beyond what a float64 or float32 step's own rounding explains...
    assert level_of(3e-3, auto_levels("float64")) is None
    # ...and is its level when the step was given bf16 params.
    assert level_of(3e-3, auto_levels("bfloat16")) == "bfloat16"
    # docs/contract.md's tolerances are the levels' thresholds and the weight tolerances.
    assert [tolerance(p) for p in ("float64", "float32", "bfloat16")] == [1e-12, 1e-5, 2e-2]


@pytest.mark.parametrize("fixture_name", ["packed", "ragged", "soft-weights", "empty-rank"])
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
def test_a_correct_gradient_rounded_to_its_dtype_passes_at_that_level(fixture_name, dtype):
    fixture = builtin_fixture(fixture_name)
    scheme = "weighted_mean" if fixture_name == "soft-weights" else "token_mean"
    for R, M in fixture.valid_layouts():
        if (R, M) not in LAYOUTS:
            continue
        grads = _rounded(loss_and_grad(fixture, scheme, R, M).grads, dtype)
        d = diagnose(fixture, R, M, grads, scheme, dtype=dtype)
        where = f"{fixture_name} R={R} M={M} {dtype}: {d.explanation}"
        assert not d.detected and d.best_match == scheme, where
        assert d.precision == dtype, where
        assert d.intended_error <= tolerance(dtype), where


def test_the_strict_judgement_fails_float32_arithmetic_and_says_why():
    fixture = builtin_fixture("ragged")
    grads = _rounded(loss_and_grad(fixture, "token_mean", 2, 2).grads, "float32")
    d = diagnose(fixture, 2, 2, grads, "token_mean", precision="float64")
    assert d.detected and d.beyond_precision and d.precision == "float64"
    assert "not a per-document reweighting of token_mean's weights at float64-exact" in (
        d.explanation
    )
    assert "float32-level rounding, which the step's float64 params allow" in d.explanation
    assert d.fix.startswith("judge the step at precision float32")
    # float32 rounding of O(1) numbers: relative error between 1e-9 and the float32 tolerance.
    assert 1e-9 < d.intended_error < 1e-5


def test_bf16_noise_is_not_waved_through_for_a_float64_step():
    """bf16-sized deviations pass only when the step was given bf16 params, handed back a bf16
    gradient, or asked; otherwise the verdict fails and says what the residual looks like."""
    fixture = builtin_fixture("packed")
    grads = _rounded(loss_and_grad(fixture, "token_mean", 2, 2).grads, "bfloat16")
    d = diagnose(fixture, 2, 2, grads, "token_mean", dtype="float64")
    assert d.detected and d.beyond_precision and d.precision == "float32"
    # Not judged at bf16 (bf16 is not a float64 step's own rounding), but not blamed on the
    # loss either: the message names bf16 arithmetic as what the residual looks like and
    # gives the flag that judges it there (issue: the precision a step really computes in).
    assert "the step's arithmetic looks bf16" in d.explanation
    assert "--precision bfloat16" in d.fix
    assert "The loss, the model or the params differ" not in d.explanation
    asked = diagnose(fixture, 2, 2, grads, "token_mean", precision="bfloat16")
    assert not asked.detected and asked.precision == "bfloat16"


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_a_1001x_rank_skew_is_detected_and_named_at_float32_and_float64(dtype):
    fixture = builtin_fixture("ragged")
    for R, M in ((2, 1), (2, 2), (4, 1)):
        weights = _intended(fixture, R, M) * np.where(_rank_share(fixture, R, 0), 1.001, 1.0)
        grads = _rounded(_grad(fixture, weights), dtype)
        d = diagnose(fixture, R, M, grads, "token_mean", dtype=dtype)
        where = f"R={R} M={M}: {d.explanation}"
        assert d.detected and d.precision == dtype, where
        assert d.best_match == "rank-skew", where
        assert "rank 0: 1.001" in d.notes["rank-skew"], where


def test_what_bf16_can_detect():
    """bf16 rounding hides a 1.001x skew; a 1.05x one is detected and named."""
    fixture = builtin_fixture("ragged")
    base = _intended(fixture, 2, 1)
    for skew, detected in ((1.001, False), (1.05, True)):
        weights = base * np.where(_rank_share(fixture, 2, 0), skew, 1.0)
        grads = _rounded(_grad(fixture, weights), "bfloat16")
        d = diagnose(fixture, 2, 1, grads, "token_mean", dtype="bfloat16")
        assert d.precision == "bfloat16" and d.detected is detected, (skew, d.explanation)
        if detected:
            assert d.best_match == "rank-skew", d.explanation


#: The minimum detectable per-rank skew minus 1 on ragged at (2, 1), as the README documents
#: it: the level's tolerance plus 2 Z_SCORE standard errors of the noisiest rank's recovered
#: weight. The noise term is ~1e-15 (float64), ~1e-8 (float32) and ~2e-3 (bf16) here: the
#: ranges hold the documented figures and no tolerance off by a factor of 2.
DOCUMENTED_MINIMUM = {
    "float64": (1.0e-12, 1.01e-12),
    "float32": (1.0e-5, 1.05e-5),
    "bfloat16": (2.0e-2, 2.6e-2),
}


@pytest.mark.parametrize("dtype", list(DOCUMENTED_MINIMUM))
def test_minimum_detectable_skew_is_pinned(dtype):
    fixture = builtin_fixture("ragged")
    grads = _rounded(loss_and_grad(fixture, "token_mean", 2, 1).grads, dtype)
    d = diagnose(fixture, 2, 1, grads, "token_mean", dtype=dtype, precision=dtype)
    per, minus_one = d.detectable_skew
    low, high = DOCUMENTED_MINIMUM[dtype]
    assert per == "rank" and low <= minus_one <= high, minus_one
    # Either rank scaled by just over the reported minimum is flagged (for sure: the figure
    # allows for the noise); the float64 gradient carries the skew exactly, so there, just
    # under it passes.
    for rank in (0, 1):
        for factor, flagged in ((1.1, True), (0.9, False)):
            if not flagged and dtype != "float64":
                continue
            skew = 1 + factor * minus_one
            share = _rank_share(fixture, 2, rank)
            weights = _intended(fixture, 2, 1) * np.where(share, skew, 1.0)
            skewed_grads = _rounded(_grad(fixture, weights), dtype)
            skewed = diagnose(
                fixture, 2, 1, skewed_grads, "token_mean", dtype=dtype, precision=dtype
            )
            assert skewed.detected is flagged, (rank, factor, skewed.worst_unit)


def test_an_automatic_verdict_guarantees_its_coarsest_level():
    """Under "auto" a float64 step may agree at float32-level, so what it guarantees to flag
    is float32's: the report says so rather than float64's 1e-12."""
    fixture = builtin_fixture("ragged")
    grads = loss_and_grad(fixture, "token_mean", 2, 1).grads
    d = diagnose(fixture, 2, 1, grads, "token_mean")
    assert d.precision == "float64" and not d.detected
    low, high = DOCUMENTED_MINIMUM["float32"]
    assert low <= d.detectable_skew[1] <= high
    # A float64 step whose 1/D was rounded to float32 agrees at float32-level.
    rounded = _intended(fixture, 2, 1) * float(np.float32(1 / 549)) * 549
    d = diagnose(fixture, 2, 1, _grad(fixture, rounded), "token_mean")
    assert not d.detected and d.precision == "float32", d.explanation


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_bugs_are_named_at_their_precision(dtype):
    """rank-mean at R = 2, M = 2 (a mistake of R M for R would show here), microbatch-mean,
    missing-world-size with its logged D, double-accum-divide at R != M."""
    fixture = builtin_fixture("ragged")
    R, M = 2, 2
    token = get_scheme("token_mean")
    batch = fixture.layout(R, M)
    counts = batch.valid.sum(axis=(2, 3))  # [R, M]
    valid = batch.valid.astype(float)
    rank_mean = batch.to_global(valid / (R * counts.sum(1)[:, None, None, None]))
    microbatch_mean = batch.to_global(valid / (R * M * counts[:, :, None, None]))
    D = token.global_denominator(batch)
    cases = [
        (rank_mean, "rank-mean", None, (R, M)),
        (microbatch_mean, "microbatch-mean", None, (R, M)),
        # At R = M it would be double-accum-divide's 1/M too: (4, 2) sets them apart.
        (_intended(fixture, 4, 2) / 4, "missing-world-size", D, (4, 2)),
    ]
    for weights, name, logged, (r, m) in cases:
        grads = _rounded(_grad(fixture, weights), dtype)
        d = diagnose(fixture, r, m, grads, "token_mean", dtype=dtype, logged_denominator=logged)
        assert d.detected and d.best_match == name, (name, d.matches, d.explanation)
        # No framework given: both frameworks' sections that show the right loop.
        assert d.precision == dtype and d.fix.endswith(f"({guide([name], None)})")
        assert "docs/torch.md#" in d.fix and "docs/jax.md#" in d.fix
    divided = _grad(fixture, _intended(fixture, 2, 4) / 4)
    d = diagnose(fixture, 2, 4, _rounded(divided, dtype), "token_mean", dtype=dtype)
    assert d.best_match == "double-accum-divide", d.explanation


def test_one_layout_where_r_equals_m_names_nothing_but_the_run_does():
    """A 1/M bug at R = M = 2 is missing-world-size's 1/R too: ambiguous there; over the
    default layouts only double-accum-divide explains every case."""
    fixture = builtin_fixture("ragged")
    fits = []
    for R, M in LAYOUTS:
        grads = _grad(fixture, _intended(fixture, R, M) / M)
        d = diagnose(fixture, R, M, grads, "token_mean")
        if (R, M) == (2, 2):
            assert d.best_match == AMBIGUOUS
            assert {"double-accum-divide", "missing-world-size"} <= set(d.matches)
        fits.append(d.fits)
    assert headline(fits, "token_mean") == ["double-accum-divide"]


def test_missing_world_size_needs_its_log_over_a_whole_run():
    fixture = builtin_fixture("packed")
    D = float(fixture.valid.sum())
    fits, logged_fits = [], []
    for R, M in ((2, 1), (2, 2), (4, 1), (2, 4)):
        grads = _grad(fixture, _intended(fixture, R, M) / R)
        fits.append(diagnose(fixture, R, M, grads, "token_mean").fits)
        logged = diagnose(fixture, R, M, grads, "token_mean", logged_denominator=D)
        logged_fits.append(logged.fits)
    assert set(headline(fits, "token_mean")) == {"missing-world-size", "double-reduce-count"}
    assert headline(logged_fits, "token_mean") == ["missing-world-size"]


def test_a_plain_scale_is_never_named_a_reweighting_where_it_cannot_show():
    """empty-rank's second half has no valid target. A global 1/2 there is exactly rank-mean
    at (2, 1) (one rank holds every token) and microbatch-mean at (1, 2): those cases are
    ambiguous, never a confident reweighting, and the run names the scale."""
    fixture = builtin_fixture("empty-rank")
    fits = []
    for R, M in ((4, 1), (1, 2), (2, 1), (2, 2)):
        grads = _grad(fixture, _intended(fixture, R, M) * 0.5)
        d = diagnose(fixture, R, M, grads, "token_mean")
        if (R, M) == (2, 1):
            assert d.best_match == AMBIGUOUS and "rank-mean" in d.matches, d.matches
            assert "missing-world-size" in d.matches
        if (R, M) == (1, 2):
            assert d.best_match == AMBIGUOUS, d.matches
            assert {"microbatch-mean", "double-accum-divide"} <= set(d.matches)
        if (R, M) == (4, 1):  # ranks 0 and 1 hold 49 and 30 tokens: rank-mean would show
            assert d.best_match == "scale", d.explanation
        fits.append(d.fits)
    assert headline(fits, "token_mean") == ["scale"]


def test_a_global_factor_no_pattern_predicts_is_the_scale_family():
    fixture = builtin_fixture("empty-rank")
    grads = _grad(fixture, _intended(fixture, 4, 2) * 0.3)
    d = diagnose(fixture, 4, 2, grads, "token_mean")
    assert d.best_match == "scale" and "0.3x the intended one" in d.explanation
    assert "look for a factor on the loss" in d.fix


def test_a_logged_denominator_breaks_ties_but_never_outranks_the_gradient():
    """An exact rank-mean gradient from a loop that logs the global D (as HF's Trainer does)
    is still rank-mean: the log agrees with no fitting pattern, so it is set aside, said so."""
    fixture = builtin_fixture("ragged")
    batch = fixture.layout(2, 2)
    valid = batch.valid.astype(float)
    counts = batch.valid.sum(axis=(1, 2, 3))
    rank_mean = batch.to_global(valid / (2 * counts[:, None, None, None]))
    D = float(fixture.valid.sum())
    d = diagnose(fixture, 2, 2, _grad(fixture, rank_mean), "token_mean", logged_denominator=D)
    assert d.best_match == "rank-mean", d.explanation
    assert "named from the gradient alone" in d.notes["logged denominator"]


def test_no_family_names_a_gradient_that_is_no_reweighting():
    fixture = builtin_fixture("ragged")
    grads = loss_and_grad(fixture, "token_mean", 2, 1).grads
    for factor in (0.0, -1.0):  # nothing at all; the gradient pointing the other way
        d = diagnose(fixture, 2, 1, {k: factor * v for k, v in grads.items()}, "token_mean")
        assert d.detected and d.best_match == "unknown", (factor, d.best_match)


def test_more_groups_than_parameters_is_not_a_false_alarm():
    """K > P: the groups cannot all be told apart and no dimension is left to see noise in;
    a correct gradient must still pass (the worst-leaf test decides) and be flagged as not
    identifiable."""
    from crosscheck.fixtures.builtin import random_fixture

    fixture = random_fixture(2, 16, 8, vocab_size=4, hidden_size=2)
    grads = loss_and_grad(fixture, "token_mean", 2, 2).grads
    d = diagnose(fixture, 2, 2, grads, "token_mean")
    assert not d.detected and d.best_match == "token_mean", d.explanation
    assert not d.well_posed


def test_minimal_prefers_patterns_and_the_smallest_family():
    assert minimal(["rank-mean", "rank-skew", "microbatch-skew"], "token_mean") == ["rank-mean"]
    assert minimal(["missing-world-size", "scale", "rank-skew"], "token_mean") == [
        "missing-world-size"
    ]
    assert minimal(["packed-as-one", "row_mean"], "sequence_mean") == ["packed-as-one"]
    assert minimal(["scale", "rank-skew", "microbatch-skew"], "token_mean") == ["scale"]
    assert set(minimal(["rank-mean", "scale"], "token_mean")) == {"rank-mean", "scale"}
    assert minimal(["token_mean", "rank-mean"], "token_mean") == ["token_mean"]


def test_weight_ratio_is_against_the_intended_scheme():
    fixture = builtin_fixture("packed")
    d = diagnose(fixture, 2, 1, loss_and_grad(fixture, "row_mean", 2, 1).grads, "row_mean")
    # The intended weights themselves spread (rows of 17 to 43 valid tokens)...
    assert abs(d.intended_weight_ratio - 43 / 17) <= 1e-9
    # ...but a correct step's weights are those: ratio 1, to float64 rounding of the fit.
    assert abs(d.weight_ratio - 1) <= 1e-9


def test_an_explicit_constant_normalizer_is_judged_with_that_c():
    fixture = builtin_fixture("packed")
    C = 1000.0
    grads = _grad(fixture, fixture.valid / C)
    d = diagnose(fixture, 2, 2, grads, Constant(C))
    assert not d.detected and d.scheme.denominator.value == C
    assert "constant:1000's" in d.explanation
    same = diagnose(fixture, 2, 2, grads, "constant:1000")
    assert not same.detected
    # The default constant counts every slot, N T = 512 here: C = 1000 is a scale away.
    slots = diagnose(fixture, 2, 2, grads, "constant")
    assert slots.detected and slots.best_match == "scale"
    # 1e-12: the scale of a float64 gradient is exact to rounding.
    assert abs(slots.scale - fixture.targets.size / C) <= 1e-12


def test_z_score_is_the_documented_one():
    # The weight test's z: its value is part of the documented minimum detectable skew.
    assert Z_SCORE == 6.0


def _anchors(document: Path) -> set[str]:
    """GitHub's heading slugs of a markdown file (as tests/test_docs_links.py reads them)."""
    from test_docs_links import anchors

    return set(anchors(document))


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_every_fix_points_to_an_existing_section_of_its_frameworks_docs(framework):
    """Each pattern's and family's fix, in each framework, ends at a doc section that exists and
    is that framework's; JAX's double-world-size names the shard_map cause, not a trainer."""
    root = Path(__file__).resolve().parents[1]
    for name in [*PATTERNS, *FAMILY_FIXES]:
        (section,) = guide([name], framework).split("; ")
        path, _, anchor = section.partition("#")
        assert path == f"docs/{framework}.md", (name, section)
        assert anchor in _anchors(root / path), (name, section)
        assert fix_text(name, framework), name
    jax_double = fix_text("double-world-size", "jax")
    assert "shard_map" in jax_double and "trainer setting" not in jax_double


def test_a_jax_diagnosis_gives_the_jax_fix_and_the_jax_docs():
    fixture = builtin_fixture("packed")
    R, M = 2, 1
    weights = _intended(fixture, R, M) * R  # the update R times too large
    d = diagnose(fixture, R, M, _grad(fixture, weights), "token_mean", framework="jax")
    assert d.best_match == "double-world-size", d.explanation
    assert d.fix == (
        f"{PATTERNS['double-world-size'].jax_fix} "
        "(docs/jax.md#precount-in-your-own-data-parallel-step-the-reduction-factor-s)"
    )
    torch = diagnose(fixture, R, M, _grad(fixture, weights), "token_mean", framework="torch")
    assert torch.fix.endswith("(docs/torch.md#why-s--r)") and "trainer setting" in torch.fix
