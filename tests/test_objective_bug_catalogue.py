"""The multi-term rows of `python -m crosscheck bugs`: every objective pattern of docs/bugs.md
run as a buggy step in torch (DDP on gloo) and JAX (shard_map, float64), detected and named by
`diagnose_objective`; how the rows are printed, written as JSON and counted in the exit status.

One run of every step (one JAX worker, one torch launch per world size) serves the module.
"""

from __future__ import annotations

import io
import json
import math
from collections import defaultdict

import pytest
from rich.console import Console

from crosscheck import exit_codes
from crosscheck.bugs.catalogue_run import CatalogueRun, run_catalogue
from crosscheck.bugs.objective_catalogue import (
    LAYOUTS,
    MICROBATCH_TERMS,
    OBJECTIVE_PATTERNS,
    TERMS,
    judge_objective,
    layouts_of,
    objective_runs,
    run_objective_catalogue,
    run_objective_steps,
    terms_of,
)
from crosscheck.bugs.objective_steps import frozen_terms
from crosscheck.cli.bug_report import OBJECTIVE_TITLE, catalogue_exit_code, print_catalogue

FRAMEWORKS = ("torch", "jax")


@pytest.fixture(scope="module")
def outputs() -> dict:
    """Every planned step's gradient (or error), from one run of both frameworks."""
    return run_objective_steps(objective_runs(FRAMEWORKS))


@pytest.fixture(scope="module")
def rows(outputs) -> list:
    return run_objective_catalogue(FRAMEWORKS, outputs=outputs)


def test_the_plan_is_every_pattern_in_both_frameworks_at_its_layouts():
    runs = objective_runs(FRAMEWORKS)
    planned = sum(len(layouts_of(p)) for p in OBJECTIVE_PATTERNS) * len(FRAMEWORKS)
    assert len(runs) == len(set(runs)) == planned
    assert {(r.pattern, r.target) for r in runs} == set(OBJECTIVE_PATTERNS.items())
    for run in runs:
        assert run.terms == frozen_terms(terms_of(run.pattern))
        assert (run.world_size, run.accum_steps) in layouts_of(run.pattern)
    assert objective_runs(FRAMEWORKS, ["rank-mean"]) == []  # a single-term pattern only
    with pytest.raises(ValueError, match="unknown framework"):
        objective_runs(("mxnet",))


def test_only_the_microbatch_pattern_has_its_own_objective_and_layouts():
    """aux-summed-over-microbatches needs a term meant per microbatch, and R > 1 and M > 1 to
    be told from the world-size factor (x R M = x R at M = 1); every other row keeps `TERMS`
    and `LAYOUTS`."""
    for pattern in OBJECTIVE_PATTERNS:
        if pattern == "aux-summed-over-microbatches":
            continue
        assert terms_of(pattern) == TERMS and layouts_of(pattern) == LAYOUTS
    local = "aux-summed-over-microbatches"
    assert [t for t in MICROBATCH_TERMS if t.get("scope") == "microbatch"] == [
        {**TERMS[-1], "scope": "microbatch"}
    ]
    assert [t for t in MICROBATCH_TERMS if t["kind"] != "moe_lb"] == list(TERMS[:-1])
    assert terms_of(local) == MICROBATCH_TERMS
    assert all(R > 1 and M > 1 for R, M in layouts_of(local))


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("pattern", list(OBJECTIVE_PATTERNS))
def test_every_pattern_is_detected_and_named_in_both_frameworks(rows, pattern, framework):
    mine = [r for r in rows if r.run.pattern == pattern and r.run.framework == framework]
    assert {(r.run.world_size, r.run.accum_steps) for r in mine} == set(layouts_of(pattern))
    for r in mine:
        assert not r.error, r.error
        assert r.detected, r.run.describe()
        assert r.intended_error >= 1e-6, r.run.describe()  # far beyond rounding
        assert r.diagnosed_as == f"{pattern}({OBJECTIVE_PATTERNS[pattern]})", r.explanation
        assert r.pattern_error <= 1e-12
        assert r.ok


def test_torch_and_jax_steps_agree_on_every_buggy_gradient(outputs):
    """Two independent implementations of each bug: the same gradient to rounding."""
    pairs = defaultdict(dict)
    for run, grads in outputs.items():
        pairs[run.pattern, run.world_size, run.accum_steps][run.framework] = grads
    for key, both in pairs.items():
        for name, g in both["torch"].items():
            scale = float(abs(g).max()) or 1.0
            assert float(abs(both["jax"][name] - g).max()) / scale <= 1e-12, (key, name)


def test_the_rows_are_printed_after_their_title_and_counted(rows):
    run = CatalogueRun(results=[], skews=[], minimum_skew={}, objectives=rows)
    for width in (200, 80):  # the wide table and the compact one: no name cut
        console = Console(file=io.StringIO(), width=width, color_system=None)
        print_catalogue(console, run)
        text = console.file.getvalue()
        assert OBJECTIVE_TITLE.split(":")[0] in text
        assert f"{len(rows)} of {len(rows)} multi-term buggy steps detected and named" in text
        assert "aux-global-count-local-stats(moe_lb)" in text
        assert "aux-summed-over-microbatches(moe_lb)" in text
    assert catalogue_exit_code(run) == exit_codes.OK
    record = json.loads(json.dumps(run.to_json(), allow_nan=False))
    assert record["ok"] is True
    assert len(record["objective_results"]) == len(rows)
    for entry in record["objective_results"]:
        assert entry["ok"] and entry["detected"] and entry["diagnosed_as"] == entry["expected"]


def test_a_pattern_not_named_or_not_run_fails_the_command(outputs, rows):
    """A step whose gradient is another pattern's is misnamed (MISMATCH); one that did not run
    fails by name (STEP_FAILED when nothing else is wrong)."""
    runs = objective_runs(("jax",), ["shifted-aux-count", "aux-coefficient-twice"])
    shifted, twice = runs[0], runs[-1]
    misnamed = judge_objective(shifted, outputs[twice])  # λ² z_loss, labelled shifted(mtp)
    assert misnamed.detected and not misnamed.ok
    assert misnamed.diagnosed_as == "aux-coefficient-twice(z_loss)"
    run = CatalogueRun(results=[], skews=[], minimum_skew={}, objectives=[*rows, misnamed])
    assert not run.ok and catalogue_exit_code(run) == exit_codes.MISMATCH
    crashed = judge_objective(shifted, RuntimeError("rank 1 died"))
    assert not crashed.ok and "rank 1 died" in crashed.error and math.isinf(crashed.pattern_error)
    run = CatalogueRun(results=[], skews=[], minimum_skew={}, objectives=[*rows, crashed])
    assert catalogue_exit_code(run) == exit_codes.STEP_FAILED
    console = Console(file=io.StringIO(), width=200, color_system=None)
    print_catalogue(console, run)
    assert "did not run" in console.file.getvalue() and "rank 1 died" in console.file.getvalue()


def test_bugs_accepts_the_objective_pattern_names_and_refuses_unknown_ones():
    with pytest.raises(ValueError, match="aux-coefficient-twice"):
        run_catalogue(patterns=["no-such-pattern"])
