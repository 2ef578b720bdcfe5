"""``verify --objective``: a user's multi-term step judged per term, in both frameworks.

The steps are ``examples/torch_objective.py`` and ``examples/jax_objective.py``, user code in
plain torch / JAX that imports neither torch_impl, jax_impl nor crosscheck's math; the
objectives they mean are ``examples/objectives.py``. Every step runs in real processes: gloo
ranks for torch, the JAX verify worker with R of its 8 CPU devices.

Layouts: the correct MOE steps run on ``packed`` and ``rollouts`` (uneven rows per rank, a
fully masked row) at (R, M) = (2, 2), where a local count of any term differs from the
update's. Each bug runs on ``packed`` at (R, M) = (2, 2), where every pattern shows (R M
> 1 for a scope, R > 1 for the world-size factor, R M != R, counts that differ for mtp); the
world-size factor runs at (1, 2) too, where it coincides with the intended objective, so the
run's name must come from the case that shows it and stay consistent with the one that does
not.
``rollouts`` cannot show shifted-aux-count (its mtp mask holds as many tokens as the main
mask, 171 and 171), which is why the bugs run on ``packed`` (231 and 204).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest
from child_env import ROOT, run_cli

from crosscheck.contract.objective_terms import FROZEN_PARAMS, TRAINED_PARAMS
from crosscheck.verification.objective_verify import (
    ObjectiveReport,
    judge_objective,
    resolve_objective,
)
from crosscheck.verification.protocol import VerifyJob, VerifyOutput
from crosscheck.verification.verifier import DEFAULT_LAYOUTS, verify

STEPS = {"torch": "examples.torch_objective", "jax": "examples.jax_objective"}
OBJECTIVES = "examples.objectives"
BUG_LAYOUTS = {"fixtures": ["packed"], "world_sizes": [1, 2], "accum_steps": [2]}
#: One layout where every pattern shows (R M > 1, R > 1, R != R M): one launch per run.
ONE_LAYOUT = {"fixtures": ["packed"], "world_sizes": [2], "accum_steps": [2]}
#: (step, objective, the name that explains every case): one auxiliary term wrong each.
BUGS = [
    ("step_z_loss_per_microbatch", "MOE", "sibling-term-scope(z_loss)"),
    ("step_mtp_main_count", "MTP", "shifted-aux-count(mtp)"),
    ("step_aux_world_size", "MOE", "aux-world-size-factor(moe_lb)"),
    ("step_local_router_stats", "MOE", "aux-global-count-local-stats(moe_lb)"),
    ("step_z_loss_coefficient_twice", "MOE", "aux-coefficient-twice(z_loss)"),
    ("step_entropy_summed", "ENTROPY_BONUS", "aux-summed-over-microbatches(entropy)"),
]
#: float64 arithmetic in both frameworks' steps: measured 3.3e-15 at worst; 1e-12 is the
#: contract's float64 tolerance.
FLOAT64_TOLERANCE = 1e-12


def _cli(framework: str, step: str, objective: str, *extra: str) -> subprocess.CompletedProcess:
    argv = ["verify", "--framework", framework, "--step", f"{STEPS[framework]}:{step}"]
    return run_cli(*argv, "--objective", objective, *extra, cwd=ROOT, timeout=300)


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_a_correct_moe_step_passes_every_term(framework, tmp_path):
    """ce + z_loss + global-batch moe_lb, each over the whole update: the CLI passes it on
    both fixtures at every default layout at float64-exact, and the JSON says so term by term
    (packed at R = 2, M = 4 was once a false alarm: its small moe_lb units' rounding)."""
    out = tmp_path / "report.json"
    layout = ["--fixtures", "packed,rollouts"]
    result = _cli(framework, "step", f"{OBJECTIVES}:MOE", *layout, "--json", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "matches the objective examples.objectives:MOE (ce + 0.01 z_loss + 0.01 moe_lb)" in (
        " ".join(result.stdout.split())
    )
    report = json.loads(out.read_text())
    assert report["ok"] and report["precision"] == "float64"
    assert report["diagnosis"]["best_match"] == "intended"
    assert len(report["cases"]) == 2 * len(DEFAULT_LAYOUTS)
    for case in report["cases"]:
        assert case["diagnosed_as"] == "intended"
        assert 0 <= case["max_rel_err"] <= FLOAT64_TOLERANCE
        assert [t["term"] for t in case["terms"]] == ["ce", "z_loss", "moe_lb"]
        assert all(t["as_intended"] and not t["patterns"] for t in case["terms"])


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_an_intended_per_microbatch_entropy_bonus_passes(framework):
    """The entropy bonus is *meant* per microbatch: a step that averages it so passes, its
    term reported at microbatch scope."""
    report = verify(
        f"{STEPS[framework]}:step_entropy_bonus",
        framework=framework,
        objective=f"{OBJECTIVES}:ENTROPY_BONUS",
        **BUG_LAYOUTS,
    )
    assert report.ok, report.message()
    assert report.level == "float64" and len(report.cases) == 2
    entropy = report.described.term_verdicts(report.objective)[1]
    assert entropy["term"] == "entropy" and entropy["scope"] == "microbatch"
    assert entropy["as_intended"]


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize(("step", "objective", "named"), BUGS, ids=[b[0] for b in BUGS])
def test_each_multi_term_pattern_is_named_with_its_term(framework, step, objective, named):
    """A step with one auxiliary term wrong fails, named by the pattern and the term it hits;
    every other term is reported as intended, and the fix speaks of that term."""
    report = verify(
        f"{STEPS[framework]}:{step}",
        framework=framework,
        objective=f"{OBJECTIVES}:{objective}",
        **ONE_LAYOUT,
    )
    assert not report.ok
    assert report.best_match == named, report.message()
    pattern, term = named[:-1].split("(")
    # Judged at float64 even where the term's form changed (local routing statistics).
    assert report.level == "float64"
    message = report.message()
    assert f"Explains every case: {named}" in message
    case = report.described
    assert (case.job.world_size, case.job.accum_steps) == (2, 2)
    for verdict in case.term_verdicts(report.objective):
        if verdict["term"] == term:
            assert verdict["patterns"] == [pattern] and not verdict["as_intended"]
        else:
            assert verdict["as_intended"], message
    assert term in report.fix()


def test_the_world_size_factor_is_reported_with_its_scale():
    """aux-world-size-factor is a scale of its term: R = 2 on the case the report details."""
    report = verify(
        f"{STEPS['torch']}:step_aux_world_size",
        framework="torch",
        objective=f"{OBJECTIVES}:MOE",
        **BUG_LAYOUTS,
    )
    verdicts = {v["term"]: v for v in report.described.term_verdicts(report.objective)}
    assert verdicts["moe_lb"]["scale"] == pytest.approx(2.0, rel=1e-12)
    assert verdicts["ce"]["scale"] == pytest.approx(1.0, rel=1e-12)
    # At R = 1 the factor is 1: that case fits the intended objective and is consistent.
    one = next(c for c in report.cases if c.job.world_size == 1)
    assert one.ok and "aux-world-size-factor(moe_lb)" in one.consistent


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_a_float32_step_is_judged_at_float32_level(framework):
    """The same correct step handed float32 params passes at float32-level, and a float32
    bug is still named at that level: the float64 judgement is no false alarm on float32."""
    good = verify(
        f"{STEPS[framework]}:step",
        framework=framework,
        objective=f"{OBJECTIVES}:MOE",
        dtype="float32",
        **ONE_LAYOUT,
    )
    assert good.ok and good.level == "float32", good.message()
    assert "at float32-level" in good.message()
    bad = verify(
        f"{STEPS[framework]}:step_z_loss_coefficient_twice",
        framework=framework,
        objective=f"{OBJECTIVES}:MOE",
        dtype="float32",
        **ONE_LAYOUT,
    )
    assert bad.best_match == "aux-coefficient-twice(z_loss)" and bad.level == "float32"


def test_bf16_arithmetic_under_autocast_is_said_and_no_pattern_is_blamed(tmp_path):
    """A correct step computing under bf16 autocast with float32 params: its residual is
    bf16-sized. It fails (objectives are judged at float64 and float32 only), and the report
    says its arithmetic looks bf16 instead of offering a fix for the loss."""
    (tmp_path / "autocast_step.py").write_text(
        "import torch\n"
        "from examples import torch_objective\n\n\n"
        "def step(model, microbatches):\n"
        '    with torch.autocast("cpu", dtype=torch.bfloat16):\n'
        "        torch_objective.step(model, microbatches)\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        report = verify(
            "autocast_step:step",
            framework="torch",
            objective=f"{OBJECTIVES}:MOE",
            dtype="float32",
            fixtures=["packed"],
            world_sizes=[2],
            accum_steps=[2],
        )
    finally:
        sys.path.remove(str(tmp_path))
    assert not report.ok
    message = report.message()
    assert "arithmetic looks bf16" in message and "Fix:" not in message


def test_set_up_errors_are_refused_before_any_process():
    """bf16, both or neither of scheme and objective, an unknown objective, a bad term: each
    a ValueError naming why, before a rank starts."""
    step = f"{STEPS['torch']}:step"
    objective = f"{OBJECTIVES}:MOE"
    with pytest.raises(ValueError, match="judged at float64 and float32 levels only"):
        verify(step, framework="torch", objective=objective, dtype="bfloat16")
    with pytest.raises(ValueError, match="one of the two"):
        verify(step, framework="torch", objective=objective, scheme="token_mean")
    with pytest.raises(ValueError, match="one of the two"):
        verify(step, framework="torch")
    with pytest.raises(ValueError, match="not one of aux, aux-local"):
        verify(step, framework="torch", objective="auxx")
    with pytest.raises(ValueError, match="has no 'NOPE'"):
        verify(step, framework="torch", objective=f"{OBJECTIVES}:NOPE")
    with pytest.raises(ValueError, match=r"term .z_loss.: coefficient"):
        verify(step, framework="torch", objective=[{"kind": "z_loss", "coefficient": "big"}])


def test_the_cli_refuses_scheme_with_objective_and_plot_with_objective(tmp_path):
    both = _cli("torch", "step", f"{OBJECTIVES}:MOE", "--scheme", "token_mean")
    assert both.returncode == 2 and "not allowed with argument" in both.stderr
    plot = _cli("torch", "step", f"{OBJECTIVES}:MOE", "--plot", str(tmp_path / "p.png"))
    assert plot.returncode == 2 and "--plot draws one scheme" in plot.stderr
    assert plot.stdout == ""


def test_the_step_gets_the_params_its_terms_read():
    """embed always; unembed for the logit terms; mtp_unembed, router and the frozen
    reference only where a term reads them, in the oracle's order."""
    assert resolve_objective(f"{OBJECTIVES}:MOE").param_names == ("embed", "unembed", "router")
    assert resolve_objective(f"{OBJECTIVES}:MTP").param_names == (
        "embed",
        "unembed",
        "mtp_unembed",
    )
    assert resolve_objective("aux").param_names == (*TRAINED_PARAMS, *FROZEN_PARAMS)
    assert resolve_objective([{"kind": "mtp"}]).param_names == ("embed", "mtp_unembed")


def _oracle_output(job, objective, scale_term: str | None = None, factor: float = 1.0):
    """The oracle's own gradient for the job (or with one term's gradient scaled)."""
    from crosscheck.contract.objective import objective_loss_and_grad
    from crosscheck.fixtures.builtin import builtin_fixture
    from crosscheck.verification.objective_verify import objective_arrays

    params, _ = objective_arrays(job.fixture, objective.param_names)
    batch = builtin_fixture(job.fixture).layout(job.world_size, job.accum_steps)
    terms = [
        t.to_data() | ({"coefficient": t.coefficient * factor} if t.name == scale_term else {})
        for t in objective.terms
    ]
    return VerifyOutput(grads=objective_loss_and_grad(params, batch, terms).grads)


def test_the_judgement_of_one_case_from_the_oracles_own_gradients():
    """No process: the oracle's gradient is intended at float64; with z_loss's coefficient
    squared it is aux-coefficient-twice(z_loss); a bf16 gradient is a case not judged, and a
    run whose only diagnosed cases fit says "error", never a pattern."""
    objective = resolve_objective(f"{OBJECTIVES}:MOE")
    job = VerifyJob(fixture="packed", world_size=2, accum_steps=2)
    job = replace(job, objective_params=objective.param_names)
    good = judge_objective(job, objective, _oracle_output(job, objective))
    assert good.ok and good.level == "float64" and good.max_rel_err <= FLOAT64_TOLERANCE
    twice = judge_objective(job, objective, _oracle_output(job, objective, "z_loss", 0.01))
    assert not twice.ok and twice.diagnosis.best_match == "aux-coefficient-twice(z_loss)"
    bf16 = replace(_oracle_output(job, objective), returned_dtype="bfloat16")
    refused = judge_objective(job, objective, bf16)
    assert refused.diagnosis is None and "float64 and float32 levels only" in refused.error
    report = ObjectiveReport(framework="torch", step="m:step", objective=objective)
    mixed = replace(report, cases=[good, refused])
    assert mixed.best_match == "error" and not mixed.ok
    assert "could not run 1 of its 2 fixture/layout cases" in mixed.message()
    assert " - " not in mixed.headline() and "inf" not in mixed.headline()
    named = replace(report, cases=[good, twice])
    assert named.best_match == "unknown"  # one case fits, the other does not: no one name
