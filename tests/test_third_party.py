"""`crosscheck verify` on steps built from real third-party code, computing in float32.

``examples/torch_hf_loss.py`` uses Hugging Face's ``ForCausalLMLoss`` (which upcasts the
logits with ``logits.float()``) and ``examples/jax_optax_float32.py`` uses ``optax.MultiSteps``
with its default float32 accumulator. Each has one correct step and four buggy ones. All ten
must be judged at float32-level: the correct ones pass, the buggy ones fail under the one name
that explains every case, with its fix.

Every step runs on verify's default fixtures and layouts (``packed`` and ``ragged`` at (R, M)
= (2, 1), (1, 2), (2, 2), (4, 1), (2, 4)): (2, 1) shows rank-mean without microbatches, (1, 2)
microbatches without ranks, and at (2, 4) and (4, 1) an extra 1/M is not an extra 1/R, so the
four names are separated. The ten runs take about 50 s on two idle cores.
"""

from __future__ import annotations

import pytest

from crosscheck.diagnosis.explain import fix_text, guide
from crosscheck.fixtures.builtin import builtin_fixture
from crosscheck.verification.verifier import jobs_for, verify

#: float32-level tolerance (crosscheck.diagnosis.verdict): a float32 step's worst-leaf error must
#: stay below it. The measured errors are 2e-8 to 9e-8 (one rounding of float32 logits or of the
#: float32 accumulator), so 1e-5 leaves two orders of magnitude.
FLOAT32_TOLERANCE = 1e-5
#: A 1.001x skew of one rank's token weights must be flagged: the run's detectable skew
#: (tolerance plus six standard errors of the measured noise, about 1.0e-5 here) is below it.
SKEW = 1e-3
#: Under the strict float64 judgement a float32 step must fail by its rounding alone: more
#: than float64 arithmetic could explain (the float64 steps' errors are below 1e-15, the
#: strict tolerance 1e-12; 1e-9 is far above both) and less than a weighting error
#: (below the float32 tolerance).
ROUNDING_ONLY = (1e-9, FLOAT32_TOLERANCE)

#: (framework, step) -> the name verify must give: token_mean for a correct step.
STEPS = {
    ("torch", "examples.torch_hf_loss:step"): "token_mean",
    ("torch", "examples.torch_hf_loss:step_microbatch_mean"): "microbatch-mean",
    ("torch", "examples.torch_hf_loss:step_rank_count"): "rank-mean",
    ("torch", "examples.torch_hf_loss:step_extra_accum_divide"): "double-accum-divide",
    ("torch", "examples.torch_hf_loss:step_averaged_grads"): "missing-world-size",
    ("jax", "examples.jax_optax_float32:step"): "token_mean",
    ("jax", "examples.jax_optax_float32:step_microbatch_mean"): "microbatch-mean",
    ("jax", "examples.jax_optax_float32:step_rank_count"): "rank-mean",
    ("jax", "examples.jax_optax_float32:step_extra_accum_divide"): "double-accum-divide",
    ("jax", "examples.jax_optax_float32:step_averaged_grads"): "missing-world-size",
}
CORRECT = [key for key, name in STEPS.items() if name == "token_mean"]


def expected_level(framework: str, accum_steps: int) -> str:
    """The level one case is judged at. HF's loss is float32 at every layout; MultiSteps adds
    each micro-step's float64 gradient to its float32 running sum in float64 and emits that,
    so at M = 1 nothing is rounded to float32 and the case is float64-exact."""
    return "float64" if framework == "jax" and accum_steps == 1 else "float32"


@pytest.mark.parametrize(("framework", "step"), list(STEPS), ids=[s for _, s in STEPS])
def test_verify_names_the_step_at_float32_level(framework, step):
    named = STEPS[(framework, step)]
    report = verify(step, framework=framework, scheme="token_mean")
    message = report.message()
    assert len(report.cases) == len(jobs_for(None, None, None))  # the default matrix
    assert not [case.error for case in report.cases if case.error], message
    assert report.ok is (named == "token_mean"), message
    assert report.best_match == named, message
    assert report.level == "float32", message
    for case in report.cases:
        assert case.diagnosis is not None
        assert case.diagnosis.precision == expected_level(framework, case.job.accum_steps)
    if named == "token_mean":
        # NaN fails both comparisons.
        assert report.max_rel_err < FLOAT32_TOLERANCE, message
        skew = report.detectable_skew
        assert skew is not None and skew[0] == "rank", message
        assert skew[1] < SKEW, message
        assert "matches token_mean" in message and "float32-level" in message
    else:
        assert f"Explains every case: {named}." in message
        # Said in the step's framework's terms, ending at that framework's docs.
        assert f"Fix: {fix_text(named, framework)} ({guide([named], framework)})" in message
    if named == "missing-world-size":
        # It logged the global count D (double-reduce-count, the same gradient, logs R D).
        for case in report.cases:
            D = int(builtin_fixture(case.job.fixture).valid.sum())
            assert case.logged_denominator == D, case.job.describe()
        assert "double-reduce-count" not in report.explanations


@pytest.mark.parametrize(("framework", "step"), CORRECT, ids=[s for _, s in CORRECT])
def test_the_strict_float64_judgement_fails_a_float32_step(framework, step):
    """float32 arithmetic is not float64-exact: precision="float64" rejects the correct steps
    by rounding alone (one layout with M > 1, where the JAX step rounds too)."""
    report = verify(
        step,
        framework=framework,
        scheme="token_mean",
        fixtures=["packed"],
        world_sizes=[2],
        accum_steps=[4],
        precision="float64",
    )
    message = report.message()
    assert not [case.error for case in report.cases if case.error], message
    assert not report.ok, message
    assert report.level == "float64"
    assert "does NOT match token_mean" in message and "float64-exact" in message
    low, high = ROUNDING_ONLY
    assert low < report.max_rel_err < high, message
