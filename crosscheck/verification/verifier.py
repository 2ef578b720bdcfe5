"""Verify a user's training step: does it weight tokens the way the intended scheme says?

`verify` runs the step (see `crosscheck.verification.protocol` for what it is given and must return)
on several fixtures and layouts, in real processes, and judges every gradient against the
oracle's for the intended scheme at the precision the step's own numerics show
(``crosscheck.diagnosis.verdict``: float64-exact, float32-level, bf16-level; ``precision="float64"``
is the strict judgement). Several layouts by default, because one layout can hide a weighting
bug: a per-rank mean is exact whenever every rank holds the same number of tokens, a
per-microbatch mean is rank-mean at M = 1, and at R = M an extra factor R is an extra
factor M.

The name a failing step gets is the one that explains *every* case of the run
(``crosscheck.diagnosis.naming.headline``), never one case's best match.

``assert_weighting`` is the pytest-friendly form: it raises AssertionError whose message is
the diagnosis.

A ``--step`` that names a module or function that does not exist is a set-up error, not a
failing case: `check_step` finds it before any process starts and `verify` raises
`StepSetupError` (a ValueError) once, naming what is missing.
"""

from __future__ import annotations

import ast
import contextlib
import difflib
import importlib
import importlib.machinery
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib.machinery import ModuleSpec
from pathlib import Path
from typing import Any, Literal

from crosscheck.contract.schemes import Scheme, get_scheme
from crosscheck.diagnosis.diagnose import Diagnosis, diagnose
from crosscheck.diagnosis.explain import FAMILY_FIXES, GUIDE
from crosscheck.diagnosis.naming import AMBIGUOUS, UNKNOWN, headline, name_of
from crosscheck.diagnosis.patterns import PATTERNS
from crosscheck.diagnosis.verdict import LEVEL_NAMES, PRECISIONS, tolerance
from crosscheck.fixtures.builtin import builtin_fixture
from crosscheck.judge.compare import finite_or_none
from crosscheck.verification.protocol import StepError, VerifyJob, VerifyOutput

Framework = Literal["torch", "jax"]
FRAMEWORKS = {
    "torch": "crosscheck.verification.torch_verify",
    "jax": "crosscheck.verification.jax_verify",
}
#: Two fixtures whose ranks and microbatches hold different token counts (so local means
#: differ from global ones) and one of them packed (so per-row is not per-sequence).
DEFAULT_FIXTURES: tuple[str, ...] = ("packed", "ragged")
#: Ranks alone, accumulation alone, both with R = M, four ranks, and both with R != M (where
#: an extra factor R and an extra factor M differ).
DEFAULT_LAYOUTS: tuple[tuple[int, int], ...] = ((2, 1), (1, 2), (2, 2), (4, 1), (2, 4))
DEFAULT_TIMEOUT_S = 120.0
DTYPES: tuple[str, ...] = ("float64", "float32", "bfloat16")


@dataclass(frozen=True, slots=True)
class VerifyCase:
    """The step on one fixture and layout: its error against the oracle and its diagnosis."""

    job: VerifyJob
    max_rel_err: float
    ok: bool
    diagnosis: Diagnosis | None
    error: str = ""  # the step could not be run or read: why
    logged_denominator: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "fixture": self.job.fixture,
            "world_size": self.job.world_size,
            "accum_steps": self.job.accum_steps,
            "dtype": self.job.dtype,
            "max_rel_err": finite_or_none(self.max_rel_err),
            "ok": self.ok,
            "logged_denominator": self.logged_denominator,
            "diagnosis": None if self.diagnosis is None else self.diagnosis.to_json(),
            "error": self.error,
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class VerifyReport:
    framework: str
    step: str
    scheme: Scheme
    #: What was asked: "auto" or a level.
    precision: str = "auto"
    cases: list[VerifyCase] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.cases) and all(case.ok for case in self.cases)

    @property
    def max_rel_err(self) -> float:
        return max((case.max_rel_err for case in self.cases), default=math.inf)

    @property
    def diagnosed(self) -> list[Diagnosis]:
        return [case.diagnosis for case in self.cases if case.diagnosis is not None]

    @property
    def level(self) -> str | None:
        """The precision the run was judged at: the one asked for, or, automatically, the
        coarsest of its cases' (a case whose noise no allowed level admits has none)."""
        if self.precision != "auto":
            return self.precision
        levels = [d.precision for d in self.diagnosed if not d.beyond_precision]
        return max(levels, key=PRECISIONS.index) if levels else None

    @property
    def explanations(self) -> list[str]:
        """The minimal names that explain every diagnosed case (see crosscheck.diagnosis.naming)."""
        if self.ok:
            return [self.scheme.name]
        return headline([d.fits for d in self.diagnosed], self.scheme.name)

    @property
    def best_match(self) -> str:
        """The run's name: the intended scheme, a pattern or family explaining every case,
        "ambiguous", "unknown", or "error" when a case could not be run and every case that
        could matches (nothing is wrong with the weighting that the run could show)."""
        if not self.diagnosed or (not self.ok and all(not d.detected for d in self.diagnosed)):
            return "error"
        return name_of(self.explanations)

    @property
    def diagnosis(self) -> Diagnosis | None:
        """The case that shows the headline best: a failing case named as the headline, on the
        largest layout with both ranks and microbatches, then the largest error."""
        diagnosed = [case for case in self.cases if case.diagnosis is not None]
        failing = [case for case in diagnosed if not case.ok] or diagnosed
        if not failing:
            return None
        best = self.best_match
        return max(
            failing,
            key=lambda c: (
                c.diagnosis.best_match == best,
                min(c.job.world_size, c.job.accum_steps) > 1,
                c.job.world_size * c.job.accum_steps,
                c.max_rel_err,
                c.job,
            ),
        ).diagnosis

    @property
    def detectable_skew(self) -> tuple[str, float] | None:
        """The largest (least sensitive) per-rank skew threshold over the cases."""
        skews = [d.detectable_skew for d in self.diagnosed if d.detectable_skew is not None]
        ranks = [s for s in skews if s[0] == "rank"] or skews
        return max(ranks, key=lambda s: s[1]) if ranks else None

    def fix(self) -> str:
        """What to change, for the run's name ("" when correct or when only errors failed)."""
        if self.ok or self.best_match == "error":
            return ""
        names = self.explanations
        if not names:
            return self.diagnosis.fix if self.diagnosis else ""
        texts = [
            PATTERNS[n].fix if n in PATTERNS else FAMILY_FIXES.get(n, f"the step computes {n}")
            for n in names
        ]
        return "; or ".join(texts) + f" ({GUIDE})"

    def shown(self) -> str:
        """What the run showed, in one sentence."""
        fixtures = sorted({case.job.fixture for case in self.cases})
        layouts = sorted({(case.job.world_size, case.job.accum_steps) for case in self.cases})
        text = ", ".join(f"({R}, {M})" for R, M in layouts)
        level = LEVEL_NAMES.get(self.level or "", "no precision")
        return (
            f"{self.scheme.spec} on fixtures {', '.join(fixtures)} at layouts (R, M) {text}, "
            f"{level}"
        )

    def message(self) -> str:
        """The verdict, what it rests on, the name and the fix, and any step errors."""
        level = self.level
        tol = f"tolerance {tolerance(level):.0e}" if level else "no precision"
        verdict = "matches" if self.ok else "does NOT match"
        lines = [
            f"{self.step} ({self.framework}) {verdict} {self.scheme.spec} on "
            f"{len(self.cases)} fixture/layout cases at {LEVEL_NAMES.get(level or '', '-')} "
            f"(worst relative error {self.max_rel_err:.2e}, {tol})."
        ]
        skew = self.detectable_skew
        if self.ok:
            lines.append(f"Shown: {self.shown()}.")
            if skew is not None:
                lines.append(
                    f"The run would have flagged one {skew[0]}'s weights scaled by "
                    f"1 + {skew[1]:.1e} or more."
                )
        best = self.best_match
        d = self.diagnosis
        errored = [case for case in self.cases if case.error]
        if best == "error" and self.diagnosed:
            lines.append(
                f"Every case that ran matches; {len(errored)} could not be run or read (below): "
                "the run shows nothing wrong with the weighting, and nothing for those cases."
            )
        if not self.ok and best != "error":
            names = self.explanations
            if best == AMBIGUOUS:
                lines.append(
                    f"Every case fits {' and '.join(names)} alike: no case run tells them "
                    f"apart. {_separation_hint(names)}"
                )
            elif best == UNKNOWN:
                per_case = sorted({x.best_match for x in self.diagnosed if x.detected})
                lines.append(
                    "No single scheme, pattern or family explains every case (per case: "
                    f"{', '.join(per_case)})."
                )
            else:
                lines.append(f"Explains every case: {best}.")
        if d is not None and not self.ok and best != "error":
            lines.append(
                f"Diagnosis on {d.fixture} R={d.world_size} M={d.accum_steps}: "
                f"{d.best_match}. {d.explanation}"
            )
            fix = self.fix()
            if fix:
                lines.append(f"Fix: {fix}")
        lines += [f"{case.job.describe()}: {case.error}" for case in self.cases if case.error]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        d = self.diagnosis
        skew = self.detectable_skew
        summary = {
            "best_match": self.best_match,
            "matches": self.explanations,
            "weight_ratio": None if d is None else finite_or_none(d.weight_ratio),
            "scale": None if d is None else finite_or_none(d.scale),
            "residual": None if d is None else finite_or_none(d.residual),
            "explanation": "" if d is None else d.explanation,
            "fix": "" if self.ok else self.fix(),
            "fixture": None if d is None else d.fixture,
            "world_size": None if d is None else d.world_size,
            "accum_steps": None if d is None else d.accum_steps,
        }
        return {
            "ok": self.ok,
            "framework": self.framework,
            "step": self.step,
            "scheme": self.scheme.spec,
            "precision": self.level,
            "precision_requested": self.precision,
            "max_rel_err": finite_or_none(self.max_rel_err),
            "tolerance": None if self.level is None else tolerance(self.level),
            "detectable_skew": None if skew is None else {"per": skew[0], "minus_one": skew[1]},
            "shown": self.shown(),
            "diagnosis": summary,
            "cases": [case.to_json() for case in self.cases],
            "errors": [case.error for case in self.cases if case.error],
        }


def _separation_hint(names: Sequence[str]) -> str:
    if {"missing-world-size", "double-reduce-count"} <= set(names):
        return (
            "They differ only in the denominator the step believes in: call "
            "crosscheck.log_denominator(D) in the step."
        )
    if {"double-accum-divide", "missing-world-size"} & set(names):
        return "A layout with R != M (both above 1) tells them apart."
    return "A fixture or layout where they predict different weights tells them apart."


def step_name(step: str | Callable) -> str:
    """'module:function' for a step given by name or as an importable function."""
    if isinstance(step, str):
        module, sep, function = step.partition(":")
        if not sep or not module or not function:
            raise ValueError(f"a step is named MODULE:FUNCTION, got {step!r}")
        return step
    module = getattr(step, "__module__", None)
    qualname = getattr(step, "__qualname__", "")
    if not module or module == "__main__" or "<" in qualname:
        raise ValueError(
            f"the step {step!r} must be a module-level function of an importable module "
            "(it runs in fresh processes, which import it by name)"
        )
    return f"{module}:{qualname}"


class StepSetupError(ValueError):
    """The step cannot be found: no such module, no such attribute, or not callable.

    Raised by `verify` (through `check_step`) before any runner starts: the user's set-up is
    wrong, and no case is run or reported.
    """


#: The one subprocess that imports the step's module to look for the function may take this
#: long (importing torch or JAX is most of it); past it the check gives up and the runners,
#: which bound their own waits, report whatever the import does.
STEP_CHECK_TIMEOUT_S = 60.0
_ROOT = str(Path(__file__).resolve().parents[2])

#: Run as ``python -c`` in the caller's directory: import the module, find the attribute,
#: write what was found as JSON, and leave at once (os._exit: threads the module started must
#: not keep the check alive).
_CHECK_SOURCE = """
import importlib, json, os, sys
module_name, attribute, cwd, out, parent_path = sys.argv[1:6]
sys.path[:0] = [p for p in [cwd, *json.loads(parent_path)] if p not in sys.path]
def report(kind, detail=None):
    with open(out, "w") as f:
        json.dump({"kind": kind, "detail": detail}, f)
    os._exit(0)
try:
    value = importlib.import_module(module_name)
except ModuleNotFoundError as error:
    missing = error.name or ""
    if missing and (module_name == missing or module_name.startswith(missing + ".")):
        report("no-module", missing)
    report("import-failed", f"{type(error).__name__}: {error}")
except BaseException as error:
    report("import-failed", f"{type(error).__name__}: {error}")
origin = getattr(value, "__file__", None) or module_name
for part in attribute.split("."):
    try:
        found = hasattr(value, part)
    except BaseException as error:
        report("import-failed", f"{type(error).__name__}: {error}")
    if not found:
        names = sorted(n for n in dir(value) if not n.startswith("_")
                       and callable(getattr(value, n, None)))
        report("no-attribute", [part, origin, names])
    value = getattr(value, part)
if not callable(value):
    report("not-callable", [origin, f"{type(value).__name__} {value!r:.80}"])
report("ok")
"""


def _spec_without_importing(module: str, cwd: str) -> ModuleSpec | None:
    """The module's spec, found as the runners' import would (`cwd` first), importing nothing.

    A dotted name's packages are walked by their search locations, not imported (importing a
    package runs its ``__init__``). None when the top-level name is found nowhere; a spec
    whose name is a parent's when the walk cannot go further (a module that is not a
    package, a package that builds its path at import): only importing it can tell.
    """
    parts = module.split(".")
    spec = importlib.machinery.PathFinder.find_spec(parts[0], [cwd])
    if spec is None:
        try:  # the interpreter's own path, meta-path finders (editable installs) included
            spec = importlib.util.find_spec(parts[0])
        except (ImportError, ValueError):
            spec = None
    if spec is None:
        return None
    for index in range(1, len(parts)):
        locations = spec.submodule_search_locations
        if not locations:
            return spec
        child = importlib.machinery.PathFinder.find_spec(".".join(parts[: index + 1]), locations)
        if child is None:
            return spec
        spec = child
    return spec


def _defined_at_top_level(source: str, name: str) -> bool:
    """Whether the module file at `source` defines function or class `name` at top level."""
    try:
        tree = ast.parse(Path(source).read_bytes(), filename=source)
    except (OSError, SyntaxError, ValueError):
        return False
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return any(isinstance(node, kinds) and node.name == name for node in tree.body)


def _import_check(
    module: str, function: str, cwd: str, framework: str, timeout_s: float
) -> dict[str, Any] | None:
    """What importing `module` and looking up `function` finds, in one short subprocess (the
    user's module may import torch or JAX, or do anything at import: never in this process).
    None when the check could not tell (it timed out or died)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (cwd, _ROOT, env.get("PYTHONPATH", "")) if p)
    if framework == "jax":  # as the JAX worker has them, for a module that reads them at import
        env.setdefault("JAX_PLATFORMS", "cpu")
        env["JAX_ENABLE_X64"] = "1"
    with tempfile.TemporaryDirectory(prefix="gradweight-step-check-") as tmp:
        out = Path(tmp) / "found.json"
        argv = [module, function, cwd, str(out), json.dumps([p for p in sys.path if p])]
        process = subprocess.Popen(
            [sys.executable, "-c", _CHECK_SOURCE, *argv],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # its own group: whatever the import starts goes with it
        )
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        finally:
            # Kill the group even when the leader has exited: the import may have started
            # processes of its own.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        try:
            return json.loads(out.read_text())
        except (OSError, ValueError):
            return None


def check_step(
    step: str,
    framework: str = "torch",
    *,
    cwd: str | None = None,
    timeout_s: float = STEP_CHECK_TIMEOUT_S,
) -> None:
    """Raise `StepSetupError` if ``MODULE:FUNCTION`` names no importable module, or a module
    without that callable, as the runners would import it from `cwd` (default: the current
    directory, first on the path).

    The module is never imported into this process. A top-level module that exists nowhere
    is refused at once; a plain source file that defines the function at top level passes
    without running anything; anything else is imported in one short subprocess (bounded by
    `timeout_s`). Only a missing module, a missing attribute or a non-callable one is refused:
    a module that raises at import, or a check that cannot finish, is left to the runners,
    which report it per case in their own environment.
    """
    module, _, function = step_name(step).partition(":")
    cwd = os.getcwd() if cwd is None else cwd
    spec = _spec_without_importing(module, cwd)
    if spec is None:
        top = module.split(".")[0]
        raise StepSetupError(
            f"--step {step}: no module named {top!r} in {cwd} (the current directory) or on "
            "the Python path"
        )
    origin = spec.origin if spec.name == module and spec.has_location else None
    if origin and origin.endswith(".py") and _defined_at_top_level(origin, function):
        return
    found = _import_check(module, function, cwd, framework, timeout_s)
    kind = None if found is None else found.get("kind")
    detail = None if found is None else found.get("detail")
    if kind == "no-module":
        raise StepSetupError(
            f"--step {step}: no module named {detail!r} in {cwd} (the current directory) or "
            "on the Python path"
        )
    if kind == "no-attribute":
        part, where, names = detail
        close = difflib.get_close_matches(part, names, n=3)
        shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        if close:
            hint = f"; did you mean {' or '.join(close)}?"
        else:
            hint = f"; its callables: {shown}" if names else "; it defines no public callable"
        raise StepSetupError(f"--step {step}: {module} ({where}) has no attribute {part!r}{hint}")
    if kind == "not-callable":
        where, what = detail
        raise StepSetupError(
            f"--step {step}: {module}:{function} ({where}) is not callable: it is {what}"
        )


def jobs_for(
    fixtures: Sequence[str] | None,
    world_sizes: Sequence[int] | None,
    accum_steps: Sequence[int] | None,
    dtype: str = "float64",
) -> list[VerifyJob]:
    """Every (fixture, R, M) asked for. A layout asked for explicitly that does not divide a
    fixture's rows is refused, naming both: a check that was asked for never silently drops.
    Default layouts are kept where they divide (each fixture keeps at least one)."""
    names = list(fixtures or DEFAULT_FIXTURES)
    explicit = world_sizes is not None or accum_steps is not None
    if explicit:
        layouts = [(R, M) for R in world_sizes or (1, 2) for M in accum_steps or (1, 2)]
    else:
        layouts = list(DEFAULT_LAYOUTS)
    jobs = []
    for name in names:
        rows = builtin_fixture(name).num_rows
        fitting = [(R, M) for R, M in layouts if rows % (R * M) == 0]
        misfits = [(R, M) for R, M in layouts if rows % (R * M)]
        if (explicit and misfits) or not fitting:
            text = ", ".join(f"R={R},M={M}" for R, M in misfits)
            raise ValueError(
                f"fixture {name!r} has {rows} rows: no layout divides them among {text}; "
                "choose layouts with R x M dividing the rows, or other fixtures"
                if not fitting
                else f"fixture {name!r} has {rows} rows, which {text} does not divide "
                "(R x M must divide the rows); drop that layout or that fixture"
            )
        jobs += [
            VerifyJob(fixture=name, world_size=R, accum_steps=M, dtype=dtype) for R, M in fitting
        ]
    return jobs


def judge(
    job: VerifyJob,
    scheme: Scheme,
    output: VerifyOutput | BaseException,
    precision: str = "auto",
) -> VerifyCase:
    """Diagnose one gradient at `precision`; the case passes when the intended scheme fits."""
    if isinstance(output, BaseException):
        return VerifyCase(job, math.inf, False, None, f"{type(output).__name__}: {output}")
    fixture = builtin_fixture(job.fixture)
    try:
        d = diagnose(
            fixture,
            job.world_size,
            job.accum_steps,
            output.grads,
            scheme,
            dtype=job.dtype,
            precision=precision,
            logged_denominator=output.logged_denominator,
        )
    except ValueError as error:  # wrong keys or shapes that got past the runner
        return VerifyCase(job, math.inf, False, None, f"StepError: {error}")
    return VerifyCase(
        job, d.intended_error, not d.detected, d, logged_denominator=output.logged_denominator
    )


def verify(
    step: str | Callable,
    *,
    framework: Framework,
    scheme: str | Scheme,
    fixtures: Sequence[str] | None = None,
    world_sizes: Sequence[int] | None = None,
    accum_steps: Sequence[int] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    precision: str = "auto",
    dtype: str = "float64",
) -> VerifyReport:
    """Run `step` (see crosscheck.verification.protocol) on every fixture and layout and judge it.

    `scheme` is a Scheme object (``Constant(4096)`` keeps its C) or a name (``constant:4096``
    reads as that). Layouts default to DEFAULT_LAYOUTS; given `world_sizes` and/or
    `accum_steps`, their product (the missing one defaults to (1, 2)). `dtype` is the dtype
    of the model / params handed to the step. `precision` is "auto" (the finest level the
    step's noise allows: float64, float32, or bfloat16 when `dtype` is) or a level to judge
    at; "float64" is the strict float64 judgement. The report's `ok` is True only when the
    intended scheme fits every case.

    Raises ValueError for bad arguments, and `StepSetupError` (a ValueError) when `step`
    names a module or function that does not exist (`check_step`), before any process starts.
    """
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework must be one of {', '.join(FRAMEWORKS)}, got {framework!r}")
    intended = get_scheme(scheme)
    if not intended.intended:
        raise ValueError(f"verify checks an intended scheme; {intended.name!r} is accidental")
    if precision != "auto" and precision not in PRECISIONS:
        raise ValueError(f"precision must be auto or one of {', '.join(PRECISIONS)}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    name = step_name(step)
    jobs = jobs_for(fixtures, world_sizes, accum_steps, dtype)
    # Once, before any process starts: a step that does not exist is a set-up error (raised
    # here, exit 2 on the command line), never a failing case per fixture and layout.
    check_step(name, framework, timeout_s=min(timeout_s, STEP_CHECK_TIMEOUT_S))
    runner = importlib.import_module(FRAMEWORKS[framework])
    outputs = runner.run(name, jobs, timeout_s=timeout_s)
    cases = [
        judge(
            job,
            intended,
            outputs.get(job, StepError(f"{job.describe()}: planned but never reported")),
            precision,
        )
        for job in jobs
    ]
    return VerifyReport(
        framework=framework, step=name, scheme=intended, precision=precision, cases=cases
    )


def assert_weighting(step: str | Callable, **kwargs: Any) -> VerifyReport:
    """`verify(step, **kwargs)`, raising AssertionError with the diagnosis unless it matches."""
    report = verify(step, **kwargs)
    if not report.ok:
        raise AssertionError(report.message())
    return report
