"""`python -m crosscheck run` end to end: every implementation, real processes, one fixture.

One run of the CLI on `packed` (the default matrix covers every fixture; `make demo` runs it)
through torch DDP and FSDP2 process groups, the JAX worker (pmap, shard_map, jit) and
jax.distributed processes, with resume and world-size-change rows. The JSON, the per-update
log and the plot are checked against the documented contract.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from json_keys import CASE_KEYS, LOG_KEYS, RESULT_KEYS, SKIP_KEYS

from crosscheck.run.implementations import IMPLEMENTATIONS


@pytest.fixture(scope="module")
def run_output(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    command = [
        sys.executable,
        "-m",
        "crosscheck",
        "run",
        "--fixtures",
        "packed",
        "--schemes",
        "token_mean,sequence_mean,rank_mean,microbatch_mean",
        "--world-sizes",
        "1,2",
        "--accum-steps",
        "1,2",
        "--json",
        str(out / "run.json"),
        "--log",
        str(out / "updates.jsonl"),
        "--plot",
        str(out / "weights.png"),
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600)
    return completed, out


def test_run_exits_zero_and_prints_the_table(run_output):
    completed, _ = run_output
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    assert "9.0x" not in completed.stdout  # seed is not in this run: no seed table
    assert "wall time" in completed.stdout and "OK" in completed.stdout
    assert ", CPU " in completed.stdout  # the CPU seconds beside the wall time


def test_json_has_the_documented_keys_and_every_check(run_output):
    _, out = run_output
    payload = json.loads((out / "run.json").read_text())
    assert payload["ok"] is True and payload["wall_s"] > 0
    # Every rank and worker's CPU too, so more than the harness process alone could use.
    assert isinstance(payload["cpu_s"], float) and payload["cpu_s"] > 0
    assert payload["plan"]["explicit"] == ["accum_steps", "fixtures", "schemes", "world_sizes"]
    rows = payload["results"]
    for row in rows:
        assert set(row) >= RESULT_KEYS, set(RESULT_KEYS) - set(row)
        assert row["ok"] is True, row
        assert row["max_rel_err"] is not None  # never NaN/inf in a passing row
    checks = {row["check"] for row in rows}
    assert checks == {
        "layout-invariance",
        "clipping",
        "vs-oracle",
        "cross-impl",
        "world-size-change",
        "resume",
    }
    impls = {row["impl"] for row in rows if row["check"] == "vs-oracle"}
    assert impls == set(IMPLEMENTATIONS)
    # float64 everywhere: every implementation matches the oracle to 1e-12.
    assert max(r["max_rel_err"] for r in rows if r["check"] == "vs-oracle") <= 1e-12


def test_combinations_not_run_are_counted_and_listed_with_their_reasons(run_output):
    completed, out = run_output
    payload = json.loads((out / "run.json").read_text())
    skipped = payload["skipped"]
    for record in skipped:
        assert set(record) == SKIP_KEYS and record["reason"], record
    reasons = {record["reason"] for record in skipped}
    # The default implementations' products that do not exist, each with its own reason.
    assert {
        "FSDP2 has no comm hook, so postnorm does not run there: torch-fsdp2 runs precount",
        "the torch mean-loss loop is rank_mean only at M = 1 (at M > 1 microbatch_mean)",
        "jax-jit is a global view: there is no per-rank mean to take by accident",
        "jax-multiprocess runs world sizes 2 and 4, not 1",
    } <= reasons
    assert f"{len(skipped)} planned combinations not run, for {len(reasons)} reasons" in (
        completed.stdout
    )
    # Skipped means not run: none of them came back as a row.
    rows = {
        tuple(row[key] for key in CASE_KEYS)
        for row in payload["results"]
        if row["check"] == "vs-oracle"
    }
    assert not [r for r in skipped if tuple(r[key] for key in CASE_KEYS) in rows]


def test_accidental_rows_show_their_deviation(run_output):
    _, out = run_output
    rows = json.loads((out / "run.json").read_text())["results"]
    accidental = [r for r in rows if r["check"] == "vs-oracle" and r["scheme"] == "rank_mean"]
    assert accidental and all(r["deviation"] > 1e-3 for r in accidental if r["world_size"] > 1)
    frameworks = {r["impl"].split("-")[0] for r in accidental}
    assert frameworks == {"jax", "torch"}


def test_resume_rows_cover_both_frameworks_mid_window_and_world_size_change(run_output):
    _, out = run_output
    rows = [r for r in json.loads((out / "run.json").read_text())["results"]]
    resume = [r for r in rows if r["check"] == "resume"]
    for impl in ("torch-ddp", "jax-pmap"):
        mine = [r["strategy"] for r in resume if r["impl"] == impl]
        assert any("+1mb" in s for s in mine), impl  # stopped inside an accumulation window
        assert any("-> R=4,M=1" in s for s in mine), impl  # resumed at another world size
        assert any("-> R=1,M=4" in s for s in mine), impl
    assert max(r["max_rel_err"] for r in resume) <= 1e-12


def test_update_log_has_one_record_per_rank_per_update(run_output):
    _, out = run_output
    records = [json.loads(line) for line in (out / "updates.jsonl").read_text().splitlines()]
    assert records
    for record in records:
        assert set(record) >= LOG_KEYS
    torch_r2 = [
        r
        for r in records
        if r["impl"] == "torch-ddp"
        and r["world_size"] == 2
        and r["accum_steps"] == 1
        and r["scheme"] == "token_mean"
        and r["strategy"] == "precount"
    ]
    assert sorted((r["update"], r["rank"]) for r in torch_r2) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # The same global denominator on every rank; the ranks' counts add up to it.
    first = [r for r in torch_r2 if r["update"] == 0]
    assert first[0]["denominator"] == first[1]["denominator"]
    assert first[0]["valid_tokens"] + first[1]["valid_tokens"] == first[0]["denominator"]


def test_plot_is_written(run_output):
    _, out = run_output
    png = (out / "weights.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
