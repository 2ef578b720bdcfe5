"""`python -m crosscheck run`: exit status, filters and the JSON contract."""

from __future__ import annotations

import json
import os
import re
import subprocess

import numpy as np
from child_env import run_cli
from json_keys import RESULT_KEYS

from crosscheck.cli.commands import main
from crosscheck.cli.outputs import output_width
from crosscheck.cli.report import FAMILY_NAMES


def run_crosscheck(
    *argv: str, timeout: float, columns: str | None = None
) -> subprocess.CompletedProcess:
    """`python -m crosscheck ARGV` in a fresh process, its output captured as text (a pipe),
    with COLUMNS unset or set to `columns`."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    if columns is not None:
        env["COLUMNS"] = columns
    return run_cli(*argv, env=env, timeout=timeout)


def test_the_main_jobs_output_fits_one_screen_and_ends_with_its_verdict():
    """The main job's default output, piped with COLUMNS unset (as `make demo | less` or a CI
    log): the seed's 9x, one line per family of rows, the skips in one line and the verdict
    last, within 60 lines of at most 80 columns. The oracle's rows stand in for the whole
    matrix (every family but the frameworks'): the lines are per family, not per row."""
    completed = run_crosscheck("run", "--impls", "oracle", timeout=300)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    lines = completed.stdout.splitlines()
    assert len(lines) <= 60, completed.stdout
    assert max(len(line) for line in lines) <= 80, completed.stdout
    the_9x = "a token on rank 0 weighs 9.0x a token on rank 1 under rank_mean"
    assert the_9x in [line.strip() for line in lines]
    families = ("oracle: layouts", "clipping placement", "oracle: term layouts")
    for family in families:
        assert sum(line.startswith(f"│ {family} ") for line in lines) == 1, completed.stdout
    assert set(families) <= set(FAMILY_NAMES.values())
    assert lines[-2].startswith("wall time ")
    assert re.fullmatch(
        r"OK: \d+ rows, 0 failed \(\d+ expected to move with the layout\)", lines[-1]
    )
    # COLUMNS, where set, is the width; the tables behind --rows group then keep one line
    # per row (the compact layout is for narrow widths).
    wide = run_crosscheck("run", "--impls", "oracle", "--rows", "group", timeout=300, columns="160")
    widths = [len(line) for line in wide.stdout.splitlines()]
    assert 80 < max(widths) <= 160, wide.stdout
    assert any(line.startswith("┃ scheme ") for line in wide.stdout.splitlines()), wide.stdout


def test_main_leaves_the_callers_numpy_error_state_alone(tmp_path):
    before = np.geterr()
    main(["run", "--impls", "oracle", "--fixtures", "seed", "--no-resume"])
    assert np.geterr() == before


def test_oracle_run_writes_the_documented_json_and_exits_zero(tmp_path):
    out = tmp_path / "out.json"
    completed = run_crosscheck("run", "--impls", "oracle", "--json", str(out), timeout=120)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "9.0x" in completed.stdout
    payload = json.loads(out.read_text())
    assert payload["ok"] is True
    assert len(payload["results"]) > 100
    assert {r["check"] for r in payload["results"]} == {
        "layout-invariance",
        "clipping",
        "term-layout",
    }
    terms = [r for r in payload["results"] if r["check"] == "term-layout"]
    update_scope = [r for r in terms if r["extra"]["expected"] == "invariant"]
    assert update_scope and max(r["max_rel_err"] for r in update_scope) <= 1e-12
    local_lb = [r for r in terms if r["scheme"] == "aux-local/moe_lb"]
    assert max(r["max_rel_err"] for r in local_lb) > 0.1  # micro-batch balancing moves
    for row in payload["results"]:
        assert set(row) >= RESULT_KEYS
        assert isinstance(row["max_rel_err"], float) and row["ok"] is True
    invariance = [r for r in payload["results"] if r["check"] == "layout-invariance"]
    intended = [r for r in invariance if r["scheme"] == "token_mean"]
    assert max(r["max_rel_err"] for r in intended) <= 1e-12
    seed_rank = [r for r in invariance if r["fixture"] == "seed" and r["scheme"] == "rank_mean"]
    assert max(r["max_rel_err"] for r in seed_rank) > 0.1  # the accidental scheme's deviation
    # seed's 2 rows do not divide R x M = 4 or 8: those oracle rows are listed as not run,
    # with why.
    skipped = payload["skipped"]
    assert skipped and {s["reason"] for s in skipped} == {"seed has 2 rows, not divisible by R x M"}
    assert {(s["check"], s["impl"], s["world_size"], s["accum_steps"]) for s in skipped} == {
        ("layout-invariance", "oracle", 2, 2),
        ("layout-invariance", "oracle", 4, 1),
        ("layout-invariance", "oracle", 4, 2),
    }
    assert f"{len(skipped)} planned combinations not run, for 1 reason: " in completed.stdout


def test_run_filters_fixtures_schemes_and_layouts(tmp_path):
    out = tmp_path / "out.json"
    code = main(
        [
            "run",
            "--fixtures",
            "packed",
            "--schemes",
            "token_mean,row_mean",
            "--world-sizes",
            "1,2",
            "--accum-steps",
            "2",
            "--impls",
            "oracle",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    rows = [r for r in json.loads(out.read_text())["results"] if r["check"] != "clipping"]
    assert {(r["scheme"], r["world_size"], r["accum_steps"]) for r in rows} == {
        ("token_mean", 1, 2),
        ("token_mean", 2, 2),
        ("row_mean", 1, 2),
        ("row_mean", 2, 2),
    }


def test_run_refuses_an_unknown_scheme_with_the_known_ones():
    completed = run_crosscheck("run", "--schemes", "mean", timeout=60)
    assert completed.returncode == 2
    # A set-up error: one line on stderr, nothing on stdout (where results go).
    [line] = completed.stderr.splitlines()
    assert line.startswith("crosscheck run: ") and "unknown scheme 'mean'" in line
    assert completed.stdout == ""


def test_run_refuses_an_unknown_implementation():
    completed = run_crosscheck("run", "--impls", "jax-xla", timeout=60)
    assert completed.returncode == 2
    [line] = completed.stderr.splitlines()
    assert line.startswith("crosscheck run: ") and "unknown implementation 'jax-xla'" in line
    assert completed.stdout == ""


def test_run_refuses_a_world_size_that_divides_no_named_fixture():
    code = main(["run", "--world-sizes", "3", "--fixtures", "packed", "--impls", "oracle"])
    assert code == 2


def test_default_lists_are_not_explicit_and_named_ones_are():
    from crosscheck.cli.commands import _plan, build_parser

    plan = _plan(build_parser().parse_args(["run", "--impls", "oracle", "--accum-steps", "1"]))
    assert plan.explicit == {"impls", "accum_steps"}
    assert plan.world_sizes == [1, 2, 4] and plan.strategies == ["precount", "postnorm"]


def test_the_output_width_is_columns_else_the_terminal_else_80(monkeypatch):
    """COLUMNS where it is a positive number; nothing else ever draws at width 0 or raises."""
    assert output_width({"COLUMNS": "120"}, isatty=False) == 120
    assert output_width({"COLUMNS": "120"}, isatty=True) == 120
    for junk in ("", "0", "-3", "80x", "\u00b2", " "):
        assert output_width({"COLUMNS": junk}, isatty=False) == 80, junk
    assert output_width({}, isatty=False) == 80
    # On a terminal without a usable COLUMNS: stdout's own size.
    monkeypatch.setattr(
        "shutil.get_terminal_size", lambda fallback=(80, 24): os.terminal_size((97, 30))
    )
    assert output_width({"COLUMNS": "0"}, isatty=True) == 97
    # A COLUMNS rich itself would take for a number ("\u00b2".isdigit()) and fail to parse.
    for junk in ("\u00b2", "0"):
        proc = run_crosscheck(
            "run", "--impls", "oracle", "--fixtures", "seed", timeout=120, columns=junk
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.splitlines()[-1].startswith("OK: "), proc.stdout
        assert max(len(line) for line in proc.stdout.splitlines()) <= 80
