"""The plan of `crosscheck run`: nothing dropped silently, nothing passed having checked nothing.

A plan that runs no case, or names on the command line a value that runs in no case (a world
size that divides no fixture's rows, a strategy or dtype an implementation does not run), is
refused before any process starts, with one line that says why. What the default matrix's
product legitimately leaves out is counted by reason and listed in the JSON. After the run,
every planned case, resume case and oracle row that a runner never reported fails by name.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
from case_fields import case_fields, make_case
from json_keys import SKIP_KEYS

import crosscheck.run.matrix as matrix
from crosscheck import builtin_fixture
from crosscheck.cli.commands import main
from crosscheck.cli.report import summary_lines, write_json
from crosscheck.contract.cases import Case, SkippedCase
from crosscheck.contract.schemes import SCHEMES, resolve_scheme
from crosscheck.run import jax_runner, torch_runner
from crosscheck.run.implementations import IMPLEMENTATIONS
from crosscheck.run.matrix import NEVER_REPORTED, run_matrix
from crosscheck.run.plan import Plan, PlanError
from crosscheck.run.rows import failed_case, missing_rows


def run_cli(*argv: str) -> tuple[int, str]:
    """`crosscheck run ARGV` in this process: (exit status, everything it printed)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["run", *argv])
    return code, out.getvalue()


def refused_cli(*argv: str) -> tuple[int, str]:
    """A refused `crosscheck run ARGV` in this process: (exit status, what it printed on
    stderr); stdout, where results go, holds nothing."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["run", *argv])
    assert out.getvalue() == "", out.getvalue()
    return code, err.getvalue()


@pytest.fixture
def no_process_may_start(monkeypatch):
    """A refused plan must be refused before the matrix starts a job."""

    def refuse(*args, **kwargs):
        raise AssertionError("a refused plan started the run")

    monkeypatch.setattr("crosscheck.cli.commands.run_matrix", refuse)
    monkeypatch.setattr(matrix, "run_jobs", refuse)


# --- refused plans ------------------------------------------------------------------------


def test_world_size_3_on_seed_exits_2_naming_the_fixture_its_rows_and_the_layouts():
    completed = subprocess.run(
        [sys.executable, "-m", "crosscheck", "run", "--world-sizes", "3", "--fixtures", "seed"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 2, completed.stdout + completed.stderr
    assert completed.stdout == ""  # refused before the seed table, before any run
    assert completed.stderr.splitlines() == [
        "crosscheck run: nothing to run: fixture seed has 2 rows, which none of the layouts "
        "asked for divides: R x M = 3 x 1, 3 x 2 (world sizes 3; accum steps 1, 2), nor the "
        "world-size-change layouts 1 x 4, 2 x 2, 4 x 1 (also in no case: world size 3)"
    ]


def test_an_explicit_unsupported_combination_exits_2_naming_it(no_process_may_start):
    code, out = refused_cli("--impls", "torch-fsdp2", "--strategies", "postnorm")
    assert code == 2
    assert out.count("\n") == 1, out  # one line
    assert out.startswith("crosscheck run: nothing to run: torch-fsdp2 runs in no case")
    assert "FSDP2 has no comm hook, so postnorm does not run there" in out
    assert "(also in no case: strategy postnorm)" in out


def test_a_named_value_that_runs_nowhere_is_refused_even_when_others_run(no_process_may_start):
    # torch-ddp runs postnorm; torch-fsdp2, named explicitly, would run nothing.
    code, out = refused_cli("--impls", "torch-ddp,torch-fsdp2", "--strategies", "postnorm")
    assert code == 2
    assert out.startswith("crosscheck run: torch-fsdp2 runs in no case of this plan: FSDP2")


def test_a_dtype_an_implementation_does_not_run_is_refused(no_process_may_start):
    code, out = refused_cli("--impls", "oracle", "--dtypes", "float32")
    assert code == 2
    assert out.strip() == (
        "crosscheck run: dtype float32 runs in no case of this plan: the oracle runs in "
        "float64 only"
    )


@pytest.mark.parametrize("runner", [torch_runner, jax_runner])
def test_each_runner_says_why_it_does_not_run_a_dtype(runner):
    impl = "torch-ddp" if runner is torch_runner else "jax-pmap"
    case = make_case(impl=impl, accum_steps=1, dtype="float16")
    assert "not float16" in runner.why_unsupported(case)
    assert runner.supports(case) is False
    assert runner.why_unsupported(Case(**{**_fields(case), "dtype": "float64"})) == ""


def test_a_plan_with_an_unsupported_named_dtype_is_refused(monkeypatch):
    # A runner that does not run float32 (today both do; the refusal must not depend on
    # which dtypes happen to be missing): jax-pmap is named with --dtypes float32.
    real = jax_runner.why_unsupported

    def no_float32(case: Case) -> str:
        return "this JAX build runs float64 only" if case.dtype == "float32" else real(case)

    monkeypatch.setattr(jax_runner, "why_unsupported", no_float32)
    plan = Plan(
        impls=["jax-pmap"],
        dtypes=["float32"],
        resume=False,  # resume rows run float64 whatever the plan's dtypes
        explicit=frozenset({"impls", "dtypes"}),
    )
    with pytest.raises(PlanError) as refused:
        plan.build()
    assert str(refused.value) == (
        "nothing to run: jax-pmap runs in no case of this plan: this JAX build runs float64 "
        "only (also in no case: dtype float32)"
    )


def test_a_plan_that_runs_nothing_is_refused_even_when_nothing_was_named():
    plan = Plan(fixtures=["seed"], world_sizes=[3], resume_fixtures=["seed"])
    with pytest.raises(PlanError, match=r"^nothing to run: fixture seed has 2 rows"):
        plan.build()


def test_an_empty_list_is_refused():
    with pytest.raises(ValueError, match="the plan names no fixtures"):
        Plan(fixtures=[]).build()
    code, out = refused_cli("--impls", ",")
    assert code == 2 and "the plan names no impls" in out


# --- what the product leaves out: counted, listed, not refused ---------------------------


def _fields(case: Case) -> dict:
    return {name: getattr(case, name) for name in Case.__dataclass_fields__}


def test_the_default_plan_builds_and_lists_every_skip_with_its_reason():
    plan = Plan()
    build = plan.build()  # not refused: its skips are the product's, not asked for
    assert build.cases == plan.cases()
    # Nothing dropped: every combination of the product either runs or is listed, once.
    # The product: fixtures x schemes, and contract v2's spec_fixtures x spec_schemes.
    assert plan.spec_modes and len(plan.pairs()) == len(plan.fixtures) * len(plan.schemes) + len(
        plan.spec_fixtures
    ) * len(plan.spec_schemes)
    product = sum(
        len(plan.wanted_layouts())
        # a spec runs both strategies, local or not; an accidental v1 scheme is one loop
        * (len(plan.strategies) if resolve_scheme(s).intended or s not in SCHEMES else 1)
        * len(plan.dtypes)
        for impl in IMPLEMENTATIONS
        for _, s in plan.pairs()
    )
    vs_oracle = [s for s in build.skipped if s.check == "vs-oracle"]
    assert len(build.cases) + len(vs_oracle) == product
    as_cases = {
        Case(**{k: v for k, v in s.to_json().items() if k in Case.__dataclass_fields__})
        for s in vs_oracle
    }
    assert len(as_cases) == len(vs_oracle) and not as_cases & set(build.cases)
    for skip in build.skipped:
        assert set(skip.to_json()) == SKIP_KEYS and skip.reason, skip
    reasons = Counter(s.reason for s in build.skipped)
    fsdp2 = "FSDP2 has no comm hook, so postnorm does not run there: torch-fsdp2 runs precount"
    mean_loss = "the torch mean-loss loop is rank_mean only at M = 1 (at M > 1 microbatch_mean)"
    assert reasons[fsdp2] > 0 and reasons[mean_loss] > 0
    assert reasons["seed has 2 rows, not divisible by R x M"] > 0
    # Which cases each reason covers, checked on the skips themselves.
    assert all(
        s.impl == "torch-fsdp2" and s.strategy == "postnorm"
        for s in build.skipped
        if s.reason == fsdp2
    )
    assert all(
        s.impl.startswith("torch") and s.scheme == "rank_mean" and s.accum_steps > 1
        for s in build.skipped
        if s.reason == mean_loss
    )


@pytest.mark.parametrize(
    ("world_sizes", "accum_steps"), [([1, 2, 4], [1, 2]), ([1, 2, 3, 4, 8], [1, 2, 3, 4])]
)
def test_the_oracle_gets_exactly_the_layouts_each_fixture_can_take(world_sizes, accum_steps):
    """Every oracle layout of the plan lays its fixture out, and every asked-for (R, M) that
    lays it out is there: judged by the fixture's own `layout`, not by the plan's rule."""
    plan = Plan(world_sizes=world_sizes, accum_steps=accum_steps, resume=False)
    build = plan.build()
    assert set(build.oracle_layouts) == set(plan.fixtures) | set(plan.spec_fixtures)
    for name, layouts in build.oracle_layouts.items():
        fixture = builtin_fixture(name)
        takes = set()
        for R, M in itertools.product(world_sizes, accum_steps):
            with contextlib.suppress(ValueError):
                fixture.layout(R, M)
                takes.add((R, M))
        assert sorted(layouts) == sorted(takes), (name, layouts, takes)


def test_the_summary_line_and_the_json_count_the_skips_by_reason(tmp_path: Path):
    build = Plan().build()
    line, time_line, verdict = summary_lines([], 1.0, build.skipped)
    assert f"{len(build.skipped)} planned combinations not run: " in line
    counts = Counter(s.reason for s in build.skipped)
    for reason, count in counts.items():
        assert f"{count} {reason}" in line
    assert time_line == "wall time 1.0 s"
    assert "FAILED: nothing was checked" in verdict  # no rows: a run that checked nothing fails
    # The main job's one-line-per-family output names how many reasons, and where they are.
    brief = summary_lines([], 1.0, build.skipped, reasons=False)[0]
    assert brief == (
        f"{len(build.skipped)} planned combinations not run, for {len(counts)} reasons: see "
        "--rows group or --json"
    )
    out = tmp_path / "run.json"
    write_json(out, [], 1.0, {}, skipped=build.skipped)
    payload = json.loads(out.read_text())
    assert payload["ok"] is False and payload["results"] == []
    assert len(payload["skipped"]) == len(build.skipped)
    assert all(set(record) == SKIP_KEYS for record in payload["skipped"])


def test_defaulted_lists_skip_where_named_lists_refuse():
    # --impls torch-fsdp2 alone: postnorm comes from the default strategies, so its absence
    # is a listed skip, not a refusal.
    build = Plan(impls=["torch-fsdp2"], explicit=frozenset({"impls"})).build()
    assert {c.strategy for c in build.cases} == {"precount"}
    assert any(s.strategy == "postnorm" for s in build.skipped)
    # --world-sizes 3 on the default fixtures: ragged's 144 rows divide, seed's skips listed.
    build = Plan(world_sizes=[3], explicit=frozenset({"world_sizes"})).build()
    assert any(c.fixture == "ragged" and c.world_size == 3 for c in build.cases)
    assert any(s.fixture == "seed" and s.world_size == 3 for s in build.skipped)


def test_a_fixture_the_resume_layouts_do_not_divide_is_listed():
    build = Plan(fixtures=["seed"], resume_fixtures=["seed"], impls=["torch-ddp"]).build()
    resume = [s for s in build.skipped if s.check == "resume"]
    assert not build.resume_cases and resume
    assert all(s.reason.startswith("seed has 2 rows; resume runs R x M = 4") for s in resume)


# --- what never comes back fails, by name -------------------------------------------------

#: torch-ddp at R = 1 on packed: two vs-oracle cases (one to drop, one to report twice) and
#: eight resume cases (four scenarios x two schemes), the smallest real run of both kinds.
DROPPED = make_case(scheme="sequence_mean", world_size=1, accum_steps=1)
DOUBLED = Case(**{**_fields(DROPPED), "scheme": "token_mean"})


@pytest.fixture(scope="module")
def dropping_run(tmp_path_factory):
    """`crosscheck run` with the real torch runner, whose reports are filtered on their way
    back: one case dropped, one reported twice, one resume case dropped. What is under test is
    the harness's bookkeeping, so the runner's work stays real."""
    real_jobs, real_resume = torch_runner.jobs, torch_runner.run_resume
    dropped_resume: list = []

    def jobs(cases, settings, on_done):
        def filtered(case, result):
            if case == DROPPED:
                return
            on_done(case, result)
            if case == DOUBLED:
                on_done(case, result)

        return real_jobs(cases, settings, filtered)

    def run_resume(cases, settings, on_done):
        def filtered(case, result):
            if not dropped_resume:
                dropped_resume.append(case)
                return
            on_done(case, result)

        real_resume(cases, settings, filtered)

    out = tmp_path_factory.mktemp("dropping") / "run.json"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch_runner, "jobs", jobs)
        patch.setattr(torch_runner, "run_resume", run_resume)
        code, printed = run_cli(
            *("--impls", "torch-ddp", "--fixtures", "packed"),
            *("--schemes", "token_mean,sequence_mean", "--strategies", "precount"),
            *("--world-sizes", "1", "--accum-steps", "1", "--no-world-size-change"),
            *("--json", str(out)),
        )
    return code, printed, json.loads(out.read_text()), dropped_resume


def test_a_case_its_runner_never_reports_fails_the_run(dropping_run):
    code, printed, payload, _ = dropping_run
    assert code == 1 and payload["ok"] is False
    assert "FAILED" in printed and "never reported" in printed
    vs_oracle = [r for r in payload["results"] if r["check"] == "vs-oracle"]
    dropped = [r for r in vs_oracle if r["scheme"] == "sequence_mean"]
    assert len(dropped) == 1 and dropped[0]["ok"] is False
    assert dropped[0]["detail"] == NEVER_REPORTED
    assert dropped[0]["max_rel_err"] is None  # inf in the row: JSON null


def test_a_case_reported_twice_fails_and_keeps_its_first_row(dropping_run):
    _, _, payload, _ = dropping_run
    rows = [
        r for r in payload["results"] if r["check"] == "vs-oracle" and r["scheme"] == "token_mean"
    ]
    assert sorted(r["ok"] for r in rows) == [False, True]
    assert [r["detail"] for r in rows if not r["ok"]] == ["reported 2 times by its runner"]
    # The real report was judged as usual: float64 torch matches the oracle to 1e-12 (the
    # contract's float64 tolerance: a handful of reductions, rounding only).
    assert next(r["max_rel_err"] for r in rows if r["ok"]) <= 1e-12


def test_a_resume_case_never_reported_fails_by_name(dropping_run):
    _, _, payload, dropped_resume = dropping_run
    (case,) = dropped_resume
    resume = [r for r in payload["results"] if r["check"] == "resume"]
    assert len(resume) == 8  # four scenarios x two schemes, one strategy: none missing
    failing = [r for r in resume if not r["ok"]]
    assert len(failing) == 1 and failing[0]["detail"] == NEVER_REPORTED
    resumed_at = f"R={case.resume_world_size},M={case.resume_accum_steps}"
    assert failing[0]["strategy"].endswith(resumed_at)
    assert all(r["ok"] for r in resume if r is not failing[0])


def test_oracle_rows_that_never_come_back_fail(monkeypatch):
    real = matrix._oracle_rows

    def drop_last(plan, layouts):
        return real(plan, layouts)[:-1]

    monkeypatch.setattr(matrix, "_oracle_rows", drop_last)
    plan = Plan(impls=["oracle"], fixtures=["packed"], schemes=list(SCHEMES))
    run = run_matrix(plan)
    failing = [r for r in run.rows if not r.ok]
    assert len(failing) == 1 and failing[0].detail == NEVER_REPORTED
    assert failing[0].impl == "oracle" and failing[0].check == "clipping"


def test_missing_rows_counts_each_key_and_tells_context_layouts_apart():
    """Every family's bookkeeping: a planned row is answered by one row of its key (what it is
    about, never what it found), a key planned twice needs two rows, and a context-parallel
    row's C and order are part of its key."""
    case = make_case(world_size=2, accum_steps=1)
    planned = failed_case(case, NEVER_REPORTED)
    answered = replace(planned, max_rel_err=1e-16, ok=True, detail="", not_run=False)
    assert missing_rows([planned], [answered]) == []
    assert missing_rows([planned, planned], [answered]) == [planned]
    assert missing_rows([planned], []) == [planned]
    split = replace(planned, extra={"context_size": 2, "context_order": "zigzag"})
    other = replace(planned, extra={"context_size": 2, "context_order": "contiguous"})
    assert missing_rows([split], [other]) == [split]
    # What a row found (its error, verdict, detail, other extras) does not name it.
    found = replace(split, extra={**split.extra, "grad_rel_err": 0.0})
    assert missing_rows([split], [replace(found, ok=True)]) == []


def test_an_oracle_that_raises_fails_every_oracle_row_with_the_error(monkeypatch):
    def broken(plan, layouts):
        raise FloatingPointError("0/0 in the oracle")

    monkeypatch.setattr(matrix, "_oracle_rows", broken)
    run = run_matrix(Plan(impls=["oracle"], fixtures=["packed"], schemes=["token_mean"]))
    assert run.rows and not any(r.ok for r in run.rows)
    assert {r.check for r in run.rows} == {"layout-invariance", "clipping"}
    assert all("FloatingPointError: 0/0 in the oracle" in r.detail for r in run.rows)


def test_skipped_case_json_round_trips():
    fields = case_fields(impl="torch-fsdp2", strategy="postnorm", accum_steps=1)
    skip = SkippedCase(check="vs-oracle", reason="r", **fields)
    assert SkippedCase(**json.loads(json.dumps(skip.to_json()))) == skip


def test_a_parameterized_scheme_is_refused_not_dropped():
    code, out = refused_cli("--schemes", "constant:1000", "--impls", "oracle")
    assert code == 2
    assert "'constant:1000' carries a parameter the implementations would not receive" in out
