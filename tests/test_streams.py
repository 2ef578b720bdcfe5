"""Errors to stderr, results to stdout, in every command (issue 26, "Streams and paths").

A set-up error of any command is one line on stderr and exit status 2, with nothing on
stdout and before any work starts; an output file's path written with a trailing separator
(``--json out/``) names a directory and is refused, not written as a file named ``out``; a
fixture file is read without unpickling anything, and one numpy cannot read gets our own
message naming the file and why.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from crosscheck import exit_codes
from crosscheck.cli.commands import main
from crosscheck.fixtures.builtin import builtin_fixture
from crosscheck.verification import verifier

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_work_may_start(monkeypatch):
    """A refused command must be refused before any run, catalogue, export, verify runner,
    bench or conformance setting starts."""

    def started(*args, **kwargs):
        raise AssertionError("a refused command started its work")

    monkeypatch.setattr("crosscheck.cli.commands.run_matrix", started)
    monkeypatch.setattr("crosscheck.bugs.catalogue_run.run_steps", started)
    monkeypatch.setattr("crosscheck.bugs.catalogue_run.run_objective_catalogue", started)
    monkeypatch.setattr("crosscheck.fixtures.vectors.export_vectors", started)
    # verify's step check runs in a subprocess of its own (it finds a missing step); the
    # runners that start the step's processes are never reached.
    for framework in ("torch", "jax"):
        monkeypatch.setitem(verifier.FRAMEWORKS, framework, "a refused verify started a runner")
    monkeypatch.setattr("crosscheck.bench.command.run_bench", started)
    monkeypatch.setattr("crosscheck.cli.conformance_report.run_setting", started)


def _refused(capsys, *argv: str) -> tuple[int, str]:
    """A refused `crosscheck ARGV` in this process: its exit status and its one line on
    stderr; stdout, where results go, holds nothing."""
    code = main(list(argv))
    captured = capsys.readouterr()
    assert captured.out == "", (argv, captured.out)
    lines = captured.err.splitlines()
    assert len(lines) == 1, (argv, lines)
    return code, lines[0]


VERIFY = ("verify", "--framework", "torch", "--step", "examples.torch_torchtitan:step")


@pytest.mark.parametrize(
    ("argv", "start"),
    [
        (("run", "--schemes", "mean"), "crosscheck run: unknown scheme 'mean'"),
        (("run", "--impls", "jax-xla"), "crosscheck run: unknown implementation 'jax-xla'"),
        ((*VERIFY[:4], "nosuchmodule:step", "--scheme", "token_mean"), "crosscheck verify: "),
        ((*VERIFY, "--scheme", "no_such_scheme"), "crosscheck verify: "),
        ((*VERIFY, "--scheme", "token_mean", "--strict", "--precision", "float32"), None),
        (("bugs", "--frameworks", "tensorflow"), "crosscheck bugs: unknown framework"),
        (("bugs", "--patterns", "no-such-pattern"), "crosscheck bugs: unknown pattern"),
        (("bench", "--ranks", "0"), "crosscheck bench: --ranks must be at least 1, got 0"),
        (("conformance", "--frameworks", "jaxx"), "crosscheck conformance: unknown framework"),
    ],
)
def test_every_commands_set_up_error_is_one_line_on_stderr(
    argv, start, capsys, monkeypatch, tmp_path, no_work_may_start
):
    monkeypatch.chdir(tmp_path)  # the step module is looked for here: nosuchmodule is not
    code, line = _refused(capsys, *argv)
    assert code == exit_codes.SETUP_ERROR
    assert line.startswith(start or "crosscheck verify: --strict is --precision float64")


def test_export_into_a_file_is_one_line_on_stderr(capsys, tmp_path, no_work_may_start):
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    code, line = _refused(capsys, "export-vectors", str(afile / "vectors"))
    assert code == exit_codes.SETUP_ERROR
    assert line == (
        f"crosscheck export-vectors: {afile}/vectors cannot be written: {afile} is a file, "
        "not a directory"
    )


def test_the_newcomers_missing_step_is_one_line_on_stderr_in_a_fresh_process(tmp_path):
    """As typed in a shell: exit 2, the line on stderr, stdout empty, no runner started."""
    started = time.monotonic()
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "crosscheck", "verify", "--framework", "jax"),
            *("--step", "mystep:step", "--scheme", "token_mean"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == exit_codes.SETUP_ERROR, proc.stdout + proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"crosscheck verify: --step mystep:step: no module named 'mystep' in {tmp_path} (the "
        "current directory) or on the Python path"
    ]
    assert time.monotonic() - started < 30  # no JAX worker was started


# ---- an output file's path that ends with a separator names a directory ------------------


def _directory_named(command: str, option: str, written: str) -> str:
    return (
        f"crosscheck {command}: {option} {written} cannot be written: it ends with a path "
        "separator, so it names a directory; name the file to write (for example "
        f"{written.rstrip('/')}/report.json)"
    )


RUN = ("run", "--impls", "oracle", "--fixtures", "seed", "--no-resume")


@pytest.mark.parametrize(
    ("argv", "command", "option"),
    [
        (RUN, "run", "--json"),
        (RUN, "run", "--log"),
        (RUN, "run", "--plot"),
        ((*VERIFY, "--scheme", "token_mean"), "verify", "--json"),
        ((*VERIFY, "--scheme", "token_mean"), "verify", "--plot"),
        (("bugs", "--frameworks", "torch"), "bugs", "--json"),
        (("bench", "--quick"), "bench", "--json"),
        (("conformance",), "conformance", "--json"),
        (("conformance",), "conformance", "--markdown"),
    ],
)
def test_an_output_path_ending_in_a_separator_is_refused_before_any_work(
    argv, command, option, capsys, monkeypatch, tmp_path, no_work_may_start
):
    monkeypatch.chdir(tmp_path)
    for written in ("out/", f"{tmp_path}/reports/"):
        code, line = _refused(capsys, *argv, option, written)
        assert code == exit_codes.SETUP_ERROR
        assert line == _directory_named(command, option, written)
    assert list(tmp_path.iterdir()) == []  # no file named out, no directory either


def test_the_newcomers_json_directory_is_refused_in_a_fresh_process(tmp_path):
    """`crosscheck run --json out/` as typed in a shell: refused, and nothing is written."""
    proc = subprocess.run(
        [sys.executable, "-m", "crosscheck", *RUN, "--json", "out/"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == exit_codes.SETUP_ERROR, proc.stdout + proc.stderr
    assert proc.stdout == ""  # refused before the seed table, before any run
    assert proc.stderr.splitlines() == [_directory_named("run", "--json", "out/")]
    assert not (tmp_path / "out").exists()


def test_an_output_path_without_a_separator_still_writes_there(capsys, tmp_path):
    out = tmp_path / "new" / "run.json"
    assert main([*RUN, "--json", str(out)]) == exit_codes.OK
    assert out.is_file()
    assert capsys.readouterr().err == ""  # a run that passed printed nothing on stderr


# ---- fixture files: read without pickle, our own message when unreadable -----------------


class _Touch:
    """Unpickling this creates `path`: a file that would be unpickled leaves a trace."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def _bad_files(directory: Path) -> dict[str, tuple[Path, str]]:
    """Files numpy cannot read as a fixture .npz: the path and the reason we give."""
    random = directory / "random.npz"
    random.write_bytes(np.random.default_rng(0).bytes(4096))
    pickled = directory / "pickled.npz"
    pickled.write_bytes(pickle.dumps(_Touch(directory / "unpickled"), protocol=4))
    empty = directory / "empty.npz"
    empty.write_bytes(b"")
    objects = directory / "objects.npz"
    arrays = builtin_fixture("packed").npz_arrays()
    arrays["weights"] = np.array([_Touch(directory / "unpickled")], dtype=object)
    np.savez(objects, **arrays)
    unreadable = " is not a readable .npz (truncated, or not a fixture file): "
    return {
        "random": (
            random,
            f"{unreadable}it does not start as an .npz (a zip archive) does; a fixture file is "
            "an .npz written by Fixture.save",
        ),
        "pickle": (
            pickled,
            f"{unreadable}it is a Python pickle, and fixture files are never unpickled",
        ),
        "empty": (empty, f"{unreadable}the file is empty"),
        "object array": (
            objects,
            ": key 'weights' holds Python objects (pickled data), not numbers; fixture files "
            "are read without unpickling anything",
        ),
    }


@pytest.mark.parametrize("kind", ["random", "pickle", "empty", "object array"])
@pytest.mark.parametrize("command", ["run", "verify", "bugs"])
def test_a_bad_fixture_file_gets_our_own_message_and_is_never_unpickled(
    kind, command, capsys, tmp_path, no_work_may_start
):
    path, why = _bad_files(tmp_path)[kind]
    argv = {
        "run": (*RUN[:3], "--fixtures", str(path)),
        "verify": (*VERIFY, "--scheme", "token_mean", "--fixtures", str(path)),
        "bugs": ("bugs", "--frameworks", "torch", "--fixtures", str(path)),
    }[command]
    code, line = _refused(capsys, *argv)
    assert code == exit_codes.SETUP_ERROR
    assert line == f"crosscheck {command}: fixture file {path}{why}"
    assert "allow_pickle" not in line and "pickle.load" not in line  # not numpy's hint
    assert not (tmp_path / "unpickled").exists()


def test_the_jax_multiprocess_worker_reads_fixtures_without_pickle():
    source = (ROOT / "jax_impl" / "harness" / "multiprocess_worker.py").read_text()
    assert "np.load(" in source
    assert source.count("np.load(") == source.count("allow_pickle=False")
