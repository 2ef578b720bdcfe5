"""`crosscheck verify` end to end on the things a precision-aware verdict adds: an explicit
constant normalizer, the logged-denominator hook, bf16 params, and the strict judgement.

Real processes (torch DDP on gloo, a JAX worker with 8 CPU devices); the steps are the
examples (repository root) and tests/verify_steps.py (run from tests/, as a user's module).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

from crosscheck.contract.schemes import Constant
from crosscheck.verification.verifier import verify

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
#: One layout with both ranks and microbatches, R != M, on both default fixtures' shapes.
ONE_LAYOUT = {"fixtures": ["packed"], "world_sizes": [2], "accum_steps": [4]}


def test_constant_is_judged_with_its_own_normalizer(tmp_path):
    with contextlib.chdir(TESTS):
        report = verify(
            "verify_steps:constant_normalizer",
            framework="torch",
            scheme=Constant(1000.0),
            **ONE_LAYOUT,
        )
        assert report.ok, report.message()
        assert report.scheme.denominator.value == 1000.0
        assert "constant:1000 on fixtures packed" in report.message()
        # The default constant counts every target slot (8 x 64 = 512): C = 1000 is a scale.
        slots = verify(
            "verify_steps:constant_normalizer", framework="torch", scheme="constant", **ONE_LAYOUT
        )
        assert not slots.ok and slots.best_match == "scale", slots.message()
    path = tmp_path / "constant.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "crosscheck",
            "verify",
            "--framework",
            "torch",
            "--step",
            "verify_steps:constant_normalizer",
            "--scheme",
            "constant:1000",
            "--fixtures",
            "packed",
            "--world-sizes",
            "2",
            "--accum-steps",
            "4",
            "--json",
            str(path),
        ],
        cwd=TESTS,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads(path.read_text())["scheme"] == "constant:1000"


def test_the_logged_denominator_names_what_the_gradient_cannot():
    layouts = {"fixtures": ["packed"], "world_sizes": [2, 4], "accum_steps": [1, 2]}
    with contextlib.chdir(TESTS):
        logged = verify(
            "verify_steps:averaged_grads_logged", framework="torch", scheme="token_mean", **layouts
        )
        unlogged = verify(
            "verify_steps:averaged_grads_unlogged",
            framework="torch",
            scheme="token_mean",
            **layouts,
        )
    assert logged.best_match == "missing-world-size", logged.message()
    assert all(case.logged_denominator == 231 for case in logged.cases)  # packed's valid tokens
    assert unlogged.best_match == "ambiguous", unlogged.message()
    assert set(unlogged.explanations) == {"missing-world-size", "double-reduce-count"}
    assert "crosscheck.log_denominator(D)" in unlogged.message()


def test_bf16_params_are_judged_at_bf16_level_in_both_frameworks():
    for framework, correct, buggy, named in (
        (
            "torch",
            "examples.torch_torchtitan:step",
            "examples.torch_nanogpt:step",
            "microbatch-mean",
        ),
        ("jax", "examples.jax_token_weighted:step", "examples.jax_pmap_mean:step", "rank-mean"),
    ):
        layouts = {"fixtures": ["ragged"], "world_sizes": [2], "accum_steps": [1, 4]}
        with contextlib.chdir(REPO):
            ok = verify(
                correct, framework=framework, scheme="token_mean", dtype="bfloat16", **layouts
            )
            bad = verify(
                buggy, framework=framework, scheme="token_mean", dtype="bfloat16", **layouts
            )
        assert ok.ok and ok.level == "bfloat16", ok.message()
        # bf16 arithmetic: errors of a few 1e-3, within the bf16 tolerance 2e-2 and above the
        # float32 one (else the step did not compute in bf16).
        assert 1e-5 < ok.max_rel_err <= 2e-2, ok.message()
        assert not bad.ok and bad.best_match == named, bad.message()


#: (framework, step module): the bf16 steps of tests/verify_steps.py and jax_verify_steps.py.
BF16_STEPS = (("torch", "verify_steps"), ("jax", "jax_verify_steps"))


def test_a_step_that_casts_itself_to_bf16_is_judged_at_bf16_level_without_a_flag():
    """The model (torch) or params (JAX) cast to bf16 by the step: the gradient comes back in
    bf16, and that is the level it is judged at under --precision auto. The correct step
    passes; its microbatch-mean twin is named, at the same level."""
    for framework, module in BF16_STEPS:
        with contextlib.chdir(TESTS):
            ok = verify(f"{module}:bf16_model" if framework == "torch" else f"{module}:bf16_params",
                        framework=framework, scheme="token_mean", **ONE_LAYOUT)  # fmt: skip
            twin = (
                "bf16_model_microbatch_mean"
                if framework == "torch"
                else ("bf16_params_microbatch_mean")
            )
            bad = verify(f"{module}:{twin}", framework=framework, scheme="token_mean", **ONE_LAYOUT)
        assert ok.ok and ok.level == "bfloat16", ok.message()
        # bf16 arithmetic: above the float32 tolerance, within bf16's (else the step did not
        # compute in bf16, and the test would show nothing).
        assert 1e-5 < ok.max_rel_err <= 2e-2, ok.message()
        assert not bad.ok and bad.best_match == "microbatch-mean", bad.message()
        assert bad.level == "bfloat16", bad.message()


def test_bf16_arithmetic_behind_a_finer_gradient_is_named_with_its_flag():
    """Autocast (torch, float32 params) and a bf16 cast inside a JAX loss (float64 params):
    the gradient comes back finer than the arithmetic. Under auto the step fails (a float32
    judgement cannot pass bf16 rounding), and the message says its arithmetic looks bf16 and
    gives the flag; never a fix that blames the loss. With the flag, it passes."""
    for framework, step, dtype in (
        ("torch", "verify_steps:autocast_bf16", "float32"),
        ("jax", "jax_verify_steps:bf16_compute", "float64"),
    ):
        with contextlib.chdir(TESTS):
            auto = verify(step, framework=framework, scheme="token_mean", dtype=dtype, **ONE_LAYOUT)
            flagged = verify(
                step, framework=framework, scheme="token_mean", dtype=dtype,
                precision="bfloat16", **ONE_LAYOUT,
            )  # fmt: skip
        message = auto.message()
        assert not auto.ok, message
        assert "the step's arithmetic looks bf16" in message, message
        assert "--precision bfloat16" in message, message
        assert "check that the step's loss" not in message, message
        assert flagged.ok and flagged.level == "bfloat16", flagged.message()


def test_strict_keeps_the_float64_judgement():
    with contextlib.chdir(REPO):
        report = verify(
            "examples.torch_torchtitan:step",
            framework="torch",
            scheme="token_mean",
            precision="float64",
            **ONE_LAYOUT,
        )
    assert report.ok and report.level == "float64", report.message()
    assert report.max_rel_err <= 1e-12  # the float64 tolerance: a handful of reductions


def test_a_case_that_could_not_run_is_never_named_as_a_weighting():
    """Nine cases match and one timed out: the run fails as an error, not as the intended
    scheme's 'bug', and it gives no fix."""
    from crosscheck.contract.oracle import loss_and_grad
    from crosscheck.contract.schemes import get_scheme
    from crosscheck.fixtures.builtin import builtin_fixture
    from crosscheck.verification.protocol import StepError, VerifyJob, VerifyOutput
    from crosscheck.verification.verifier import VerifyReport, judge

    scheme = get_scheme("token_mean")
    good = VerifyJob(fixture="packed", world_size=2, accum_steps=2)
    grads = loss_and_grad(builtin_fixture("packed"), "token_mean", 2, 2).grads
    hung = VerifyJob(fixture="ragged", world_size=2, accum_steps=2)
    report = VerifyReport(
        framework="torch",
        step="my:step",
        scheme=scheme,
        cases=[
            judge(good, scheme, VerifyOutput(grads)),
            judge(hung, scheme, StepError("ragged R=2 M=2: did not finish within 10 s")),
        ],
    )
    assert not report.ok and report.best_match == "error"
    assert report.fix() == "" and "Fix:" not in report.message()
    headline = report.message().splitlines()[0]
    assert headline.startswith(
        "my:step (torch) could not run 1 of its 2 fixture/layout cases (below); the 1 that ran "
        "match token_mean at float64-exact (worst relative error "
    ), headline
    assert report.to_json()["diagnosis"]["best_match"] == "error"


def _report(*outcomes):
    """A report of the given (job, output or StepError) pairs, judged as verify judges."""
    from crosscheck.contract.schemes import get_scheme
    from crosscheck.verification.verifier import VerifyReport, judge

    scheme = get_scheme("token_mean")
    cases = [judge(job, scheme, output) for job, output in outcomes]
    return VerifyReport(framework="jax", step="my:step", scheme=scheme, cases=cases)


def test_each_outcome_has_one_honest_headline_without_a_dash_or_inf():
    """verified / does NOT match / could not run: one sentence each, no '-' or 'inf' standing
    for a value the run does not have."""
    import math

    import numpy as np

    from crosscheck.contract.oracle import loss_and_grad
    from crosscheck.fixtures.builtin import builtin_fixture
    from crosscheck.verification.protocol import StepError, VerifyJob, VerifyOutput

    job = VerifyJob(fixture="packed", world_size=2, accum_steps=2)
    grads = loss_and_grad(builtin_fixture("packed"), "token_mean", 2, 2).grads
    nan = {k: np.full_like(v, math.nan) for k, v in grads.items()}
    hung = StepError("packed R=2 M=2: did not finish within 10 s")
    headlines = {
        "verified": _report((job, VerifyOutput(grads))),
        "nothing ran": _report((job, hung)),
        "non-finite": _report((job, VerifyOutput(nan))),
    }
    lines = {name: report.message().splitlines()[0] for name, report in headlines.items()}
    assert lines["verified"].startswith("my:step (jax) matches token_mean on 1 fixture/layout")
    assert lines["nothing ran"] == (
        "my:step (jax) could not run: none of its 1 fixture/layout case ran (below)."
    )
    assert lines["non-finite"].startswith("my:step (jax) does NOT match token_mean on 1 ")
    assert "a non-finite gradient in 1 case" in lines["non-finite"]
    for line in lines.values():
        assert " - " not in line and " at - " not in line and "inf" not in line, line


def test_the_sensitivity_line_names_its_level_and_what_strict_would_flag():
    """A float64-exact pass under auto is guaranteed at float32-level (the verdict could have
    settled there): the line says so, and gives --strict's far smaller skew."""
    from crosscheck.contract.oracle import loss_and_grad
    from crosscheck.fixtures.builtin import builtin_fixture
    from crosscheck.verification.protocol import VerifyJob, VerifyOutput

    job = VerifyJob(fixture="packed", world_size=2, accum_steps=2)
    grads = loss_and_grad(builtin_fixture("packed"), "token_mean", 2, 2).grads
    report = _report((job, VerifyOutput(grads)))
    assert report.ok and report.level == "float64"
    line = report.message().splitlines()[2]
    assert line.startswith(
        "Judged at float64-exact; under --precision auto a verdict may settle as coarse as "
        "float32-level, where the run flags one rank's weights scaled by 1 + "
    ), line
    strict = float(line.rsplit("--strict flags from 1 + ", 1)[1].rstrip("."))
    assert 0 < strict < 1e-9  # float64's tolerance is 1e-12: its skew is that small


def test_the_cli_takes_strict_and_refuses_a_contradiction(tmp_path):
    def verify_cli(*flags: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "crosscheck", "verify", "--framework", "torch"]
        command += ["--step", "examples.torch_hf_loss:step", "--scheme", "token_mean"]
        command += ["--fixtures", "packed", "--world-sizes", "2", "--accum-steps", "4", *flags]
        return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)

    # HF's loss upcasts to float32: the automatic verdict passes it, the strict one does not.
    assert verify_cli().returncode == 0
    strict = verify_cli("--strict", "--json", str(tmp_path / "strict.json"))
    assert strict.returncode == 1, strict.stdout[-2000:]
    record = json.loads((tmp_path / "strict.json").read_text())
    assert record["precision"] == "float64" and record["precision_requested"] == "float64"
    both = verify_cli("--strict", "--precision", "float32")
    assert both.returncode == 2 and both.stdout == ""
    assert both.stderr.splitlines() == [
        "crosscheck verify: --strict is --precision float64, not float32"
    ]
