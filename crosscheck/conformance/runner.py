"""Running the conformance settings: each through `crosscheck.verify`, held to its expectation.

`run_setting` runs one `Setting` (its adapter on the framework's real code, judged against the
documented scheme) and returns a `Row`: the installed versions, the verdict (``pass`` or the
name that explains every case), the precision, the worst error, and its `outcome` against the
expectations file. A framework that is not installed is skipped (`skipped_reason` says what
to install); a setting that cannot run here or waits for a verify capability is listed with
its reason and prediction, not run.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from importlib import metadata

from crosscheck.conformance.expectations import PASS, Expectation, expectation_for
from crosscheck.conformance.settings import TIMEOUT_S, Setting
from crosscheck.diagnosis.naming import AMBIGUOUS
from crosscheck.verification.objective_verify import ObjectiveReport
from crosscheck.verification.verifier import VerifyReport, verify

#: Outcomes of a row. Only DIFFERS and NO_EXPECTATION fail the command (exit 1); COULD_NOT_RUN
#: is exit 3; the rest are listed and pass.
AS_EXPECTED = "as expected"
DIFFERS = "differs"
NO_EXPECTATION = "no expectation"
COULD_NOT_RUN = "could not run"
NOT_RUN_HERE = "not run here"
WAITING = "waiting"

#: The extra of gradweight that installs each framework (pyproject.toml). The others
#: (torchtitan, google-tunix, verl) pin what the tested set excludes, so `make conformance`
#: installs them with --no-deps (scripts/constraints-conformance.txt says why, each).
EXTRAS = {
    "transformers": "hf",
    "accelerate": "hf",
    "trl": "hf",
    "datasets": "hf",
    "optax": "jax",
    "flax": "jax",
    "jax": "jax",
    "deepspeed": "deepspeed",
}


def installed_version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def skipped_reason(setting: Setting) -> str | None:
    """Why a setting that runs here is skipped in this environment (its framework or a
    distribution it needs is not installed), or None."""
    if not setting.runs:
        return None
    missing = [d for d in (setting.framework, *setting.also) if installed_version(d) is None]
    if not missing:
        return None
    extras = sorted({EXTRAS.get(d, d) for d in missing})
    return (
        f"{', '.join(missing)} not installed (pip install "
        f'"gradweight[{",".join(extras)}]" -c scripts/constraints-conformance.txt, or '
        "make conformance)"
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class Row:
    setting: Setting
    version: str | None
    #: The versions of the other distributions the row depends on.
    also: dict[str, str | None] = field(default_factory=dict)
    #: "pass", the name that explains every case ("rank-mean", "unknown", ...), "error"
    #: (a case could not run), or the row's state when it was not judged.
    verdict: str = ""
    precision: str | None = None
    max_rel_err: float | None = None
    scale: float | None = None
    weight_ratio: float | None = None
    cases: int = 0
    wall_s: float = 0.0
    expectation: Expectation | None = None
    outcome: str = ""
    #: verify's message (the verdict, what explains it, the fix), or why the row is not run.
    message: str = ""

    @property
    def label(self) -> str:
        """``framework==version``, or the framework with "(not installed)"."""
        if self.version is None:
            return f"{self.setting.framework} (not installed)"
        return f"{self.setting.framework}=={self.version}"

    def to_json(self) -> dict:
        s = self.setting
        return {
            "framework": s.framework,
            "setting": s.setting,
            "title": s.title,
            "version": self.version,
            "also": self.also,
            "intended": s.intended,
            "promise": s.promise,
            "source": s.source,
            "deviations": s.deviations,
            "verdict": self.verdict,
            "precision": self.precision,
            "max_rel_err": self.max_rel_err,
            "scale": self.scale,
            "weight_ratio": self.weight_ratio,
            "cases": self.cases,
            "fixtures": list(s.fixtures),
            "layouts": [[r, m] for r in s.world_sizes for m in s.accum],
            "wall_s": round(self.wall_s, 1),
            "expected": None if self.expectation is None else self.expectation.verdict,
            "evidence": None if self.expectation is None else self.expectation.evidence,
            "outcome": self.outcome,
            "command": s.command_line() if s.runs else None,
            "not_run": s.not_run,
            "waiting": s.waiting,
            "prediction": s.prediction,
            "message": self.message,
        }


def intended_of(setting: Setting) -> dict[str, str]:
    """``verify``'s keyword for what the setting means: its objective, else its scheme."""
    return {"objective": setting.objective} if setting.objective else {"scheme": setting.scheme}


def verdict_of(report: VerifyReport | ObjectiveReport) -> str:
    """``pass`` when the intended scheme explains every case, else the run's name for it;
    where the run's layouts cannot tell several names apart, each of them (``microbatch-mean
    or microstep-mean``), never a bare "ambiguous" that an expectation could not pin down."""
    if report.ok:
        return PASS
    if report.best_match == AMBIGUOUS:
        return " or ".join(report.explanations)
    return report.best_match


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def outcome_of(verdict: str, expectation: Expectation | None) -> str:
    if verdict == "error":
        return COULD_NOT_RUN
    if expectation is None:
        return NO_EXPECTATION
    return AS_EXPECTED if verdict == expectation.verdict else DIFFERS


def run_setting(setting: Setting, expectations: list[Expectation]) -> Row:
    """Run one installed setting through verify and hold its verdict to the expectations."""
    version = installed_version(setting.framework)
    also = {name: installed_version(name) for name in setting.also}
    if not setting.runs:
        return Row(
            setting=setting,
            version=version,
            also=also,
            verdict=NOT_RUN_HERE if setting.not_run else WAITING,
            outcome=NOT_RUN_HERE if setting.not_run else WAITING,
            message=setting.not_run or setting.waiting or "",
        )
    expectation = expectation_for(expectations, setting.framework, setting.setting, version or "")
    started = time.perf_counter()
    try:
        report = verify(
            setting.step,
            framework=setting.engine,
            **intended_of(setting),
            fixtures=list(setting.fixtures),
            world_sizes=list(setting.world_sizes),
            accum_steps=list(setting.accum),
            timeout_s=TIMEOUT_S,
            precision=setting.precision,
            model=setting.model,
            forward=setting.forward,
        )
    except ValueError as error:  # the adapter or its model could not be set up: no case ran
        return Row(
            setting=setting,
            version=version,
            also=also,
            verdict="error",
            wall_s=time.perf_counter() - started,
            expectation=expectation,
            outcome=COULD_NOT_RUN,
            message=f"set-up: {error}",
        )
    wall = time.perf_counter() - started
    verdict = verdict_of(report)
    return Row(
        setting=setting,
        version=version,
        also=also,
        verdict=verdict,
        precision=report.level,
        max_rel_err=_finite(report.max_rel_err),
        scale=None if report.ok else _finite(report.scale),
        weight_ratio=None if report.ok else _finite(report.weight_ratio),
        cases=len(report.cases),
        wall_s=wall,
        expectation=expectation,
        outcome=outcome_of(verdict, expectation),
        message=report.message(),
    )
