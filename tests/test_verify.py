"""`crosscheck verify` on the examples: each with its stated outcome, through the Python API
(default fixtures and layouts) and through the CLI (one layout, JSON as documented)."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import time

import pytest
from child_env import ROOT
from PIL import Image

from crosscheck.verification.verifier import (
    DEFAULT_FIXTURES,
    DEFAULT_LAYOUTS,
    StepSetupError,
    assert_weighting,
    verify,
)

#: example -> (framework, passes token_mean?, diagnosis on a layout with R > 1 and M > 1)
EXAMPLES = {
    "examples.torch_nanogpt:step": ("torch", False, "microbatch-mean"),
    "examples.torch_torchtitan:step": ("torch", True, "token_mean"),
    "examples.torch_factory:step": ("torch", True, "token_mean"),
    "examples.jax_pmap_mean:step": ("jax", False, "rank-mean"),
    "examples.jax_optax_multisteps:step": ("jax", False, "microbatch-mean"),
    "examples.jax_token_weighted:step": ("jax", True, "token_mean"),
}


@pytest.mark.parametrize("step", list(EXAMPLES))
def test_example_through_the_python_api(step):
    framework, passes, named = EXAMPLES[step]
    report = verify(step, framework=framework, scheme="token_mean")
    assert len(report.cases) == sum(
        1 for f in DEFAULT_FIXTURES for R, M in DEFAULT_LAYOUTS if f != "packed" or R * M <= 8
    )
    assert not [case.error for case in report.cases if case.error]
    assert report.ok is passes, report.message()
    assert report.diagnosis is not None and report.diagnosis.best_match == named
    assert (report.max_rel_err <= 1e-12) is passes
    assert report.message().startswith(f"{step} ({framework}) ")


@pytest.mark.parametrize(
    ("step", "framework"),
    [("examples.torch_nanogpt:step", "torch"), ("examples.jax_token_weighted:step", "jax")],
)
def test_assert_weighting_raises_with_the_diagnosis(step, framework):
    _, passes, named = EXAMPLES[step]
    one_layout = {"fixtures": ["packed"], "world_sizes": [2], "accum_steps": [2]}
    if passes:
        report = assert_weighting(step, framework=framework, scheme="token_mean", **one_layout)
        assert report.ok
    else:
        with pytest.raises(AssertionError, match=f"Diagnosis on packed R=2 M=2: {named}"):
            assert_weighting(step, framework=framework, scheme="token_mean", **one_layout)


@pytest.mark.parametrize("step", list(EXAMPLES))
def test_example_through_the_cli(step, tmp_path):
    framework, passes, named = EXAMPLES[step]
    path = tmp_path / "verify.json"
    command = [
        sys.executable,
        "-m",
        "crosscheck",
        "verify",
        "--framework",
        framework,
        "--step",
        step,
        "--scheme",
        "token_mean",
        "--fixtures",
        "ragged",
        "--world-sizes",
        "2",
        "--accum-steps",
        "2",
        "--json",
        str(path),
        "--plot",
        str(tmp_path / "pictures" / "weights.png"),
    ]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == (0 if passes else 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    # The picture of the case the headline names, its title in the PNG's own Title text; then
    # the verdict, the last line.
    picture = tmp_path / "pictures" / "weights.png"
    title = Image.open(picture).text["Title"]
    if passes:
        assert title.startswith(f"{step}: matches token_mean"), title
    else:
        assert re.match(rf"{re.escape(step)}: {named}, weight ratio [\d.]+x", title), title
    assert title.endswith("ragged, R=2, M=2; intended token_mean"), title
    lines = proc.stdout.splitlines()
    assert lines[-2] == f"wrote {picture} (ragged R=2 M=2)"
    assert lines[-1].startswith("OK   " if passes else "FAIL   ")
    data = json.loads(path.read_text())
    assert data["ok"] is passes
    assert {"ok", "max_rel_err", "diagnosis"} <= set(data)
    diagnosis = data["diagnosis"]
    assert {"best_match", "weight_ratio", "scale", "residual"} <= set(diagnosis)
    assert diagnosis["best_match"] == named
    assert (data["max_rel_err"] <= 1e-12) is passes
    assert named in proc.stdout


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_broken_steps_get_a_clear_error_in_bounded_time(framework, tmp_path):
    """A step that does not exist is refused up front, once; one whose module raises at
    import is reported by name for its cases, never a hang and never a mismatch."""
    one_case = {"fixtures": ["packed"], "world_sizes": [2], "accum_steps": [1], "timeout_s": 60}
    started = time.monotonic()
    with pytest.raises(StepSetupError, match=r"no module named 'examples\.no_such_module'"):
        verify("examples.no_such_module:step", framework=framework, scheme="token_mean", **one_case)
    # Refused before any process starts: one short check, not a launch (seconds, not 7-15 s).
    assert time.monotonic() - started < 10
    with contextlib.chdir(ROOT / "tests"):
        report = verify(
            "verify_broken_step:step", framework=framework, scheme="token_mean", **one_case
        )
    assert not report.ok
    assert report.to_json()["diagnosis"]["best_match"] == "error"
    assert "gradweight_missing_dependency" in report.message()
    assert time.monotonic() - started < 90


def test_bad_arguments_are_refused_before_anything_runs():
    with pytest.raises(ValueError, match="MODULE:FUNCTION"):
        verify("examples.torch_nanogpt", framework="torch", scheme="token_mean")
    with pytest.raises(ValueError, match="accidental"):
        verify("examples.torch_nanogpt:step", framework="torch", scheme="rank_mean")
    with pytest.raises(ValueError, match="framework"):
        verify("examples.torch_nanogpt:step", framework="mxnet", scheme="token_mean")
    with pytest.raises(ValueError, match="divides"):
        verify(
            "examples.torch_nanogpt:step",
            framework="torch",
            scheme="token_mean",
            fixtures=["seed"],
            world_sizes=[4],
        )
