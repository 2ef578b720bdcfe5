"""What a project adopting gradweight installs, and the pytest plugin it gets.

pyproject.toml declares compatible ranges (the core needs numpy and rich only; matplotlib,
JAX, torch and the test tools are extras); scripts/constraints.txt pins the exact set CI tests,
inside those ranges, and the Makefile installs with it. The wheel ships the ``py.typed``
markers and the entry points (the ``crosscheck`` script, the ``pytest11`` plugin). The plugin
loads nothing heavy and fails a test with the diagnosis when a step's weighting is wrong.

Installing into a fresh venv from the package index takes a network and a minute:
scripts/check_fresh_install.py does it (``make fresh-install``), not this suite.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import typing
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
CONSTRAINTS = ROOT / "scripts" / "constraints.txt"
PACKAGES = ("crosscheck", "jax_impl", "torch_impl")


def _requirements() -> dict[str, list[Requirement]]:
    """Every requirement pyproject declares, by where: "runtime" or the extra's name (the
    `all` extra, which only names the others, left out)."""
    found = {"runtime": [Requirement(text) for text in PROJECT["dependencies"]]}
    for extra, texts in PROJECT["optional-dependencies"].items():
        if extra != "all":
            found[extra] = [Requirement(text) for text in texts]
    return found


def _pins() -> dict[str, str]:
    """name -> version of every line of the constraints file."""
    pins: dict[str, str] = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9._-]+)==([A-Za-z0-9.+!_-]+)", line)
        assert match, f"not an exact pin: {line!r}"
        name = canonicalize_name(match[1])
        assert name not in pins, f"{name} pinned twice"
        pins[name] = match[2]
    return pins


def test_requires_python_is_a_lower_bound_only():
    assert PROJECT["requires-python"] == ">=3.11"


def test_every_dependency_is_a_range_not_a_pin():
    for where, requirements in _requirements().items():
        for requirement in requirements:
            operators = {spec.operator for spec in requirement.specifier}
            assert not operators & {"==", "==="}, f"{where}: {requirement} is pinned"
            assert ">=" in operators, f"{where}: {requirement} has no lower bound"


def test_the_core_needs_numpy_and_rich_and_the_rest_are_extras():
    requirements = _requirements()
    assert {r.name for r in requirements["runtime"]} == {"numpy", "rich"}
    assert {r.name for r in requirements["plot"]} == {"matplotlib"}
    assert {r.name for r in requirements["torch"]} == {"torch"}
    assert {"jax", "jaxlib", "flax", "optax", "orbax-checkpoint"} == {
        r.name for r in requirements["jax"]
    }
    # The suite runs one conformance setting through Hugging Face's trainers (hf); DeepSpeed
    # and torchtitan only `make conformance` installs.
    assert {r.name for r in requirements["hf"]} == {"transformers", "accelerate", "trl", "datasets"}
    assert {r.name for r in requirements["deepspeed"]} == {"deepspeed"}
    assert PROJECT["optional-dependencies"]["all"] == ["gradweight[plot,jax,torch,test,hf]"]


def test_the_constraints_pin_every_dependency_inside_its_range():
    pins = _pins()
    for where, requirements in _requirements().items():
        for requirement in requirements:
            name = canonicalize_name(requirement.name)
            assert name in pins, f"{where}: {requirement.name} is not pinned in {CONSTRAINTS}"
            assert requirement.specifier.contains(Version(pins[name]), prereleases=True), (
                f"{where}: the pin {name}=={pins[name]} lies outside {requirement}"
            )
    # The CPU build: a pin without "+cpu" lets a Linux resolution take the CUDA one.
    assert pins["torch"].endswith("+cpu")


def test_make_installs_with_the_constraints_and_reinstalls_when_they_change():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^CONSTRAINTS := scripts/constraints\.txt$", makefile, re.M)
    stamp_rule = re.search(r"^\$\(STAMP\):(.*)$", makefile, re.M)
    assert stamp_rule and set(stamp_rule[1].split()) == {"pyproject.toml", "$(CONSTRAINTS)"}
    assert '-m pip install --quiet -c $(CONSTRAINTS) -e ".[all]"' in makefile
    for target in ("demo", "test"):
        assert re.search(rf"^{target}: \$\(STAMP\)$", makefile, re.M), target


def test_every_package_is_typed():
    for package in PACKAGES:
        assert (ROOT / package / "py.typed").is_file(), package
    # Plus the one data file the code reads: the transformer's shared initial weights.
    assert PYPROJECT["tool"]["setuptools"]["package-data"] == {
        package: ["py.typed", *(["fixtures/data/*.npz"] if package == "crosscheck" else [])]
        for package in PACKAGES
    }


def test_the_wheel_ships_the_markers_the_ranges_and_the_entry_points(tmp_path):
    """Built without the network (--no-build-isolation: this environment's setuptools, which
    the test extra requires) from a copy of the tree, so that no build output lands in it."""
    source = tmp_path / "source"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for package in PACKAGES:
        shutil.copytree(ROOT / package, source / package, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    wheel_command = ["wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path / "dist"]
    built = subprocess.run(
        [sys.executable, "-m", "pip", *map(str, wheel_command), str(source)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "dist").glob("gradweight-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        metadata = archive.read(f"{info}/METADATA").decode()
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
    assert {f"{package}/py.typed" for package in PACKAGES} <= names
    assert "crosscheck/fixtures/data/transformer_init.npz" in names
    assert "Requires-Python: >=3.11" in metadata.splitlines()
    runtime = [
        Requirement(line.removeprefix("Requires-Dist: "))
        for line in metadata.splitlines()
        if line.startswith("Requires-Dist: ") and "extra ==" not in line
    ]
    assert sorted(str(r) for r in runtime) == sorted(
        str(Requirement(text)) for text in PROJECT["dependencies"]
    )
    assert "crosscheck = crosscheck.__main__:main" in entry_points
    assert "[pytest11]\ncrosscheck.pytest_plugin = crosscheck.pytest_plugin" in entry_points


def test_verify_and_the_fixture_name_frameworks_with_the_literal():
    import crosscheck
    from crosscheck.pytest_plugin import GradWeight
    from crosscheck.verification.verifier import Framework

    assert typing.get_args(Framework) == ("torch", "jax")
    assert crosscheck.Framework is Framework
    assert typing.get_type_hints(crosscheck.verify)["framework"] == Framework
    for method in (GradWeight.verify, GradWeight.assert_weighting):
        # Annotations stay strings: the plugin imports verifier only for type checkers.
        assert inspect.signature(method).parameters["framework"].annotation == "Framework"


def test_every_public_name_resolves_and_is_listed():
    import crosscheck

    assert sorted(crosscheck.__all__) == sorted(crosscheck._EXPORTS)
    assert [name for name in crosscheck.__all__ if getattr(crosscheck, name, None) is None] == []
    assert set(crosscheck.__all__) <= set(dir(crosscheck))


def test_loading_the_plugin_imports_nothing_heavy_and_sets_nothing():
    code = (
        "import os, sys\n"
        "before = dict(os.environ)\n"
        "import crosscheck.pytest_plugin\n"
        "heavy = sorted({'numpy', 'rich', 'torch', 'jax'} & set(sys.modules))\n"
        "print(heavy, dict(os.environ) == before)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("OPENBLAS_NUM_THREADS", None)
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["[]", "True"]


#: The suite a library would write, run by pytester in its own directory: a correct step (the
#: torchtitan-style example), nanoGPT's per-microbatch mean, and a step that does not exist.
#: One layout with ranks and microbatches (R = M = 2) on the ragged fixture keeps it quick.
LIBRARY_TESTS = """
import json

import pytest

import crosscheck

LAYOUT = {"fixtures": ["ragged"], "world_sizes": [2], "accum_steps": [2]}


def test_correct(gradweight):
    assert gradweight.timeout_s == 200.0
    report = gradweight.assert_weighting(
        "examples.torch_torchtitan:step", framework="torch", scheme="token_mean", **LAYOUT
    )
    assert report.ok
    (path,) = gradweight.reports
    assert json.loads(path.read_text())["ok"] is True


def test_nanogpt(gradweight):
    gradweight.assert_weighting(
        "examples.torch_nanogpt:step", framework="torch", scheme="token_mean", **LAYOUT
    )


def test_missing_step(gradweight):
    with pytest.raises(crosscheck.StepSetupError, match="no module named 'no_such_package'"):
        gradweight.verify("no_such_package.train:step", framework="torch", scheme="token_mean")
    assert gradweight.reports == []


OBJECTIVE = {**LAYOUT, "objective": "examples.objectives:MOE", "fixtures": ["packed"]}


def test_objective_coefficient_twice(gradweight):
    gradweight.assert_weighting(
        "examples.torch_objective:step_z_loss_coefficient_twice", framework="torch", **OBJECTIVE
    )
"""


def test_the_plugin_passes_a_correct_step_and_fails_a_wrong_one_with_the_diagnosis(
    pytester, monkeypatch
):
    # The library's suite runs where its own modules import from; here, the examples.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    pytester.makepyfile(test_library=LIBRARY_TESTS)
    json_dir = pytester.path / "reports"
    result = pytester.runpytest_subprocess(
        "-p",
        "crosscheck.pytest_plugin",
        "--gradweight-timeout",
        "200",
        "--gradweight-json-dir",
        "reports",
        timeout=280,
    )
    result.assert_outcomes(passed=2, failed=2)
    # The failure is the AssertionError `crosscheck verify` would print: table, name, fix.
    result.stdout.fnmatch_lines(
        [
            "*test_nanogpt*",
            "E *AssertionError: examples.torch_nanogpt:step (torch) does NOT match token_mean "
            "on 1 fixture/layout case at float64-exact*",
            "E *Explains every case: microbatch-mean.",
            "E *Fix: do not average per-microbatch means*",
            "E *examples.torch_nanogpt:step (torch) against token_mean",
            "E *fixture*layout*max rel err*precision*diagnosed as*weight ratio*scale*result*",
            "E *ragged*R=2,M=2*float64-exact*microbatch-mean*FAIL*",
            "E *JSON report: *gradweight*examples.torch_nanogpt.step.torch.token_mean.json",
        ]
    )
    # A multi-term objective's failure names the pattern and the term, per term.
    result.stdout.fnmatch_lines(
        [
            "*test_objective_coefficient_twice*",
            "E *AssertionError: examples.torch_objective:step_z_loss_coefficient_twice (torch) "
            "does NOT match the objective examples.objectives:MOE*",
            "E *Explains every case: aux-coefficient-twice(z_loss)*",
            "E *z_loss (z_loss, λ 0.01, update): scale 0.01*aux-coefficient-twice",
            "E *Fix: apply z_loss's coefficient once*",
            "E *packed*FAIL*",
        ]
    )
    # pytest's one-line summary carries the verdict.
    result.stdout.fnmatch_lines(
        ["FAILED test_library.py::test_nanogpt - AssertionError: examples.torch_nanogpt*"]
    )
    # The test's own line, not the plugin's frames.
    assert "pytest_plugin.py" not in result.stdout.str()
    written = sorted(p.name for p in json_dir.iterdir())
    assert written == [
        "test_correct.examples.torch_torchtitan.step.torch.token_mean.json",
        "test_nanogpt.examples.torch_nanogpt.step.torch.token_mean.json",
        "test_objective_coefficient_twice.examples.torch_objective."
        "step_z_loss_coefficient_twice.torch.examples.objectives-MOE.json",
    ]
    twice = json.loads((json_dir / written[2]).read_text())
    assert twice["diagnosis"]["best_match"] == "aux-coefficient-twice(z_loss)"
    failed = json.loads((json_dir / written[1]).read_text())
    assert failed["ok"] is False
    assert failed["diagnosis"]["best_match"] == "microbatch-mean"
