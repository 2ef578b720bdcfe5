"""``verify --model --objective``: a user's own model that adds its own router loss.

A tiny Hugging Face Mixtral with its router load-balancing loss on (``examples/torch_hf_moe.py``,
built from a config, no download; its experts through ``grouped_mm``, so its reference and the
step run in float32) in the two arrangements real trainers give its loss, and a small Flax MoE
whose ``apply`` returns ``(logits, aux_loss)`` (``examples/jax_flax_moe.py``). The objective is
the cross-entropy's token mean over the update plus the router loss's mean over the update's
R M forwards; the reference is the model's own per-term, per-microbatch gradients
(``crosscheck.verification.objective_model``).

Layouts: the Trainer's loop runs at verify's five default layouts (on ``packed``), since its
name must hold on every layout, with its scale R M on each; the SFTTrainer arrangement at
(R, M) = (1, 2) and (2, 2), the Flax step at (2, 2), where the per-forward mean, the
world-size factor and the sum over forwards all differ.
"""

from __future__ import annotations

import pytest

from crosscheck.verification.verifier import verify

BUG_LAYOUTS = {"fixtures": ["packed"], "world_sizes": [1, 2], "accum_steps": [2]}
#: R M > 1 with R != R M: the three scales of a per-forward term (R, λ, R M) all differ.
ONE_LAYOUT = {"fixtures": ["packed"], "world_sizes": [2], "accum_steps": [2]}
#: float64 arithmetic in the Flax step: measured 1.5e-15; the contract's float64 tolerance.
FLOAT64_TOLERANCE = 1e-12


HF_MOE = "examples.torch_hf_moe"
#: float32-level: the Mixtral's experts run through grouped_mm, which refuses float64, so its
#: reference and the step run in float32; measured worst relative error 6.5e-07.
FLOAT32_TOLERANCE = 1e-5


def test_a_hf_moe_model_through_its_own_loss_passes_with_its_aux_term_per_forward():
    """TRL's SFTTrainer arrangement (the router loss / M, after the x R): the Mixtral's own
    cross-entropy and router loss, as the objective means them, at float32-level, and the
    report says why not float64."""
    report = verify(
        f"{HF_MOE}:step_sft",
        framework="torch",
        objective=f"{HF_MOE}:OBJECTIVE",
        model=f"{HF_MOE}:model",
        **BUG_LAYOUTS,
    )
    assert report.ok, report.message()
    assert report.level == "float32" and len(report.cases) == 2
    assert report.model_dtype == "float32"
    assert "refuses float64 (Expected mat_a to be Float32" in report.message()
    assert all(case.max_rel_err <= FLOAT32_TOLERANCE for case in report.cases)


def test_the_trainer_summing_a_moe_models_aux_term_over_microbatches_is_named():
    """transformers' Trainer: the router loss rides the x R and is never divided by M. Named
    aux-summed-over-microbatches(moe_lb) over every case, the cross-entropy as intended, and
    the router loss's scale R M on every layout (at M = 1 the case alone cannot tell it from
    the world-size factor: ambiguous there, named by the others)."""
    report = verify(
        f"{HF_MOE}:step_trainer",
        framework="torch",
        objective=f"{HF_MOE}:OBJECTIVE",
        model=f"{HF_MOE}:model",
        fixtures=["packed"],
    )
    assert report.best_match == "aux-summed-over-microbatches(moe_lb)", report.message()
    for case in report.cases:
        R, M = case.job.world_size, case.job.accum_steps
        scales = case.diagnosis.term_scales
        # float32-level: the fitted scales carry the step's float32 rounding.
        assert scales["moe_lb"] == pytest.approx(R * M, rel=FLOAT32_TOLERANCE)
        assert scales["ce"] == pytest.approx(1.0, rel=FLOAT32_TOLERANCE)
        expected = "ambiguous" if M == 1 else "aux-summed-over-microbatches(moe_lb)"
        assert case.diagnosis.best_match == expected
    message = report.message()
    assert "Scale of moe_lb on each layout: R=1,M=2: 2; R=2,M=1: 2; R=2,M=2: 4;" in message
    assert "Fix: add moe_lb after the main loss's x R and divide it by the M" in message


def test_what_a_users_model_cannot_state_is_refused_up_front():
    """With --model: global-batch balancing (the model's loss is one forward's) and other
    kinds than ce and the model's router loss, each refused before the step runs."""
    step, model = f"{HF_MOE}:step_sft", f"{HF_MOE}:model"
    update = [{"kind": "ce"}, {"kind": "moe_lb", "top_k": 2, "scope": "update"}]
    with pytest.raises(ValueError, match="its scope is microbatch"):
        verify(step, framework="torch", objective=update, model=model)
    with pytest.raises(ValueError, match="cross-entropy first"):
        verify(step, framework="torch", objective=[{"kind": "ce"}, {"kind": "z_loss"}], model=model)


FLAX_MOE = "examples.jax_flax_moe"


def test_a_flax_moe_model_with_its_own_aux_loss_passes_in_jax():
    """A Flax MoE whose apply returns (logits, aux_loss): the correct per-forward mean passes
    float64-exact. The model's attention key bias gets no gradient (softmax ignores it): its
    rounding is left out of the worst-leaf error, as for one scheme. (Its summed twin,
    ``step_aux_summed``, is named by the same columns as the torch Trainer's loop above; it is
    left to docs/verify.md's command, as each JAX model reference costs some 25 s here.)"""
    step, named = "step", "intended"
    report = verify(
        f"{FLAX_MOE}:{step}",
        framework="jax",
        objective=f"{FLAX_MOE}:OBJECTIVE",
        model=f"{FLAX_MOE}:model",
        **ONE_LAYOUT,
    )
    assert report.best_match == named, report.message()
    assert report.level == "float64"
    for case in report.cases:
        R, M = case.job.world_size, case.job.accum_steps
        factor = 1 if named == "intended" else R * M
        assert case.diagnosis.term_scales["moe_lb"] == pytest.approx(factor, rel=1e-12)
        if named == "intended":
            assert case.max_rel_err <= FLOAT64_TOLERANCE
