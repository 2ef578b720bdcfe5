"""How the tests start the Python processes they check: the environment, a script, the CLI.

A child imports this checkout (the repository root first on PYTHONPATH, whatever the caller's
PYTHONPATH says after it) and runs JAX on the CPU only. A zygote and the workers it forks get
exactly the root and tests/ on PYTHONPATH instead (the probe steps live in tests/), and one
BLAS thread each.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def jax_env(xla_flags: str) -> dict[str, str]:
    """This process's environment for a JAX child on the CPU with `xla_flags`."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = xla_flags
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def zygote_env(**extra: str) -> dict[str, str]:
    """This process's environment for a zygote or a worker it forks, with `extra` set."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS)])
    env["JAX_PLATFORMS"] = "cpu"
    env["OPENBLAS_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def run_script(script: str, *args: str, env: dict[str, str], timeout: float, what: str) -> None:
    """`python SCRIPT ARGS` from the repository root; the test fails with the end of its
    stderr, naming it `what`, unless it exits 0."""
    run = subprocess.run(
        [sys.executable, script, *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert run.returncode == 0, f"{what} failed:\n{run.stderr[-4000:]}"


def run_cli(
    *argv: str, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """`python -m crosscheck ARGV` in a fresh process (from `cwd`, with `env`: the caller's
    when None), its output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "crosscheck", *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def x64_worker_results(script: str, out_dir: Path, timeout: float) -> Any:
    """What `script`, run as ``python SCRIPT --out FILE`` on 8 host devices with the small-
    program XLA flags, pickled to FILE: the JAX side of a test that needs x64 (global to a
    process) or the devices (fixed at JAX's import)."""
    from crosscheck.launch.workers import SMALL_PROGRAM_XLA_FLAGS

    out = out_dir / "results.pkl"
    flags = f"--xla_force_host_platform_device_count=8 {SMALL_PROGRAM_XLA_FLAGS}"
    run_script(script, "--out", str(out), env=jax_env(flags), timeout=timeout, what="JAX worker")
    with out.open("rb") as f:
        return pickle.load(f)


def write_worker_results(compute: Callable[[], Any]) -> None:
    """The script side of `x64_worker_results`: pickle ``compute()`` to the ``--out`` file."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    path = parser.parse_args().out
    results = compute()
    with open(path, "wb") as f:
        pickle.dump(results, f)
