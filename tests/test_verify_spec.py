"""`verify` against trainer modes (scheme specs): v2 fields reach the step, the group count is
judged, a user's own spec is read from MODULE:OBJECT.

The steps are examples/{torch,jax}_grpo_prompt_mean.py: a prompt-group mean whose counts span
ranks and microbatches (correct), and the same with each group counted inside its microbatch
(the local-group-count bug).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from crosscheck.verification.verifier import SPEC_FIXTURES, verify

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_a_correct_group_mean_passes_on_every_spec_fixture_and_layout(framework):
    report = verify(
        f"examples.{framework}_grpo_prompt_mean:step",
        framework=framework,
        scheme="group_token_mean",
    )
    assert {case.job.fixture for case in report.cases} == set(SPEC_FIXTURES)
    assert report.ok, report.message()
    # float64 on both sides: the worst error is rounding (measured ~1e-15)
    assert max(case.max_rel_err for case in report.cases) <= 1e-12


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_a_group_counted_per_microbatch_is_named_local_group_count(framework):
    report = verify(
        f"examples.{framework}_grpo_prompt_mean:step_microbatch_count",
        framework=framework,
        scheme="group_token_mean",
        fixtures=["rollouts"],
    )
    assert not report.ok
    assert report.best_match == "local-group-count", report.message()
    # (1, 2): no ranks at all, the split is between microbatches only
    one_rank = [c for c in report.cases if (c.job.world_size, c.job.accum_steps) == (1, 2)]
    assert one_rank[0].diagnosis.best_match == "local-group-count"


def test_a_users_own_spec_is_read_from_module_object(tmp_path):
    (tmp_path / "my_schemes.py").write_text(
        "from crosscheck import SchemeSpec\n"
        "PROMPT_MEAN = SchemeSpec.from_dict({\n"
        '    "weight": {"group": "group"},\n'
        '    "denominator": {"kind": "groups", "group": "group"},\n'
        "})\n"
    )
    out = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "crosscheck",
            "verify",
            "--framework",
            "torch",
            "--step",
            "examples.torch_grpo_prompt_mean:step",
            "--scheme",
            "my_schemes:PROMPT_MEAN",
            "--fixtures",
            "rollouts",
            "--json",
            str(out),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    payload = json.loads(out.read_text())
    assert payload["ok"] is True and payload["scheme"] == "my_schemes:PROMPT_MEAN"


def test_a_scheme_reference_that_names_nothing_is_a_setup_error(tmp_path):
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "crosscheck",
            "verify",
            "--framework",
            "torch",
            "--step",
            "examples.torch_grpo_prompt_mean:step",
            "--scheme",
            "no_such_module:SPEC",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 2 and completed.stdout == ""
    [line] = completed.stderr.splitlines()
    assert line.startswith("crosscheck verify: ")
    assert "scheme 'no_such_module:SPEC': cannot import 'no_such_module'" in line
