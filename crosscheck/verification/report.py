"""What `crosscheck.verify` found: one `VerifyCase` per fixture and layout, and the report.

A `VerifyReport` holds the intended scheme (its `SchemeSpec`, so ``Constant(C)`` keeps
its C) and every case's diagnosis. Its name for a failing step is the one that explains *every*
case of the run (``crosscheck.diagnosis.naming.headline``), never one case's best match; its
`message` says the verdict, what it rests on, the name and the fix, in words, and `to_json`
the same as a record.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from crosscheck.contract.spec import SchemeSpec
from crosscheck.diagnosis.diagnose import Diagnosis
from crosscheck.diagnosis.explain import fix_text, guide
from crosscheck.diagnosis.naming import AMBIGUOUS, UNKNOWN, headline, name_of
from crosscheck.diagnosis.verdict import LEVEL_NAMES, PRECISIONS, tolerance
from crosscheck.judge.compare import finite_or_none
from crosscheck.verification.protocol import VerifyJob


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
            **asdict(self.job),  # fixture, world_size, accum_steps, dtype
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
    scheme: SchemeSpec
    #: What was asked: "auto" or a level.
    precision: str = "auto"
    cases: list[VerifyCase] = field(default_factory=list)
    #: ``MODULE:FACTORY`` of the user's own model (``verify --model``), "" for the analytic one.
    model: str = ""
    #: The dtype the model's reference ran in, and why not float64 when it is not ("" then).
    model_dtype: str = "float64"
    model_refused: str = ""

    @property
    def ok(self) -> bool:
        return bool(self.cases) and all(case.ok for case in self.cases)

    @property
    def intended_name(self) -> str:
        """The name of what the step was held to: the intended scheme's."""
        return self.scheme.name

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
                c.job.processes * c.job.accum_steps,
                c.max_rel_err,
                c.job,
            ),
        ).diagnosis

    @property
    def scale(self) -> float | None:
        """The detailed case's least-squares scale on the intended gradient (None: no case)."""
        return None if self.diagnosis is None else self.diagnosis.scale

    @property
    def weight_ratio(self) -> float | None:
        """The detailed case's largest over smallest recovered group weight ratio."""
        return None if self.diagnosis is None else self.diagnosis.weight_ratio

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
        texts = [fix_text(n, self.framework) for n in names]
        return "; or ".join(texts) + f" ({guide(names, self.framework)})"

    def shown(self) -> str:
        """What the run showed, in one sentence."""
        fixtures = sorted({case.job.fixture for case in self.cases})
        layouts = sorted({case.job.layout for case in self.cases})
        split = any(layout.context_size > 1 for layout in layouts)
        text = ", ".join(
            f"({layout.world_size}, {layout.accum_steps}"
            + (f", {layout.context_size}" if split else "")
            + (f" {layout.context_order})" if layout.context_size > 1 else ")")
            for layout in layouts
        )
        level = LEVEL_NAMES.get(self.level or "", "no precision")
        return (
            f"{self.scheme.name} on fixtures {', '.join(fixtures)} at layouts "
            f"{'(R, M, C order)' if split else '(R, M)'} {text}, {level}"
        )

    def headline(self) -> str:
        """One sentence per outcome, never a dash or "inf" for a value there is not: verified;
        does NOT match (with the cases that could not run, if any); could not run (how many of
        how many, and what the cases that ran showed)."""
        who = f"{self.step} ({self.framework})"
        n = len(self.cases)
        ran = [case for case in self.cases if case.diagnosis is not None]
        failed = n - len(ran)
        level = self.level
        errors = [case.max_rel_err for case in ran]
        finite = [e for e in errors if math.isfinite(e)]
        measured = []
        if finite:
            measured.append(f"worst relative error {max(finite):.2e}")
        if len(finite) < len(errors):
            count = len(errors) - len(finite)
            measured.append(f"a non-finite gradient in {count} case{'s' * (count > 1)}")
        if level is not None:
            measured.append(f"tolerance {tolerance(level):.0e}")
        at = f" at {LEVEL_NAMES[level]}" if level is not None else ""
        numbers = f" ({', '.join(measured)})" if measured else ""
        cases = f"{n} fixture/layout case{'s' * (n != 1)}"
        if not ran:
            return f"{who} could not run: none of its {cases} ran (below)."
        if self.ok:
            return f"{who} matches {self.scheme.name} on {cases}{at}{numbers}."
        if self.best_match == "error":
            return (
                f"{who} could not run {failed} of its {cases} (below); the "
                f"{len(ran)} that ran match {self.scheme.name}{at}{numbers}."
            )
        if level is None:
            measured.append("no precision level fits the gradients' noise")
            numbers = f" ({', '.join(measured)})"
        unran = f"; {failed} could not run (below)" if failed else ""
        return f"{who} does NOT match {self.scheme.name} on {cases}{at}{numbers}{unran}."

    def sensitivity(self) -> str:
        """The smallest skew of one rank's (microbatch's) weights the run is sure to flag, at
        the level it states: under ``--precision auto`` a verdict may settle as coarse as the
        coarsest level the step's dtype allows, and that is the level the guarantee is for;
        ``--strict`` (float64) flags from the smaller skew given beside it."""
        skew = self.detectable_skew
        if skew is None:
            return ""
        per, minus_one = skew
        guaranteed = max(
            (d.skew_level for d in self.diagnosed if d.detectable_skew is not None),
            key=PRECISIONS.index,
        )
        text = (
            f"At {LEVEL_NAMES[guaranteed]} the run flags one {per}'s weights scaled by "
            f"1 + {minus_one:.1e} or more"
        )
        strict = [d.strict_skew[1] for d in self.diagnosed if d.strict_skew is not None]
        # A float64-exact step judged under auto: what it guarantees is the coarser level's,
        # and --strict, which it would pass, flags far smaller skews.
        if self.level == "float64" and guaranteed != "float64" and strict:
            text = (
                f"Judged at {LEVEL_NAMES['float64']}; under --precision auto a verdict may "
                f"settle as coarse as {LEVEL_NAMES[guaranteed]}, where the run flags one "
                f"{per}'s weights scaled by 1 + {minus_one:.1e} or more; --strict flags from "
                f"1 + {max(strict):.1e}"
            )
        return text + "."

    def message(self) -> str:
        """The verdict, what it rests on, the name and the fix, and any step errors."""
        lines = [self.headline()]
        if self.model_refused:
            lines.append(refused_float64_line(self.model_refused, self.model_dtype))
        if self.ok:
            lines.append(f"Shown: {self.shown()}.")
            sensitivity = self.sensitivity()
            if sensitivity:
                lines.append(sensitivity)
        best = self.best_match
        d = self.diagnosis
        if best == "error" and self.diagnosed:
            lines.append(
                "The run shows nothing wrong with the weighting, and nothing for the cases that "
                "could not run."
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
            lines.append(f"Diagnosis on {d.case}: {d.best_match}. {d.explanation}")
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
            "context_size": None if d is None else d.context_size,
            "context_order": None if d is None else d.context_order,
        }
        return {
            "ok": self.ok,
            "framework": self.framework,
            "step": self.step,
            "model": self.model or None,
            "model_dtype": self.model_dtype if self.model else None,
            "scheme": self.scheme.name,
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


def refused_float64_line(refused: str, dtype: str) -> str:
    """What the report says of a model whose forward refuses float64 (``verify --model``)."""
    return (
        f"The model's forward refuses float64 ({refused}): its reference and the step ran in "
        f"{dtype}, judged at {LEVEL_NAMES[dtype]} or coarser."
    )


def _separation_hint(names: Sequence[str]) -> str:
    if {"missing-world-size", "double-reduce-count"} <= set(names):
        return (
            "They differ only in the denominator the step believes in: call "
            "crosscheck.log_denominator(D) in the step."
        )
    if {"double-accum-divide", "missing-world-size"} & set(names):
        return "A layout with R != M (both above 1) tells them apart."
    return "A fixture or layout where they predict different weights tells them apart."
