"""`crosscheck conformance`: the settings, the versioned expectations, and real frameworks run.

The real runs (`test_a_real_framework_setting_gets_its_expected_verdict`) drive one setting per
framework family through the framework's own training code (transformers' Trainer, TRL's
GRPOTrainer, optax's MultiSteps with a Flax NNX model) and check the row's verdict and outcome;
`make conformance` runs the whole table. The rest checks the machinery without a framework:
expectations that do not cover a version, or disagree, fail the command; a reproduction command
is one `crosscheck verify` accepts; set-up errors are refused before anything runs.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from crosscheck import exit_codes
from crosscheck.cli.commands import main
from crosscheck.cli.conformance_report import exit_code
from crosscheck.cli.parser import build_parser
from crosscheck.conformance import runner
from crosscheck.conformance.expectations import (
    Expectation,
    ExpectationsError,
    expectation_for,
    load_expectations,
    version_in,
)
from crosscheck.conformance.settings import SETTINGS, Setting, find_settings
from crosscheck.diagnosis.families import FAMILIES
from crosscheck.diagnosis.objective_candidates import PATTERNS as OBJECTIVE_PATTERNS
from crosscheck.diagnosis.patterns import PATTERNS

ROOT = Path(__file__).resolve().parents[1]
#: The versions CI installs: an expectation must cover each runnable setting at them.
PINS = dict(
    re.findall(
        r"^([A-Za-z0-9._-]+)==([^\s#]+)",
        "\n".join(
            (ROOT / "scripts" / name).read_text()
            for name in ("constraints.txt", "constraints-conformance.txt")
        ),
        re.M,
    )
)


@pytest.mark.parametrize(
    ("version", "versions", "inside"),
    [
        ("1.16.0", ">=1.16,<1.17", True),
        ("1.17.0", ">=1.16,<1.17", False),
        ("1.16", ">=1.16.0", True),
        ("2.13.0+cpu", "==2.13", True),
        ("0.19.8", "!=0.19.8", False),
        ("0.3.0", ">0.3", False),
    ],
)
def test_version_ranges_compare_releases(version, versions, inside):
    assert version_in(version, versions) is inside


def test_a_version_no_entry_covers_has_no_expectation():
    expectations = [
        Expectation(framework="trl", setting="x", versions=">=1.16,<1.17", verdict="pass")
    ]
    assert expectation_for(expectations, "trl", "x", "1.16.3") is expectations[0]
    assert expectation_for(expectations, "trl", "x", "1.17.0") is None
    assert runner.outcome_of("pass", None) == runner.NO_EXPECTATION
    assert runner.outcome_of("rank-mean", expectations[0]) == runner.DIFFERS
    assert runner.outcome_of("error", expectations[0]) == runner.COULD_NOT_RUN


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '[[expect]]\nframework="a"\nsetting="b"\nversions=">=1"\nverdict="rank-mean"\n',
            "evidence",
        ),
        ('[[expect]]\nframework="a"\nsetting="b"\nversions="~=1"\nverdict="pass"\n', "OP VERSION"),
        ('[[expect]]\nframework="a"\nsetting="b"\nverdict="pass"\n', "missing versions"),
        (
            '[[expect]]\nframework="a"\nsetting="b"\nversions=">=1"\nverdict="pass"\nx=1\n',
            "unknown",
        ),
    ],
)
def test_a_malformed_expectation_is_named(text, message):
    with pytest.raises(ExpectationsError, match=message):
        load_expectations(text)


def test_every_expected_failure_cites_its_evidence_and_names_a_pattern():
    for expectation in load_expectations():
        if expectation.verdict != "pass":
            assert re.match(r"(issue|documented|contradicts): ", expectation.evidence), expectation
            assert expectation.verdict not in ("unknown", "ambiguous", "error"), expectation
            # A pattern or family, or the names a setting's layouts cannot tell apart; a
            # multi-term setting's pattern names the term it hits: pattern(term).
            for name in expectation.verdict.split(" or "):
                pattern, _, term = name.partition("(")
                if term:
                    assert pattern in OBJECTIVE_PATTERNS and term.endswith(")"), expectation
                else:
                    assert name in PATTERNS or name in FAMILIES, expectation


def test_every_runnable_setting_has_an_expectation_at_the_pinned_version():
    expectations = load_expectations()
    missing = []
    for setting in SETTINGS:
        if not setting.runs:
            assert setting.prediction, f"{setting.key}: a listed row says what the code predicts"
            continue
        pin = PINS.get(setting.framework)
        assert pin, f"{setting.framework} is pinned in no constraints file"
        if expectation_for(expectations, setting.framework, setting.setting, pin) is None:
            missing.append(f"{setting.key} at {pin}")
    assert missing == []


def test_settings_are_unique_and_their_commands_parse_as_verify():
    keys = [setting.key for setting in SETTINGS]
    assert len(keys) == len(set(keys))
    for setting in SETTINGS:
        if not setting.runs:
            continue
        args = build_parser().parse_args(setting.command()[3:])
        assert (args.command, args.step) == ("verify", setting.step)
        # A setting with a second loss term is held to its objective, the others to a scheme.
        assert (args.scheme, args.objective) == (
            (None, setting.objective) if setting.objective else (setting.scheme, None)
        )
        assert args.world_sizes == list(setting.world_sizes)
        assert args.accum_steps == list(setting.accum)
        assert args.model == setting.model


def test_differing_rows_fail_and_rows_that_could_not_run_are_exit_3():
    def row(outcome: str) -> runner.Row:
        return runner.Row(setting=SETTINGS[0], version="0", outcome=outcome)

    assert exit_code([row(runner.AS_EXPECTED), row(runner.NOT_RUN_HERE)]) == exit_codes.OK
    assert exit_code([row(runner.AS_EXPECTED), row(runner.DIFFERS)]) == exit_codes.MISMATCH
    assert exit_code([row(runner.NO_EXPECTATION)]) == exit_codes.MISMATCH
    assert exit_code([row(runner.COULD_NOT_RUN)]) == exit_codes.STEP_FAILED
    assert exit_code([row(runner.COULD_NOT_RUN), row(runner.DIFFERS)]) == exit_codes.MISMATCH


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--frameworks", "jaxx"], "unknown framework 'jaxx'"),
        (["--frameworks", "transformers", "--settings", "nope"], "unknown setting 'nope'"),
        (["--json", "/proc/x/y.json"], "--json"),
    ],
)
def test_set_up_errors_are_refused_before_anything_runs(argv, message, capsys):
    assert main(["conformance", *argv]) == exit_codes.SETUP_ERROR
    out = capsys.readouterr()
    assert out.out == ""  # a set-up error: one line on stderr, nothing where results go
    [line] = out.err.splitlines()
    assert line.startswith("crosscheck conformance: ") and message in line


def test_a_named_framework_that_is_not_installed_is_refused(monkeypatch, capsys):
    real = runner.installed_version
    monkeypatch.setattr(
        runner, "installed_version", lambda name: None if name == "trl" else real(name)
    )
    assert main(["conformance", "--frameworks", "trl"]) == exit_codes.SETUP_ERROR
    out = capsys.readouterr()
    assert out.out == ""
    [line] = out.err.splitlines()
    assert line.startswith("crosscheck conformance: --frameworks trl: ")
    assert "trl not installed" in line and "gradweight[hf]" in line


def test_listed_rows_run_nothing_and_say_why(tmp_path):
    path = tmp_path / "rows.json"
    assert main(["conformance", "--frameworks", "megatron-core", "--json", str(path)]) == 0
    (row,) = json.loads(path.read_text())["rows"]
    assert row["outcome"] == "not run here"
    assert "CUDA" in row["not_run"] and row["prediction"]


def _only(key: str) -> Setting:
    (setting,) = [s for s in find_settings(None, None) if s.key == key]
    return setting


#: One setting per framework family, through the framework's real code.
REAL_RUNS = [
    ("transformers:trainer-default", "pass"),
    ("trl:grpo-bnpo", "microbatch-mean"),
    ("optax:multisteps-shard-map-mean", "microbatch-mean"),
]


@pytest.mark.parametrize(("key", "verdict"), REAL_RUNS)
def test_a_real_framework_setting_gets_its_expected_verdict(key, verdict, tmp_path):
    setting = _only(key)
    path = tmp_path / "row.json"
    argv = ["conformance", "--frameworks", setting.framework, "--settings", setting.setting]
    assert main([*argv, "--json", str(path), "--markdown", str(tmp_path / "c.md")]) == 0
    (row,) = json.loads(path.read_text())["rows"]
    assert (row["verdict"], row["outcome"]) == (verdict, "as expected")
    assert row["version"] == PINS[setting.framework]
    assert row["command"].startswith("python -m crosscheck verify --framework")
    assert setting.title in (tmp_path / "c.md").read_text()
