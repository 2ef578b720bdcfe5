"""`python -m crosscheck bugs`: every BUGS.md pattern reproduced in torch and JAX, detected by
verification and named by the diagnosis, on at least two fixtures each; a 1% rank skew is
flagged at float64 and float32."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict

import pytest
from bug_outputs import catalogue_outputs

from crosscheck.bugs import SKEW, minimum_detectable_skew, run_catalogue
from crosscheck.patterns import PATTERNS

RESULT_KEYS = {
    "pattern",
    "framework",
    "fixture",
    "detected",
    "diagnosed_as",
    "weight_ratio",
    "scale",
}


@pytest.fixture(scope="module")
def report():
    """The whole catalogue, judged from the session's one run of every buggy step."""
    return run_catalogue(outputs=catalogue_outputs()).to_json()


def test_cli_runs_the_catalogue_and_writes_the_documented_json(tmp_path):
    path = tmp_path / "bugs.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "crosscheck",
            "bugs",
            "--patterns",
            "rank-mean,double-reduce-count",
            "--json",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "bug catalogue" in proc.stdout and "detected and named" in proc.stdout
    data = json.loads(path.read_text())
    assert data["ok"] is True
    assert {(r["pattern"], r["framework"]) for r in data["results"]} == {
        (p, fw) for p in ("rank-mean", "double-reduce-count") for fw in ("torch", "jax")
    }
    for record in data["results"]:
        assert set(record) >= RESULT_KEYS, record


def test_every_pattern_is_detected_and_named(report):
    assert report["ok"] is True, [r for r in report["results"] if not r["ok"]][:3]


def test_every_pattern_in_both_frameworks_on_two_fixtures(report):
    data = report
    fixtures = defaultdict(set)
    for record in data["results"]:
        assert set(record) >= RESULT_KEYS, record
        assert record["detected"] is True, record
        assert record["diagnosed_as"] == record["pattern"], record
        fixtures[record["pattern"], record["framework"]].add(record["fixture"])
    for pattern in PATTERNS.values():
        for framework in pattern.frameworks:
            assert len(fixtures[pattern.id, framework]) >= 2, (pattern.id, framework)


def test_rank_mean_on_seed_is_nine(report):
    data = report
    seed = [r for r in data["results"] if r["pattern"] == "rank-mean" and r["fixture"] == "seed"]
    assert len(seed) == 2
    for record in seed:
        assert abs(record["weight_ratio"] - 9.0) <= 1e-9


def test_scale_patterns_report_their_scale(report):
    data = report
    for record in data["results"]:
        R, M = record["world_size"], record["accum_steps"]
        expected = {
            "missing-world-size": 1 / R,
            "double-reduce-count": 1 / R,
            "double-world-size": R,
            "double-accum-scale": M,
            "stale-count": 0.5,
        }.get(record["pattern"])
        if expected is not None:
            assert abs(record["scale"] / expected - 1) <= 1e-12, record
            assert abs(record["weight_ratio"] - 1.0) <= 1e-9, record


def test_one_percent_skew_is_flagged_in_both_dtypes(report):
    data = report
    skew = data["skew"]
    runs = skew["runs"]
    assert {(r["framework"], r["dtype"]) for r in runs if r["skew"] == SKEW} == {
        (fw, dt) for fw in ("torch", "jax") for dt in ("float64", "float32")
    }
    for dtype in ("float64", "float32"):
        minimum = skew["minimum_detectable"][dtype]
        assert minimum == minimum_detectable_skew(dtype)
        assert 1.0 < minimum < SKEW
        # Real runs bracket it: half its distance from 1 passes, twice it is flagged.
        for record in (r for r in runs if r["dtype"] == dtype):
            assert record["flagged"] is (record["skew"] > minimum), record
            assert record["flagged"] is record["expected"], record
