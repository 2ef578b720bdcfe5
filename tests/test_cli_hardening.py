"""The command line under bad input, faults and signals (issue 13): exit codes, one-line set-up
errors before any work, non-finite gradients reported by where they are, the export that
never mixes into other files, interrupts that leave no process, tables at 80 columns, and an
import that changes nothing global.

Every test asserts the outcome (exit status, files, processes) and the message.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
from case_fields import case_fields
from child_env import run_cli
from rich.console import Console

from crosscheck import exit_codes
from crosscheck.bugs.catalogue_run import BugResult, CatalogueRun, SkewResult
from crosscheck.cli.bug_report import catalogue_exit_code, print_catalogue
from crosscheck.cli.commands import main
from crosscheck.cli.report import print_results, print_skipped, run_exit_code
from crosscheck.cli.verify_report import print_verify_table, verify_exit_code
from crosscheck.contract.cases import CaseResult, SkippedCase
from crosscheck.contract.oracle import loss_and_grad
from crosscheck.contract.schemes import SCHEMES, get_scheme
from crosscheck.diagnosis.diagnose import MAX_GRADIENT_MAGNITUDE, diagnose
from crosscheck.diagnosis.patterns import PATTERNS, BugRun
from crosscheck.fixtures.builtin import BUILTIN_FIXTURES, builtin_fixture
from crosscheck.fixtures.vectors import MANIFEST_NAME, export_vectors
from crosscheck.verification.protocol import StepError, VerifyJob, VerifyOutput
from crosscheck.verification.verifier import (
    FRAMEWORKS,
    StepSetupError,
    VerifyReport,
    judge,
    verify,
)

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
#: Inherited by everything a CLI run of these tests starts: how the tests find its processes.
MARKER = "GRADWEIGHT_TEST_MARKER"
ELLIPSIS = "\u2026"


def _cli(*argv: str, cwd: Path = ROOT, env: dict | None = None, timeout: float = 120):
    return run_cli(*argv, cwd=cwd, env=env, timeout=timeout)


def _main(capsys, *argv: str) -> tuple[int, list[str]]:
    """`crosscheck ARGV` in this process: its exit status and the lines it printed."""
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, (captured.out + captured.err).strip().splitlines()


def _refused(capsys, *argv: str) -> tuple[int, list[str]]:
    """A refused `crosscheck ARGV` in this process: its exit status and the lines it printed
    on stderr; stdout, where results go, holds nothing."""
    code = main(list(argv))
    captured = capsys.readouterr()
    assert captured.out == "", (argv, captured.out)
    return code, captured.err.splitlines()


def _marked(marker: str) -> list[tuple[int, str]]:
    """Live processes (zombies are gone) whose environment holds MARKER=marker."""
    needle = f"{MARKER}={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            if (entry / "stat").read_text().rsplit(")", 1)[-1].split()[0] == "Z":
                continue
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # exited while we looked
            continue
        found.append((int(entry.name), command))
    return found


def _kill_marked(marker: str) -> None:
    for pid, _ in _marked(marker):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def unwritable_dir(tmp_path: Path) -> Path:
    """A directory in which this user cannot create a file.

    Permission bits stop a normal user; they do not stop root (these tests run as root in
    CI containers), so there /sys is used: sysfs refuses new files even to root.
    """
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        for candidate in (folder, Path("/sys")):
            try:
                with tempfile.TemporaryFile(dir=candidate):
                    pass
            except OSError:
                yield candidate
                return
        pytest.skip("no directory here refuses new files to this user")
    finally:
        folder.chmod(0o755)


# ---- exit codes ------------------------------------------------------------------------------


def _report(outcomes: list[VerifyOutput | BaseException]) -> VerifyReport:
    jobs = [VerifyJob(fixture="packed", world_size=2, accum_steps=m) for m in (1, 2, 4)]
    scheme = get_scheme("token_mean")
    cases = [judge(job, scheme, out) for job, out in zip(jobs, outcomes, strict=True)]
    return VerifyReport(
        framework="torch", step="m:step", scheme=get_scheme("token_mean"), cases=cases
    )


def _grads(scheme: str, M: int) -> VerifyOutput:
    return VerifyOutput(loss_and_grad(builtin_fixture("packed"), scheme, 2, M).grads)


def test_verify_exit_codes_tell_a_mismatch_from_a_step_that_could_not_run():
    assert (exit_codes.OK, exit_codes.MISMATCH, exit_codes.SETUP_ERROR) == (0, 1, 2)
    assert (exit_codes.STEP_FAILED, exit_codes.INTERRUPTED) == (3, 130)
    good = [_grads("token_mean", m) for m in (1, 2, 4)]
    assert verify_exit_code(_report(good)) == exit_codes.OK
    crashed = StepError("packed R=2 M=4: rank 1: ValueError: boom")
    assert verify_exit_code(_report([*good[:2], crashed])) == exit_codes.STEP_FAILED
    # A mismatch wins over a crash.
    mismatched = [good[0], _grads("microbatch_mean", 2), crashed]
    assert verify_exit_code(_report(mismatched)) == exit_codes.MISMATCH


def _bug(pattern: str, diagnosed: str, error: str = "") -> BugResult:
    run = BugRun(pattern=pattern, framework="torch", fixture="packed", world_size=2, accum_steps=2)
    return BugResult(
        run=run,
        detected=not error,
        diagnosed_as=diagnosed,
        weight_ratio=2.0,
        scale=1.0,
        intended_error=0.1,
        explanation="",
        error=error,
    )


def test_bugs_exit_3_only_when_every_failure_is_a_step_that_did_not_run():
    named = _bug("rank-mean", "rank-mean")
    crashed = _bug("stale-count", "-", error="LaunchError: worker 0 died")
    misnamed = _bug("stale-count", "scale")
    skew = BugRun(
        pattern="rank-skew", framework="jax", fixture="ragged", world_size=2, accum_steps=1
    )
    no_minimum = SkewResult(skew, 0.1, True, "float64", "rank-skew", math.nan)
    assert catalogue_exit_code(CatalogueRun([named], [], {})) == exit_codes.OK
    assert catalogue_exit_code(CatalogueRun([named, crashed], [], {})) == exit_codes.STEP_FAILED
    # A skew run left without its measured minimum failed because its correct run crashed.
    assert catalogue_exit_code(CatalogueRun([crashed], [no_minimum], {})) == 3
    assert catalogue_exit_code(CatalogueRun([crashed, misnamed], [], {})) == exit_codes.MISMATCH


def _row(ok: bool, not_run: bool = False) -> CaseResult:
    return CaseResult(
        **case_fields(accum_steps=1),
        check="vs-oracle",
        max_rel_err=0.0 if ok else math.inf,
        ok=ok,
        reference="oracle",
        not_run=not_run,
    )


def test_run_exits_3_only_when_every_failing_row_could_not_be_run():
    passed, crashed, mismatched = _row(True), _row(False, not_run=True), _row(False)
    assert run_exit_code([passed]) == exit_codes.OK
    assert run_exit_code([passed, crashed]) == exit_codes.STEP_FAILED
    assert run_exit_code([passed, crashed, mismatched]) == exit_codes.MISMATCH
    assert run_exit_code([]) == exit_codes.MISMATCH  # a run that checked nothing has not passed


def test_a_run_whose_implementation_times_out_exits_3_and_says_so(capsys, monkeypatch, tmp_path):
    """A real torch launch that ends at its timeout: its rows could not be run (exit 3), and
    the summary counts them apart from mismatches."""
    from crosscheck.run import torch_runner

    # Far below the launch's start-up (about 0.1 s from a warm zygote, 2 s cold): every
    # launch of this run times out; its ranks are stopped by the launcher.
    monkeypatch.setattr(torch_runner, "LAUNCH_TIMEOUT_S", 0.01)
    report = tmp_path / "run.json"
    code, lines = _main(
        capsys,
        *("run", "--impls", "torch-ddp", "--fixtures", "packed", "--schemes", "token_mean"),
        *("--strategies", "precount", "--world-sizes", "2", "--accum-steps", "1", "--no-resume"),
        *("--no-world-size-change", "--json", str(report)),
    )
    assert code == exit_codes.STEP_FAILED, lines
    rows = json.loads(report.read_text())["results"]
    failing = [r for r in rows if not r["ok"]]
    assert [(r["impl"], r["not_run"]) for r in failing] == [("torch-ddp", True)]
    assert "LaunchTimeoutError" in failing[0]["detail"]
    assert all(r["impl"] == "oracle" for r in rows if r["ok"])
    assert any(line.startswith("NOT RUN vs-oracle torch-ddp packed/token_mean") for line in lines)
    assert lines[-1] == "FAILED: 1 of 1 row failed, 1 of them could not run"


# ---- set-up errors: one line, exit 2, before any work ----------------------------------------


@pytest.fixture
def no_work_may_start(monkeypatch):
    """A refused command must be refused before any run, catalogue, export or verify starts."""

    def refuse(*args, **kwargs):
        raise AssertionError("a refused command started its work")

    monkeypatch.setattr("crosscheck.cli.commands.run_matrix", refuse)
    monkeypatch.setattr("crosscheck.bugs.catalogue_run.run_catalogue", refuse)
    monkeypatch.setattr("crosscheck.fixtures.vectors.export_vectors", refuse)
    monkeypatch.setattr("crosscheck.cli.verify_report.verify", refuse)


def test_output_paths_are_checked_before_any_work(
    capsys, tmp_path, unwritable_dir, no_work_may_start
):
    # Nobody, root included, can create anything under a regular file: the way to test a
    # missing parent that cannot be created whoever runs the tests.
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    run = ("run", "--impls", "oracle", "--fixtures", "seed", "--no-resume")
    cases = [
        (
            [*run, "--json", str(afile / "out.json")],
            f"crosscheck run: --json {afile}/out.json cannot be written: {afile} is a file, "
            "not a directory",
        ),
        (
            [*run, "--log", str(unwritable_dir / "new" / "log.jsonl")],
            f"crosscheck run: --log {unwritable_dir}/new/log.jsonl cannot be written: "
            f"{unwritable_dir}/new does not exist and cannot be created in {unwritable_dir} "
            "(Permission denied)",
        ),
        (
            [*run, "--plot", str(unwritable_dir / "weights.png")],
            f"crosscheck run: --plot {unwritable_dir}/weights.png cannot be written: no file "
            f"can be created in {unwritable_dir} (Permission denied)",
        ),
        (
            [*run, "--json", str(tmp_path)],
            f"crosscheck run: --json {tmp_path} cannot be written: it is a directory",
        ),
        (
            ["bugs", "--json", str(afile / "sub" / "bugs.json")],
            f"crosscheck bugs: --json {afile}/sub/bugs.json cannot be written: {afile} is a "
            "file, not a directory",
        ),
        (
            [
                "verify",
                "--framework",
                "torch",
                "--step",
                "examples.torch_nanogpt:step",
                "--scheme",
                "token_mean",
                "--json",
                str(unwritable_dir / "verify.json"),
            ],
            f"crosscheck verify: --json {unwritable_dir}/verify.json cannot be written: no "
            f"file can be created in {unwritable_dir} (Permission denied)",
        ),
        (
            ["export-vectors", str(afile / "vectors")],
            f"crosscheck export-vectors: {afile}/vectors cannot be written: {afile} is a "
            "file, not a directory",
        ),
        (
            ["export-vectors", str(unwritable_dir / "vectors")],
            f"crosscheck export-vectors: {unwritable_dir}/vectors cannot be written: "
            f"{unwritable_dir}/vectors does not exist and cannot be created in "
            f"{unwritable_dir} (Permission denied)",
        ),
    ]
    for argv, line in cases:
        code, lines = _refused(capsys, *argv)
        assert code == exit_codes.SETUP_ERROR, (argv, lines)
        assert lines == [line], argv
    assert afile.read_text() == "not a directory"
    assert {p.name for p in tmp_path.iterdir()} <= {"afile", "read-only"}  # nothing created


def test_output_directories_that_do_not_exist_yet_are_created(tmp_path, capsys):
    out = tmp_path / "new" / "deeper"
    code, lines = _main(
        capsys,
        *("run", "--impls", "oracle", "--fixtures", "seed", "--no-resume"),
        *("--json", str(out / "run.json"), "--log", str(tmp_path / "logs" / "run.jsonl")),
    )
    assert code == exit_codes.OK, lines
    assert json.loads((out / "run.json").read_text())["ok"] is True
    assert (tmp_path / "logs" / "run.jsonl").exists()
    assert f"wrote 0 per-update records to {tmp_path / 'logs' / 'run.jsonl'}" in lines


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_a_step_that_does_not_exist_is_one_setup_error(framework, tmp_path):
    (tmp_path / "mysteps.py").write_text(
        "import sys\n"
        "NOT_A_FUNCTION = 42\n"
        "def train_step(params, apply_fn, batch, mesh):\n"
        "    pass\n"
        "vars()['dynamic'] = 7  # only importing the module finds this\n"
    )
    base = ["verify", "--framework", framework, "--scheme", "token_mean"]
    expected = {
        "nosuchmodule:step": f"no module named 'nosuchmodule' in {tmp_path} (the current "
        "directory) or on the Python path",
        "mysteps:train_stpe": f"mysteps ({tmp_path}/mysteps.py) has no attribute "
        "'train_stpe'; did you mean train_step?",
        "mysteps:dynamic": f"mysteps:dynamic ({tmp_path}/mysteps.py) is not callable: it is int 7",
    }
    for step, why in expected.items():
        started = time.monotonic()
        proc = _cli(*base, "--step", step, cwd=tmp_path, timeout=60)
        took = time.monotonic() - started
        assert proc.returncode == exit_codes.SETUP_ERROR, proc.stdout + proc.stderr
        # Once, as one line on stderr: never a row per case, never a "does NOT match".
        assert proc.stderr.splitlines() == [f"crosscheck verify: --step {step}: {why}"]
        assert proc.stdout == ""
        assert took < 30, took  # no runner was started (a torch launch alone takes longer)


@pytest.mark.parametrize(
    ("framework", "source", "why"),
    [
        (
            "torch",
            "def step(model, microbatches)\n    pass\n",
            "{dir}/mysteps.py:1: SyntaxError: expected ':'",
        ),
        (
            "jax",
            "def step(model, microbatches):\n    pass\n",
            "step(model, microbatches) cannot take jax's (params, apply_fn, batch, mesh[, "
            "optimizer]): too many positional arguments; it takes torch's (model, "
            "microbatches): --framework torch?",
        ),
        (
            "torch",
            "def step(params, apply_fn, batch, mesh, optimizer=None):\n    return {}\n",
            "step(params, apply_fn, batch, mesh, optimizer=None) cannot take torch's (model, "
            "microbatches[, optimizer]): missing a required argument: 'batch'; it takes jax's "
            "(params, apply_fn, batch, mesh): --framework jax?",
        ),
        (
            "jax",
            "from crosscheck import verify as check\n"
            "def step(params, apply_fn, batch, mesh):\n    return {}\n"
            "if True:\n    check('mysteps:step', framework='jax', scheme='token_mean')\n",
            "{dir}/mysteps.py:5: the module starts a verification when it is imported, and "
            "every process that runs the step imports it: put the call under `if __name__ == "
            '"__main__":`',
        ),
    ],
    ids=["syntax-error", "torch-step-under-jax", "jax-step-under-torch", "verify-at-import"],
)
def test_a_step_that_cannot_run_is_one_setup_error_before_any_process(
    framework, source, why, tmp_path, monkeypatch, capsys
):
    """Read from its source, never run: a syntax error or parameters the framework's call
    cannot bind are refused up front, one line on stderr, exit 2, no runner started."""
    (tmp_path / "mysteps.py").write_text(source)
    monkeypatch.chdir(tmp_path)

    real_import = importlib.import_module

    def no_runner(name, *args, **kwargs):
        if name in FRAMEWORKS.values():
            raise AssertionError(f"the runner {name} was started")
        return real_import(name, *args, **kwargs)

    def no_subprocess(*args, **kwargs):
        raise AssertionError("a subprocess started")

    monkeypatch.setattr(importlib, "import_module", no_runner)
    monkeypatch.setattr("crosscheck.verification.step_check.start_worker", no_subprocess)
    argv = ["verify", "--framework", framework, "--step", "mysteps:step", "--scheme", "token_mean"]
    assert main(argv) == exit_codes.SETUP_ERROR
    out = capsys.readouterr()
    assert out.out == ""
    expected = why.format(dir=tmp_path)
    assert out.err.splitlines() == [f"crosscheck verify: --step mysteps:step: {expected}"]


def test_the_python_api_refuses_a_missing_step_before_any_process(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    def no_runner(*args, **kwargs):
        raise AssertionError("a runner started")

    monkeypatch.setattr("crosscheck.verification.verifier.importlib.import_module", no_runner)
    with pytest.raises(StepSetupError, match=r"--step nosuch\.sub:step: no module named 'nosuch'"):
        verify("nosuch.sub:step", framework="jax", scheme="token_mean")
    assert issubclass(StepSetupError, ValueError)


# ---- a script without its __main__ guard ----------------------------------------------------

#: A torch step with the classic per-microbatch mean: only its name and signature matter here.
MICROBATCH_MEAN_STEP = """
import torch.nn.functional as F


def step(model, microbatches):
    for mb in microbatches:
        logits = model(mb["inputs"])
        loss = F.cross_entropy(logits.flatten(0, 1), mb["targets"].flatten(), ignore_index=-100)
        (loss / len(microbatches)).backward()
"""

#: The newcomer's script: verify called at the top level, with no __main__ guard.
UNGUARDED_SCRIPT = """
import crosscheck


def main():
    return crosscheck.verify("mysteps:step", framework="torch", scheme="token_mean")


report = main()
print("ok =", report.ok)
print(report.message())
"""


def _script(tmp_path: Path, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *argv], cwd=tmp_path, capture_output=True, text=True, timeout=timeout
    )


def test_a_script_without_its_main_guard_verifies_once(tmp_path):
    """The newcomer's script calls verify at its top level, with no guard: the torch ranks start
    from the zygote and never import the calling script again (they import only the step's
    module), so the verification runs once and reports; here the per-microbatch mean fails
    token_mean."""
    (tmp_path / "mysteps.py").write_text(MICROBATCH_MEAN_STEP)
    (tmp_path / "check.py").write_text(UNGUARDED_SCRIPT)
    proc = _script(tmp_path, "check.py", timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "ok = False", proc.stdout
    assert not any(line.startswith("ok =") for line in lines[1:]), proc.stdout
    assert "microbatch" in proc.stdout, proc.stdout  # the diagnosis names the pattern


def test_a_step_module_that_verifies_at_import_is_found_by_its_first_such_line():
    """What `check_step` reads in a step module: the first call to crosscheck's verify that
    runs at import (a class body runs too), never one under a test of __name__ at any depth,
    inside a function, or through a name that is not crosscheck's."""
    from crosscheck.verification.step_check import _verify_call_line

    def line(source: str) -> int | None:
        return _verify_call_line(ast.parse(source))

    assert line("import crosscheck as cc\na = 1\ncc.verify(1)\ncc.verify(2)\n") == 3
    assert line("from crosscheck import assert_weighting\nclass C:\n  assert_weighting(1)\n") == 3
    guarded = "import crosscheck\ntry:\n  if __name__ == '__main__':\n    crosscheck.verify(1)\n"
    assert line(guarded + "except KeyboardInterrupt:\n  pass\n") is None
    assert line("import crosscheck\ndef main():\n  crosscheck.verify(1)\n") is None
    assert line("import ssl\nssl.verify(1)\nfrom other import verify\nverify(2)\n") is None


# ---- a non-finite gradient: a report, not a traceback ----------------------------------------

TORCH_INF_STEP = '''
import torch.distributed as dist
from torch.nn.functional import cross_entropy


def step(model, microbatches):
    """The token mean, plus a term whose derivative in embed[3, 4] is inf."""
    embed = next(p for name, p in model.named_parameters() if name.split(".")[-1] == "embed")
    count = sum(int((b["targets"] != -100).sum()) for b in microbatches)
    for batch in microbatches:
        logits = model(batch["inputs"])
        loss = cross_entropy(
            logits.view(-1, logits.size(-1)), batch["targets"].view(-1), reduction="sum"
        )
        (loss / count + float("inf") * embed[3, 4]).backward()
'''

JAX_INF_STEP = '''
import jax
import jax.numpy as jnp
import optax


def step(params, apply_fn, batch, mesh):
    """The token mean, plus a term whose derivative in embed[3, 4] is inf."""
    inputs, targets = jnp.asarray(batch["inputs"]), jnp.asarray(batch["targets"])
    valid = targets != -100

    def loss(p):
        logits = apply_fn(p, inputs)
        per_token = optax.softmax_cross_entropy_with_integer_labels(
            logits, jnp.where(valid, targets, 0)
        )
        mean = jnp.sum(jnp.where(valid, per_token, 0.0)) / jnp.sum(valid)
        return mean + jnp.inf * p["embed"][3, 4]

    return jax.grad(loss)(params)
'''


@pytest.mark.parametrize(
    ("framework", "source"), [("torch", TORCH_INF_STEP), ("jax", JAX_INF_STEP)]
)
def test_an_inf_gradient_is_reported_where_it_is_with_json_and_exit_1(framework, source, tmp_path):
    (tmp_path / "infstep.py").write_text(source)
    out = tmp_path / "report" / "verify.json"
    proc = _cli(
        *("verify", "--framework", framework, "--step", "infstep:step"),
        *("--scheme", "token_mean", "--fixtures", "packed", "--world-sizes", "2"),
        *("--accum-steps", "1", "--json", str(out)),
        cwd=tmp_path,
        timeout=180,
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == exit_codes.MISMATCH, text
    assert "Traceback" not in text and "FloatingPointError" not in text
    where = "The gradient holds inf in embed[3, 4] (no other NaN or inf)"
    assert where in " ".join(proc.stdout.split()), text  # rich may wrap the line
    record = json.loads(out.read_text())
    assert record["ok"] is False
    assert record["diagnosis"]["explanation"].startswith(where)
    assert record["cases"][0]["diagnosis"]["best_match"] == "unknown"


def test_a_huge_gradient_is_diagnosed_under_the_clis_floating_point_checks():
    fixture = builtin_fixture("ragged")
    grads = loss_and_grad(fixture, "token_mean", 2, 1).grads
    huge = {name: np.full_like(value, 1e308) for name, value in grads.items()}
    with np.errstate(divide="raise", invalid="raise"):  # as crosscheck.cli.commands.main runs it
        d = diagnose(fixture, 2, 1, huge, "token_mean")
    assert d.detected and d.best_match == "unknown"
    assert d.explanation.startswith(
        f"The gradient holds 1e+308 in embed[0, 0] (and 959 more beyond "
        f"{MAX_GRADIENT_MAGNITUDE:.0e}, too large for the fit's float64 arithmetic)"
    )
    assert "huge loss or gradient" in d.fix


# ---- export-vectors into a directory that holds something ------------------------------------


def _tree(directory: Path) -> dict[str, bytes]:
    return {
        p.relative_to(directory).as_posix(): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def test_export_refuses_a_non_empty_directory_without_force(tmp_path, capsys):
    target = tmp_path / "vectors"
    target.mkdir()
    (target / "manifest.json").write_text('{"mine": true}')
    (target / "notes.txt").write_text("keep me")
    code, lines = _refused(capsys, "export-vectors", str(target))
    assert code == exit_codes.SETUP_ERROR
    assert lines == [
        f"crosscheck export-vectors: {target} is not empty (it holds manifest.json, notes.txt):"
        " pass --force (force=True) to replace the export's own files there; files it did not "
        "write are left alone"
    ]
    assert _tree(target) == {"manifest.json": b'{"mine": true}', "notes.txt": b"keep me"}


def test_export_with_force_replaces_only_its_own_files(tmp_path, capsys):
    fresh = tmp_path / "fresh"
    done = export_vectors(fresh)
    target = tmp_path / "vectors"
    export_vectors(target)
    # A previous export's file that this one no longer writes, listed in the old manifest...
    manifest = json.loads((target / MANIFEST_NAME).read_text())
    stale = "expected/retired-fixture/token_mean/R1_M1.npz"
    manifest["vectors"].append({**manifest["vectors"][0], "path": stale})
    # ... and paths a manifest must not be trusted with: outside the export, or foreign.
    manifest["vectors"].append({**manifest["vectors"][0], "path": "../outside.txt"})
    manifest["vectors"].append({**manifest["vectors"][0], "path": "notes.txt"})
    (target / MANIFEST_NAME).write_text(json.dumps(manifest))
    (target / stale).parent.mkdir(parents=True)
    (target / stale).write_bytes(b"old")
    (target / "notes.txt").write_text("keep me")
    (target / "expected" / "seed" / "mine.txt").write_text("keep me too")
    (tmp_path / "outside.txt").write_text("outside")

    code, lines = _main(capsys, "export-vectors", "--force", str(target))
    assert code == exit_codes.OK, lines
    assert lines == [
        f"wrote {len(done.files)} files, {done.num_bytes} bytes; manifest {target / MANIFEST_NAME}"
    ]
    foreign = {"notes.txt": b"keep me", "expected/seed/mine.txt": b"keep me too"}
    assert _tree(target) == {**_tree(fresh), **foreign}  # the stale file and its folder: gone
    assert not (target / "expected" / "retired-fixture").exists()
    assert (tmp_path / "outside.txt").read_text() == "outside"


def test_an_interrupted_export_leaves_the_old_manifest_and_no_temporary_file(tmp_path, monkeypatch):
    target = tmp_path / "vectors"
    export_vectors(target)
    before = (target / MANIFEST_NAME).read_bytes()
    written = 0

    import crosscheck.fixtures.vectors as vectors

    real = vectors.npz_bytes

    def interrupted(arrays):
        nonlocal written
        written += 1
        if written == 40:
            raise KeyboardInterrupt
        return real(arrays)

    monkeypatch.setattr(vectors, "npz_bytes", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export_vectors(target, force=True)
    assert (target / MANIFEST_NAME).read_bytes() == before
    assert not [p for p in target.rglob("*") if p.name.endswith(".tmp")]


# ---- interrupts: one line, exit 130, nothing left running ------------------------------------


class _Interrupted(NamedTuple):
    """A CLI run stopped by a signal: what ran when it came, and how the CLI ended."""

    running: list[tuple[int, str]]  # the marked processes when the signal was sent
    took: float  # seconds from the signal to the CLI's exit
    returncode: int
    out: str
    err: str
    left: list[tuple[int, str]]  # the marked processes still running after the exit
    files_left: list[str]  # the CLI's zygote logs still in the temporary directory after it


def _interrupt_cli(
    argv: list[str],
    cwd: Path,
    signum: int,
    ready: Callable[[subprocess.Popen, str], bool],
    settle_s: float = 0.0,
    to_group: bool = False,
) -> _Interrupted:
    """`python -m crosscheck ARGV` with a unique marker in its environment, sent `signum` once
    `ready(process, marker)` holds (within 120 s) and `settle_s` more have passed: to the CLI
    alone, or with `to_group` to its whole process group (its own session), as a terminal
    sends Ctrl-C. Whatever still runs afterwards is killed, after it was recorded."""
    marker = uuid.uuid4().hex
    proc = subprocess.Popen(
        [sys.executable, "-m", "crosscheck", *argv],
        cwd=cwd,
        env={**os.environ, MARKER: marker},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=to_group,  # its own group: the test plays the terminal
    )
    try:
        deadline = time.monotonic() + 120
        while not ready(proc, marker):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, _marked(marker)
            time.sleep(0.1)
        time.sleep(settle_s)
        running = _marked(marker)
        sent = time.monotonic()
        if to_group:
            os.killpg(proc.pid, signum)
        else:
            proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - sent
        left = _marked(marker)
        give_up = time.monotonic() + 1.0  # a SIGKILLed process takes a moment to be a zombie
        while left and time.monotonic() < give_up:
            time.sleep(0.05)
            left = _marked(marker)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        _kill_marked(marker)
    # A zygote's log is named after the process that started it; empty, it is removed when
    # the zygote is closed, interrupted or not.
    logs = Path(tempfile.gettempdir()).glob(f"gradweight-zygote-*-{proc.pid}.log")
    files_left = sorted(path.name for path in logs)
    return _Interrupted(running, took, proc.returncode, out, err, left, files_left)


def _assert_stopped_in_one_line(result: _Interrupted, signum: int) -> None:
    """Within 5 s, exit 130 and one line on stderr, nothing marked left running, and no
    zygote log of the CLI's left behind."""
    assert result.took < 5.0, result.took
    assert result.returncode == exit_codes.INTERRUPTED, result.out + result.err
    name = signal.Signals(signum).name
    assert re.fullmatch(
        rf"crosscheck: interrupted by {name}; (stopped \d+ process(es)? it had started|no "
        r"process it started is left running)\n",
        result.err,
    ), result.err
    assert result.left == [], result.left
    assert result.files_left == [], result.files_left


@pytest.mark.parametrize("settle_s", [0.0, 1.0, 2.0])
def test_ctrl_c_on_the_terminal_while_torch_starts_gives_one_line(settle_s):
    """SIGINT to the whole foreground group, as a terminal sends it, at several instants of the
    zygote's seconds of importing torch (counted from when it appears): exit 130, one
    line on stderr, no traceback from any process, nothing left running."""

    def server_started(proc: subprocess.Popen, marker: str) -> bool:
        return any("crosscheck.launch.zygote_server torch " in cmd for _, cmd in _marked(marker))

    argv = ["verify", "--framework", "torch", "--step", "examples.torch_hf_loss:step"]
    argv += ["--scheme", "token_mean"]
    result = _interrupt_cli(argv, ROOT, signal.SIGINT, server_started, settle_s, to_group=True)
    output = result.out + result.err
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, result.err
    _assert_stopped_in_one_line(result, signal.SIGINT)


@pytest.mark.parametrize(
    ("framework", "step", "cwd", "signum"),
    [
        # Each rank starts a child, then hangs: SIGTERM must take the ranks and the children.
        ("torch", "verify_steps:cli_signal_child_then_hang", TESTS, signal.SIGTERM),
        ("jax", "tests.jax_verify_steps:hangs_on_ragged", ROOT, signal.SIGINT),
    ],
)
def test_an_interrupted_verify_stops_every_process_and_says_so_in_one_line(
    framework, step, cwd, signum
):
    # torch: the ranks' children have started (the step is in its hang); JAX: the worker
    # (or the zygote it comes from) has, then it is given time to reach the hanging job.
    def started(proc: subprocess.Popen, marker: str) -> bool:
        if framework == "torch":
            return any("gradweight-cli-hang-child" in c for _, c in _marked(marker))
        return any(pid != proc.pid for pid, _ in _marked(marker))

    argv = [
        *("verify", "--framework", framework, "--step", step, "--scheme", "token_mean"),
        *("--fixtures", "ragged", "--world-sizes", "2", "--accum-steps", "1", "--timeout", "120"),
    ]
    result = _interrupt_cli(argv, cwd, signum, started, 1.5 if framework == "jax" else 0.0)
    assert len(result.running) >= 2, result.running  # the CLI and what it started
    _assert_stopped_in_one_line(result, signum)
    assert "Traceback" not in result.out


def test_an_interrupted_run_ends_its_worker_threads_and_every_process():
    """`run` waits on its jobs from worker threads (crosscheck.launch.schedule): after SIGTERM they
    must neither keep the interpreter alive nor leave a process behind."""
    argv = [
        *("run", "--no-resume", "--impls", "torch-ddp,jax-pmap,jax-multiprocess"),
        *("--fixtures", "packed,ragged"),
    ]

    def under_way(proc: subprocess.Popen, marker: str) -> bool:
        return len(_marked(marker)) >= 4  # jobs of both frameworks under way

    result = _interrupt_cli(argv, ROOT, signal.SIGTERM, under_way)
    _assert_stopped_in_one_line(result, signal.SIGTERM)


def test_handle_signals_turns_sigterm_into_one_line_and_restores_the_handlers(monkeypatch, capsys):
    import crosscheck.launch.processes as processes

    monkeypatch.setattr(processes, "terminate_all", lambda grace_s=2.0: 2)
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with processes.handle_signals() as interruption:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # interrupted at once
        raise AssertionError("not interrupted")
    assert interruption.signal_name == "SIGTERM" and interruption.stopped == 2
    assert capsys.readouterr().err == (
        "crosscheck: interrupted by SIGTERM; stopped 2 processes it had started\n"
    )
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_terminate_all_stops_what_was_registered_and_imports_no_framework():
    """One registry for every launch: a command that launched nothing has nothing to stop, a
    registered group (here a plain `sleep`) is stopped, and neither torch nor JAX is imported."""
    code = (
        "import subprocess, sys\n"
        "from crosscheck.launch import processes\n"
        "assert processes.terminate_all() == 0\n"
        "child = subprocess.Popen(['sleep', '60'], start_new_session=True)\n"
        "processes.register_group(child)\n"
        "print(processes.terminate_all(grace_s=0.5), child.poll(), processes.registered_groups(),"
        " 'torch' in sys.modules, 'jax' in sys.modules)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["1", "-15", "[]", "False", "False"]


# ---- 80 columns ------------------------------------------------------------------------------


def _rows() -> list[CaseResult]:
    rows = []
    for check, strategy in [
        ("vs-oracle", "postnorm"),
        ("layout-invariance", "closed-form"),
        ("cross-impl", "precount"),
        ("world-size-change", "precount"),
        ("resume", "postnorm"),
        ("clipping", "per-microbatch"),
    ]:
        for impl in ("jax-multiprocess", "jax-shard_map", "torch-fsdp2"):
            for scheme, fixture in zip(SCHEMES, BUILTIN_FIXTURES, strict=False):
                rows.append(
                    CaseResult(
                        check=check,
                        fixture=fixture,
                        scheme=scheme,
                        impl=impl,
                        strategy=strategy,
                        world_size=4,
                        accum_steps=2,
                        dtype="bfloat16",
                        max_rel_err=1.234e-13,
                        ok=True,
                        reference="oracle",
                        weight_ratio=12.5,
                        deviation=0.5,
                    )
                )
    return rows


def _catalogue() -> CatalogueRun:
    fixtures = ["dedup-packed", "packed-wide", "multimodal"]
    results = [
        BugResult(
            run=BugRun(
                pattern=p,
                framework="torch",
                fixture=fixtures[i % 3],
                world_size=4,
                accum_steps=2,
            ),
            detected=True,
            diagnosed_as=p,
            weight_ratio=39.0,
            scale=0.868345,
            intended_error=0.57,
            explanation="",
        )
        for i, p in enumerate(PATTERNS)
    ]
    results.append(
        BugResult(
            run=BugRun(
                pattern="attention-mask-count",
                framework="jax",
                fixture="multimodal",
                world_size=2,
                accum_steps=1,
            ),
            detected=False,
            diagnosed_as="double-reduce-count",
            weight_ratio=math.inf,
            scale=math.nan,
            intended_error=math.inf,
            explanation="",
            error="LaunchError: worker 0 (pid 123) exited with status 3; the others stopped",
        )
    )
    return CatalogueRun(results, [], {})


def _verify_report() -> VerifyReport:
    scheme = get_scheme("token_mean")
    cases = [
        judge(VerifyJob(fixture=name, world_size=2, accum_steps=2), scheme, _grads_of(name, s))
        for name, s in [("packed", "token_mean"), ("ragged", "microbatch_mean")]
    ]
    cases.append(
        judge(VerifyJob(fixture="ragged", world_size=2, accum_steps=4), scheme, ValueError("x"))
    )
    return VerifyReport(
        framework="torch",
        step="examples.torch_hf_loss:step_extra_accum_divide",
        scheme=scheme,
        cases=cases,
    )


def _grads_of(fixture: str, scheme: str) -> VerifyOutput:
    return VerifyOutput(loss_and_grad(builtin_fixture(fixture), scheme, 2, 2).grads)


def _render(width: int, draw) -> str:
    console = Console(width=width, file=io.StringIO(), color_system=None)
    draw(console)
    return console.file.getvalue()


def test_every_table_is_readable_at_80_columns():
    rows = _rows()
    # R = 3: a world size jax-multiprocess does not launch.
    where = {"fixture": "soft-weights", "scheme": "microbatch_mean", "strategy": "postnorm"}
    layout = {"world_size": 3, "accum_steps": 1, "dtype": "bfloat16"}
    skipped = [
        SkippedCase(
            **case_fields(impl=impl, **where, **layout),
            check="vs-oracle",
            reason="jax-multiprocess launches 1, 2, 4 processes, not 3",
        )
        for impl in ("jax-multiprocess", "torch-fsdp2")
    ]
    every_name = {n for r in rows for n in (r.fixture, r.scheme, r.impl, r.strategy)}
    # table -> (how it is drawn, the names that must each appear whole: a word of the text)
    drawings = {
        # Grouped rows show a count ("3 impls") where a group spans several names.
        "run, grouped": (lambda c: print_results(c, rows, "group"), set(SCHEMES) & every_name),
        "run, families": (lambda c: print_results(c, rows, "family"), {"pass", "passed", "rows"}),
        "run, per case": (lambda c: print_results(c, rows, "case"), every_name),
        "skipped": (
            lambda c: print_skipped(c, skipped),
            {"jax-multiprocess,", "torch-fsdp2", "soft-weights", "vs-oracle"},
        ),
        "bugs": (
            lambda c: print_catalogue(c, _catalogue()),
            set(PATTERNS) | {"dedup-packed", "packed-wide", "multimodal", "torch", "jax"},
        ),
        "verify": (
            lambda c: print_verify_table(c, _verify_report()),
            {"examples.torch_hf_loss:step_extra_accum_divide", "packed", "ragged"}
            | {"microbatch-mean", "token_mean", "float64-exact"},
        ),
    }
    for what, (draw, names) in drawings.items():
        text = _render(80, draw)
        assert ELLIPSIS not in text, f"{what}:\n{text}"
        assert max(len(line) for line in text.splitlines()) <= 80, f"{what}:\n{text}"
        words = set(text.split())
        assert names <= words, f"{what}: {sorted(names - words)} cut:\n{text}"
        if what == "bugs":  # the compact table has no room for why a step failed: below it
            line = "FAIL attention-mask-count (jax) multimodal R=2 M=1 float64: LaunchError:"
            assert line in " ".join(text.split()), text


def test_a_wide_terminal_keeps_the_one_row_per_line_tables():
    run = CatalogueRun([r for r in _catalogue().results if not r.error], [], {})
    # 160 columns: the one-row table needs about 155 (pattern and diagnosis columns as wide as
    # the longest id, cp-local-sequence-count).
    text = _render(160, lambda c: print_catalogue(c, run))
    assert "framework" in text and "weight" in text and ELLIPSIS not in text
    assert "│ rank-mean               │ torch     │ dedup-packed │ R=4,M=2 │" in text


# ---- importing crosscheck changes nothing global ---------------------------------------------


def test_importing_crosscheck_sets_no_environment_variable_and_loads_no_numpy():
    clean = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(Path.home())}
    code = (
        "import os, sys, crosscheck\n"
        "print(os.environ.get('OPENBLAS_NUM_THREADS'), 'numpy' in sys.modules)\n"
        "from crosscheck import diagnose, log_denominator\n"
        "import crosscheck.diagnosis.diagnose\n"
        "print(callable(crosscheck.diagnose), crosscheck.diagnose is diagnose)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=clean, cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["None", "False", "True", "True"]


def test_the_command_line_alone_gets_one_blas_thread_before_numpy_loads():
    clean = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(Path.home())}
    code = (
        "import os, sys, crosscheck.__main__\n"
        "print(os.environ.get('OPENBLAS_NUM_THREADS'), 'numpy' in sys.modules)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=clean, cwd=ROOT, capture_output=True, text=True
    )
    assert proc.stdout.split() == ["1", "False"], proc.stderr
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"crosscheck": "crosscheck.__main__:main"}
