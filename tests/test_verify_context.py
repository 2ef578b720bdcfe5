"""`crosscheck verify` of a context-parallel step (a step that declares ``context``): the
examples in torch (R x C gloo processes, DDP over all of them, a ("dp", "cp") DeviceMesh) and
JAX (a ("data", "context") mesh, the batch split [R, C, M, B, T/C]) at the default
context-parallel layouts, each bug named; the layouts asked for on the command line; and the
set-up errors, refused before any process starts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from child_env import ROOT

from crosscheck.contract.layout import Layout
from crosscheck.verification.step_check import check_step
from crosscheck.verification.verifier import (
    DEFAULT_CONTEXT_LAYOUTS,
    DEFAULT_FIXTURES,
    StepSetupError,
    jobs_for,
    verify,
)

#: step -> the name every case gets (token_mean: the step passes).
STEPS = {
    "step": "token_mean",
    "step_local_count": "cp-local-count",
    "step_count_over_dp_only": "cp-count-over-dp-only",
    "step_missing_cp_compensation": "missing-cp-compensation",
}
MODULES = {"torch": "examples.torch_context_parallel", "jax": "examples.jax_context_parallel"}


@pytest.mark.parametrize("framework", list(MODULES))
@pytest.mark.parametrize("function", list(STEPS))
def test_context_parallel_examples_are_verified_and_named(framework, function):
    """At every default context-parallel layout, on both default fixtures: the correct step
    matches token_mean at float64 (1e-12) and each bug fails every case, explained by its
    own name alone."""
    step = f"{MODULES[framework]}:{function}"
    report = verify(step, framework=framework, scheme="token_mean")
    layouts = {case.job.layout for case in report.cases}
    assert layouts == {Layout(*layout) for layout in DEFAULT_CONTEXT_LAYOUTS}
    assert len(report.cases) == len(DEFAULT_FIXTURES) * len(DEFAULT_CONTEXT_LAYOUTS)
    assert not [case.error for case in report.cases if case.error]
    named = STEPS[function]
    if named == "token_mean":
        assert report.ok, report.message()
        assert report.max_rel_err <= 1e-12
        # The sensitivity the message promises holds at every layout (an ill-conditioned
        # group fit would have promised far less: see DEFAULT_CONTEXT_LAYOUTS).
        assert report.detectable_skew is not None and report.detectable_skew[1] < 2e-5
    else:
        assert not report.ok
        assert all(not case.ok for case in report.cases)
        assert report.explanations == [named], report.message()
        # Each case fits the name; one case alone may fit others too (at R = C = 2, 1/C is
        # also missing-world-size's 1/R): the run's headline is the name that explains all.
        assert all(named in case.diagnosis.fits for case in report.cases), [
            (case.job.describe(), case.diagnosis.fits) for case in report.cases
        ]


def test_context_sizes_from_the_command_line(tmp_path):
    """--context-sizes and --context-orders with --world-sizes and --accum-steps: their
    product, C = 1 among them (the step's context of size 1); the JSON says each case's C."""
    path = tmp_path / "verify.json"
    command = [
        *(sys.executable, "-m", "crosscheck", "verify", "--framework", "torch"),
        *("--step", "examples.torch_context_parallel:step", "--scheme", "token_mean"),
        *("--fixtures", "packed", "--world-sizes", "2", "--accum-steps", "2"),
        *("--context-sizes", "1,2", "--context-orders", "zigzag,contiguous"),
        *("--json", str(path)),
    ]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "at layouts (R, M, C order) (2, 2, 1), (2, 2, 2 contiguous), (2, 2, 2 zigzag)" in (
        " ".join(proc.stdout.split())
    )
    cases = json.loads(path.read_text())["cases"]
    assert sorted((c["context_size"], c["context_order"]) for c in cases) == [
        (1, "contiguous"),
        (2, "contiguous"),
        (2, "zigzag"),
    ]


def test_context_set_up_errors_are_refused_before_any_process(tmp_path):
    # A step without `context` cannot be run split: refused by the up-front check.
    with pytest.raises(StepSetupError, match="declares no `context` parameter"):
        verify(
            "examples.torch_torchtitan:step",
            framework="torch",
            scheme="token_mean",
            context_sizes=[2],
        )
    for bad in ([0], [2.0]):
        with pytest.raises(StepSetupError, match="whole numbers >= 1"):
            verify(
                MODULES["jax"] + ":step", framework="jax", scheme="token_mean", context_sizes=bad
            )
    with pytest.raises(StepSetupError, match="context orders are contiguous and zigzag"):
        verify(
            MODULES["jax"] + ":step",
            framework="jax",
            scheme="token_mean",
            context_orders=["striped"],
        )
    with pytest.raises(StepSetupError, match="cannot be verified with --objective yet"):
        verify(MODULES["torch"] + ":step", framework="torch", objective="aux")
    # A layout asked for that the fixture's positions cannot take: named with the rule.
    with pytest.raises(ValueError, match=r"R=1,M=1,C=16z does not divide \(.*2 C for zigzag"):
        jobs_for(["ragged"], [1], [1], context_sizes=[2, 16], context_step=True)
    with pytest.raises(ValueError, match=r"no layout among R=1,M=1,C=16z divides them \("):
        jobs_for(["ragged"], [1], [1], context_sizes=[16], context_step=True)
    command = [
        *(sys.executable, "-m", "crosscheck", "verify", "--framework", "torch"),
        *("--step", "examples.torch_torchtitan:step", "--scheme", "token_mean"),
        *("--context-orders", "diagonal"),
    ]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "context orders are contiguous and zigzag" in proc.stderr


def test_the_up_front_check_reads_context_from_the_signature(tmp_path):
    """A required `context` binds (the harness passes it); a plain file is read, not run;
    a module it must import says it through the short subprocess."""
    (tmp_path / "cp_steps.py").write_text(
        "def cp(model, microbatches, context):\n    pass\n\n"
        "def plain(model, microbatches):\n    pass\n\n"
        "def splat(model, microbatches, **kwargs):\n    pass\n"
    )
    assert check_step("cp_steps:cp", "torch", cwd=str(tmp_path)) is True
    assert check_step("cp_steps:plain", "torch", cwd=str(tmp_path)) is False
    assert check_step("cp_steps:splat", "torch", cwd=str(tmp_path)) is False  # asks for none
    # A package's module: imported in the check's subprocess, which reports the signature.
    package = tmp_path / "cp_package"
    package.mkdir()
    (package / "__init__.py").write_text("from cp_steps import cp, plain\n")
    assert check_step("cp_package:cp", "torch", cwd=str(tmp_path)) is True
    assert check_step("cp_package:plain", "torch", cwd=str(tmp_path)) is False
