"""What a user of the package gets: gradweight installed into a fresh venv from its ranges alone.

    python3 scripts/check_fresh_install.py [--venv DIR] [--with REQUIREMENT ...]

(``make fresh-install``). Creates a venv (a temporary one unless --venv names a directory that
does not exist yet), runs ``pip install <this repository>`` with no extras and no constraints
file, so pip resolves pyproject.toml's runtime ranges as a user's project would, and checks,
from a directory outside the repository and with PYTHONPATH unset (so only the installed
package can be imported):

- only the runtime dependencies came (numpy, rich and theirs; no matplotlib, torch, JAX);
- ``import crosscheck`` sets no environment variable and loads no numpy; the ``py.typed``
  markers are installed;
- numpy alone is enough to diagnose: the oracle's own token-mean gradient of a built-in fixture
  passes, its microbatch-mean gradient is named microbatch-mean;
- the ``crosscheck`` script runs (``--help``; ``run --impls oracle``, the oracle's own matrix),
  and ``crosscheck run --plot`` without matplotlib is a one-line set-up error (exit 2) naming
  the ``plot`` extra;
- with pytest added, the ``pytest11`` entry point provides the `gradweight` fixture and its
  options, also alongside ``-p crosscheck.pytest_plugin``.

``--with numpy==2.0.2 --with rich==13.9.4`` installs those alongside (the ranges' lower
bounds, say). It needs the package index; it takes about a minute. Exit status 0 when every
check passes, 1 otherwise; each check prints one line, ok or FAIL with what was seen.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Run by the venv's interpreter: what importing crosscheck does, and a numpy-only diagnosis.
PROBE = """
import json, os, sys
from importlib.metadata import files
before = dict(os.environ)
import crosscheck
quiet = dict(os.environ) == before and "numpy" not in sys.modules
from crosscheck import builtin_fixture, diagnose, loss_and_grad
fixture, R, M = builtin_fixture("ragged"), 2, 2
right = diagnose(fixture, R, M, loss_and_grad(fixture, "token_mean", R, M).grads, "token_mean")
wrong = diagnose(fixture, R, M, loss_and_grad(fixture, "microbatch_mean", R, M).grads, "token_mean")
print(json.dumps({
    "file": crosscheck.__file__,
    "quiet_import": quiet,
    "typed": sorted(str(f) for f in files("gradweight") if f.name == "py.typed"
                    and f.locate().is_file()),
    "right": [right.detected, right.best_match],
    "wrong": [wrong.detected, wrong.best_match, round(wrong.weight_ratio, 3)],
}))
"""

#: A library's test of the fixture that needs no framework: in this venv torch is not installed,
#: which is a set-up error naming the extra, raised before any process starts.
PLUGIN_TEST = """
import pytest

import crosscheck


def test_gradweight_fixture(gradweight):
    assert gradweight.timeout_s == 30.0
    missing = r"torch is not installed here \\(pip install 'gradweight\\[torch\\]'\\)"
    with pytest.raises(crosscheck.StepSetupError, match=missing):
        gradweight.verify("no_such_module:step", framework="torch", scheme="token_mean")
"""

#: What the runtime ranges must not pull in.
EXTRAS_ONLY = {"matplotlib", "torch", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint"}


class Checks:
    def __init__(self, venv_dir: Path, scratch: Path) -> None:
        self.bin = venv_dir / "bin"
        self.scratch = scratch
        self.env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self.failed: list[str] = []

    def run(
        self, *argv: str | Path, shown: str = "", timeout: float = 600
    ) -> subprocess.CompletedProcess[str]:
        command = [str(a) for a in argv]
        shown = shown or " ".join(command)
        print(f"$ {shown}", flush=True)
        return subprocess.run(
            command,
            cwd=self.scratch,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def check(self, name: str, ok: bool, seen: str = "") -> None:
        print(f"{'ok  ' if ok else 'FAIL'} {name}" + (f": {seen}" if seen else ""), flush=True)
        if not ok:
            self.failed.append(name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, help="create the venv here (must not exist)")
    parser.add_argument("--with", dest="extra", action="append", default=[], metavar="REQ")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gradweight-fresh-") as tmp:
        venv_dir = args.venv or Path(tmp) / "venv"
        if venv_dir.exists():
            parser.error(f"--venv {venv_dir} exists: name a new directory")
        scratch = Path(tmp) / "scratch"
        scratch.mkdir()
        venv.EnvBuilder(with_pip=True).create(venv_dir)
        return _check(Checks(venv_dir, scratch), args.extra)


def _check(c: Checks, extra: list[str]) -> int:
    pip = [c.bin / "python", "-m", "pip"]
    installed = c.run(*pip, "install", *extra, ROOT)
    c.check("pip install (runtime ranges only)", installed.returncode == 0, _tail(installed))
    if installed.returncode:
        return 1
    print(_last_line(installed.stdout, "Successfully installed"))

    listed = c.run(*pip, "list", "--format=json")
    names = {p["name"].lower(): p["version"] for p in json.loads(listed.stdout)}
    print("installed:", ", ".join(f"{n}=={v}" for n, v in sorted(names.items())))
    c.check("no extra pulled in", not EXTRAS_ONLY & set(names), str(EXTRAS_ONLY & set(names)))

    probe = c.run(c.bin / "python", "-c", PROBE, shown=f"{c.bin / 'python'} -c PROBE")
    if probe.returncode:
        c.check("import crosscheck and diagnose with numpy alone", False, _tail(probe))
    else:
        found = json.loads(probe.stdout)
        print("probe:", json.dumps(found))
        c.check("the installed package is imported", "site-packages" in found["file"])
        c.check("import crosscheck: no environment variable, no numpy", found["quiet_import"])
        c.check("py.typed installed", len(found["typed"]) == 3, str(found["typed"]))
        c.check("the oracle's token-mean gradient passes", found["right"][0] is False)
        c.check(
            "its microbatch-mean gradient is named microbatch-mean",
            found["wrong"][:2] == [True, "microbatch-mean"],
            str(found["wrong"]),
        )

    helped = c.run(c.bin / "crosscheck", "--help")
    c.check("crosscheck --help", helped.returncode == 0, _tail(helped))

    oracle = c.run(c.bin / "crosscheck", "run", "--impls", "oracle")
    c.check(
        "crosscheck run --impls oracle (the float64 oracle's matrix, numpy and rich alone)",
        oracle.returncode == 0,
        _last_line(oracle.stdout, "wall time") if oracle.returncode == 0 else _tail(oracle),
    )

    plot = c.run(c.bin / "crosscheck", "run", "--impls", "oracle", "--plot", "weights.png")
    output = (plot.stdout + plot.stderr).strip()
    c.check(
        "crosscheck run --plot without matplotlib: one-line set-up error, exit 2",
        plot.returncode == 2 and "Traceback" not in output and "gradweight[plot]" in output,
        f"exit {plot.returncode}, last line {output.splitlines()[-1] if output else ''!r}",
    )

    verify = c.run(
        *(c.bin / "crosscheck", "verify", "--framework", "torch", "--scheme", "token_mean"),
        *("--step", "no_such_module:step"),
    )
    output = (verify.stdout + verify.stderr).strip()
    c.check(
        "crosscheck verify --framework torch without torch: one-line set-up error, exit 2",
        verify.returncode == 2 and output.count("\n") == 0 and "gradweight[torch]" in output,
        f"exit {verify.returncode}: {output[-300:]!r}",
    )

    added = c.run(*pip, "install", "pytest>=9.0,<10")
    c.check("pip install pytest", added.returncode == 0, _tail(added))
    (c.scratch / "test_fresh.py").write_text(PLUGIN_TEST)
    pytest = [c.bin / "python", "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    listed_options = c.run(*pytest, "--help")
    c.check(
        "the pytest11 entry point adds --gradweight-timeout",
        "--gradweight-timeout" in listed_options.stdout,
    )
    for explicit in ([], ["-p", "crosscheck.pytest_plugin"]):
        session = c.run(*pytest, *explicit, "--gradweight-timeout", "30", "test_fresh.py")
        c.check(
            f"the gradweight fixture {'with -p' if explicit else 'from the entry point'}",
            session.returncode == 0,
            _last_line(session.stdout, "passed") or _tail(session),
        )
    print("all checks passed" if not c.failed else f"FAILED: {'; '.join(c.failed)}")
    return 1 if c.failed else 0


def _last_line(text: str, word: str) -> str:
    return next((line for line in reversed(text.splitlines()) if word in line), "")


def _tail(process: subprocess.CompletedProcess[str]) -> str:
    if process.returncode == 0:
        return ""
    return " | ".join((process.stdout + process.stderr).strip().splitlines()[-3:])


if __name__ == "__main__":
    sys.exit(main())
