"""What is not installed is a set-up error naming the extra, never a traceback in a worker.

crosscheck itself needs numpy and rich only; torch, JAX and matplotlib come with the extras
``gradweight[torch]``, ``[jax]`` and ``[plot]``. Here each is made to look absent to this
process the way a fresh environment without it looks: `importlib.util.find_spec` finds no
module of that name (what `crosscheck.run.implementations.not_installed` and the ``--plot``
check ask). The real absence is checked by scripts/check_fresh_install.py in a fresh venv.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from crosscheck import exit_codes
from crosscheck.cli.commands import main
from crosscheck.run import implementations


@pytest.fixture
def absent(monkeypatch):
    """`absent("jax", ...)`: those modules cannot be found from now on in this test."""
    real = importlib.util.find_spec

    def hide(*names: str) -> None:
        def find_spec(name, *args, **kwargs):
            if name.split(".")[0] in names:
                return None
            return real(name, *args, **kwargs)

        monkeypatch.setattr(importlib.util, "find_spec", find_spec)
        implementations.not_installed.cache_clear()

    yield hide
    implementations.not_installed.cache_clear()


def _main(capsys, *argv: str) -> tuple[int, list[str]]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, (captured.out + captured.err).strip().splitlines()


def _refused(capsys, *argv: str) -> tuple[int, list[str]]:
    """A refused command: its exit status and its lines on stderr; nothing on stdout."""
    code = main(list(argv))
    captured = capsys.readouterr()
    assert captured.out == "", (argv, captured.out)
    return code, captured.err.splitlines()


def test_a_default_run_skips_what_is_not_installed_and_says_why(absent, capsys, tmp_path):
    absent("torch", "jax")
    report = tmp_path / "run.json"
    code, lines = _main(
        capsys,
        *("run", "--fixtures", "packed", "--schemes", "token_mean", "--world-sizes", "2"),
        *("--accum-steps", "2", "--json", str(report)),
    )
    assert code == exit_codes.OK, lines
    payload = json.loads(report.read_text())
    skipped: dict[str, set[tuple[str, str]]] = {}
    for skip in payload["skipped"]:
        skipped.setdefault(skip["reason"], set()).add((skip["check"], skip["impl"]))
    for framework in ("torch", "jax"):
        why = f"{framework} is not installed here (pip install 'gradweight[{framework}]')"
        assert {impl for _, impl in skipped[why]} == {
            impl for impl, fw in implementations.IMPLEMENTATIONS.items() if fw == framework
        }
        assert {check for check, _ in skipped[why]} == {"vs-oracle", "resume"}
    assert {r["impl"] for r in payload["results"]} == {"oracle"}
    assert any("planned combinations not run" in line for line in lines)


def test_an_implementation_asked_for_by_name_is_refused_when_not_installed(absent, capsys):
    absent("jax")
    code, lines = _refused(
        capsys, "run", "--impls", "oracle,torch-ddp,jax-pmap", "--fixtures", "packed"
    )
    assert code == exit_codes.SETUP_ERROR
    assert lines == [
        "crosscheck run: jax-pmap runs in no case of this plan: jax is not installed here "
        "(pip install 'gradweight[jax]')"
    ]


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_verify_without_the_framework_is_one_setup_error(absent, capsys, framework):
    absent(framework)
    code, lines = _refused(
        capsys,
        *("verify", "--framework", framework, "--scheme", "token_mean"),
        *("--step", "examples.torch_torchtitan:step"),
    )
    assert code == exit_codes.SETUP_ERROR
    assert lines == [
        f"crosscheck verify: {framework} is not installed here "
        f"(pip install 'gradweight[{framework}]')"
    ]


def test_a_partial_jax_install_names_the_missing_module(absent, capsys):
    absent("orbax")
    code, lines = _refused(
        capsys,
        *("verify", "--framework", "jax", "--scheme", "token_mean"),
        *("--step", "examples.jax_pmap_mean:step"),
    )
    assert code == exit_codes.SETUP_ERROR
    assert lines == [
        "crosscheck verify: jax's orbax is not installed here (pip install 'gradweight[jax]')"
    ]


def test_bugs_without_a_framework_names_it_and_the_way_around(absent, capsys):
    absent("jax")
    code, lines = _refused(capsys, "bugs")
    assert code == exit_codes.SETUP_ERROR
    assert lines == [
        "crosscheck bugs: jax is not installed here (pip install 'gradweight[jax]'), or pass "
        "--frameworks torch"
    ]


@pytest.mark.parametrize(
    "argv",
    [
        ("run", "--impls", "oracle", "--fixtures", "packed"),
        ("verify", "--framework", "torch", "--step", "no_such:step", "--scheme", "token_mean"),
    ],
    ids=["run", "verify"],
)
def test_plot_without_matplotlib_is_refused_before_the_run(argv, absent, capsys, tmp_path):
    absent("matplotlib")
    code, lines = _refused(capsys, *argv, "--plot", str(tmp_path / "w.png"))
    assert code == exit_codes.SETUP_ERROR
    # Before the step is looked for: the missing step would be the next refusal.
    assert lines == [
        f"crosscheck {argv[0]}: --plot needs matplotlib, which is not installed here: "
        "pip install 'gradweight[plot]'"
    ]
    assert not Path(tmp_path / "w.png").exists()
