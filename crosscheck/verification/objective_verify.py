r"""Verify a step against a multi-term objective: ``crosscheck verify --objective``.

The intended objective is a list of terms (docs/objectives.md): each with its per-token loss,
coefficient λ_k, scheme spec and scope,

.. math::  \text{total} = \sum_k \lambda_k L_k, \qquad
           L_k = \frac{1}{K_k} \sum_{u} \frac{\sum_{t \in u} a^k_t l^k_t}{D^k_u}.

The step is handed the multi-term model family's params that the terms read
(`objective_param_names`) and, for an ``mtp`` term, the shifted targets
(`crosscheck.verification.protocol`). Each case's gradient is judged by
`crosscheck.diagnosis.objective_diagnosis.diagnose_objective`, at the precision the step's own
arithmetic shows. A case is judged at the finest allowed level first (float64, then float32
for a float64 or float32 step, bf16 too for a bf16 one); when nothing fits there, neither the
intended objective nor a pattern, it moves to the finest allowed level whose tolerance admits
the relative residual of the per-(term, microbatch) fit, which is the step's rounding when its
error is a reweighting (``crosscheck.diagnosis.verdict.level_of``), or to the coarsest allowed
one. So a float32 step is judged at float32-level, and a float64 step whose term changed form
(routing statistics taken per microbatch: a large residual) is named at float64.

The verdict is per term: a term is *as intended* when every identifiable unit weight of it is
within the tolerance plus the measured noise (`ObjectiveDiagnosis.term_excess`), otherwise the
named pattern says what happened to it. The run's name is what explains *every* case, as for a
single scheme (`crosscheck.diagnosis.naming`): a pattern that coincides with the intended
objective at a case's layout (the world-size factor at R = 1) is consistent with that case.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from crosscheck.contract.objective_catalogue import OBJECTIVES
from crosscheck.contract.objective_terms import (
    FROZEN_PARAMS,
    PARAMS_USED,
    TRAINED_PARAMS,
    Term,
    mtp_targets,
    parse_objective,
)
from crosscheck.contract.schemes import load_reference
from crosscheck.diagnosis.objective_candidates import Candidate, term_scope
from crosscheck.diagnosis.objective_diagnosis import (
    AMBIGUOUS,
    INTENDED,
    TERM_SCALE,
    UNKNOWN,
    ObjectiveDiagnosis,
    diagnose_columns,
    diagnose_objective,
)
from crosscheck.diagnosis.verdict import (
    LEVEL_NAMES,
    PRECISIONS,
    auto_levels,
    coarsest_level,
    level_of,
    tolerance,
)
from crosscheck.fixtures.builtin import builtin_fixture
from crosscheck.fixtures.objective_params import objective_params
from crosscheck.judge.compare import finite_or_none
from crosscheck.verification.protocol import VerifyJob, VerifyOutput
from crosscheck.verification.report import refused_float64_line

#: The fixtures an objective is checked on by default: a packed one (segments, padding) and
#: rollouts (uneven rows per rank and microbatch, fully masked rows), both with router picks
#: far from a tie (`crosscheck.fixtures.objective_params`).
OBJECTIVE_FIXTURES: tuple[str, ...] = ("packed", "rollouts")


#: Why an objective is judged at float64 and float32 levels only. A correct bf16 step's
#: gradient is off by more than bf16's tolerance on a leaf that only a small auxiliary term
#: reaches (the router's, under moe_lb: measured 3.0e-02 against 2e-02 on ``packed``), and the
#: unit weights of a term with a small coefficient scatter beyond the noise the fit measures
#: (z_loss's microbatch weights 0.84 to 1.26): a verdict there would fail correct code.
BF16_WHY = (
    "a multi-term objective is judged at float64 and float32 levels only: bf16 rounding "
    "alone moves a small auxiliary term's gradient beyond bf16's tolerance (the router's, "
    "3% on a correct step), so a bf16 verdict could fail a correct step"
)
BF16_REFUSED = f"{BF16_WHY}; run the step in float32 (--dtype float32) to check its weighting"


@dataclass(frozen=True, slots=True)
class Objective:
    """The intended objective: its terms and the name it was given by."""

    name: str
    terms: tuple[Term, ...]

    @property
    def param_names(self) -> tuple[str, ...]:
        """The params its terms read, trained then frozen, in the oracle's order."""
        used = {p for term in self.terms for p in PARAMS_USED[term.kind]}
        return tuple(p for p in (*TRAINED_PARAMS, *FROZEN_PARAMS) if p in used)

    def describe(self) -> str:
        """Its terms in one line: ``ce + 0.01 z_loss + 0.01 moe_lb (microbatch)``."""
        parts = []
        for term in self.terms:
            coefficient = "" if term.coefficient == 1 else f"{term.coefficient:g} "
            scope = term_scope(term)
            where = "" if scope == "update" else f" ({scope})"
            label = term.name if term.name == term.kind else f"{term.name} [{term.kind}]"
            parts.append(f"{coefficient}{label}{where}")
        return " + ".join(parts).replace("+ -", "- ")


def resolve_objective(objective: str | Sequence[Mapping[str, Any] | Term]) -> Objective:
    """The objective a name, a ``MODULE:OBJECT`` or a list of terms gives.

    A name of `crosscheck.contract.objective_catalogue.OBJECTIVES` (``aux``, ``aux-local``);
    ``MODULE:OBJECT`` naming a list of term dicts (or `Term`s), imported from the current
    directory first as ``--step`` is; or the list itself. A bad term is a ValueError naming it.
    """
    if isinstance(objective, str):
        if objective in OBJECTIVES:
            return Objective(objective, parse_objective(OBJECTIVES[objective]))
        _, sep, attribute = objective.partition(":")
        if not sep or not attribute.isidentifier():
            raise ValueError(
                f"objective {objective!r}: not one of {', '.join(OBJECTIVES)}, nor "
                "MODULE:OBJECT naming a list of terms"
            )
        value = load_reference(objective, "objective")
        try:
            return Objective(objective, parse_objective(value))
        except ValueError as error:
            raise ValueError(f"objective {objective!r}: {error}") from None
    return Objective("custom", parse_objective(objective))


def objective_arrays(
    fixture_name: str, names: Sequence[str]
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(params, extra batch arrays) a step gets for an objective on a built-in fixture: the
    multi-term family's float64 params `names`, and ``mtp_targets`` [N, T] (y'_t, -100 where
    no next token of the segment) when ``mtp_unembed`` is among them."""
    fixture = builtin_fixture(fixture_name)
    params = objective_params(fixture)
    extra = {}
    if "mtp_unembed" in names:
        extra["mtp_targets"] = mtp_targets(fixture.targets, fixture.segment_ids)
    return {name: params[name] for name in names}, extra


@dataclass(frozen=True, slots=True)
class ObjectiveColumns:
    """What `diagnose_columns` takes for one job: the step's gradient is flattened in
    `names`' order (the model's parameters, sorted), leaves of `sizes`."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    basis: dict[str, np.ndarray]
    intended: np.ndarray
    found: list[Candidate]
    #: Indices into `names` of the parameters no term gives a gradient: left out of the
    #: worst-leaf error (`crosscheck.diagnosis.group_basis.dead_leaves`).
    dead: tuple[int, ...] = ()

    def flatten(self, grads: dict[str, np.ndarray]) -> np.ndarray:
        missing = sorted(set(self.names) - set(grads))
        if missing:
            raise ValueError(f"the gradient has no {missing[:5]}: not the model's parameters")
        return np.concatenate([np.asarray(grads[n], np.float64).reshape(-1) for n in self.names])


@dataclass(frozen=True, slots=True)
class ObjectiveCase:
    """The step on one fixture and layout, judged against the objective at `level`."""

    job: VerifyJob
    max_rel_err: float
    ok: bool
    diagnosis: ObjectiveDiagnosis | None
    #: The level the case was judged at (None when it did not run).
    level: str | None = None
    error: str = ""  # the step could not be run or read: why
    logged_denominator: float | None = None

    @property
    def consistent(self) -> set[str]:
        """The names consistent with this case: what fits it, and, when the intended objective
        does, the patterns that coincide with it at this layout."""
        d = self.diagnosis
        if d is None:
            return set()
        names = set(d.explanations)
        if d.intended_fits:
            names |= set(d.coinciding)
        return names

    def term_verdicts(self, objective: Objective) -> list[dict[str, Any]]:
        """Per term: its scale, unit weights and whether it is weighted as intended (or the
        pattern that hits it)."""
        d = self.diagnosis
        if d is None or self.level is None:
            return []
        rtol = tolerance(self.level)
        hit = {}
        for name in d.explanations:
            pattern, _, term = name.partition("(")
            if term:
                hit.setdefault(term.rstrip(")"), []).append(pattern)
        out = []
        for term in objective.terms:
            weights = d.unit_weights[term.name]
            known = weights[~np.isnan(weights)]
            as_intended = d.term_excess.get(term.name, math.inf) <= rtol and not hit.get(term.name)
            out.append(
                {
                    "term": term.name,
                    "kind": term.kind,
                    "coefficient": term.coefficient,
                    "scope": term_scope(term),
                    "scale": finite_or_none(d.term_scales[term.name]),
                    "unit_weight_min": finite_or_none(float(known.min())) if known.size else None,
                    "unit_weight_max": finite_or_none(float(known.max())) if known.size else None,
                    "as_intended": bool(as_intended),
                    "patterns": hit.get(term.name, []),
                }
            )
        return out

    def to_json(self, objective: Objective) -> dict[str, Any]:
        d = self.diagnosis
        return {
            **asdict(self.job),
            "max_rel_err": finite_or_none(self.max_rel_err),
            "ok": self.ok,
            "precision": self.level,
            "diagnosed_as": None if d is None else d.best_match,
            "explanations": [] if d is None else list(d.explanations),
            "residual": None if d is None else finite_or_none(d.residual),
            "terms": self.term_verdicts(objective),
            "logged_denominator": self.logged_denominator,
            "error": self.error,
        }


def judge_objective(
    job: VerifyJob,
    objective: Objective,
    output: VerifyOutput | BaseException,
    precision: str = "auto",
    columns: Callable[[VerifyJob], ObjectiveColumns] | None = None,
) -> ObjectiveCase:
    """Diagnose one gradient against the objective at the level its noise shows (module
    docstring); the case passes when the intended objective fits. `columns`: a user's model's
    per-term gradients of a job (``crosscheck.verification.objective_model``); None: the
    oracle's, on the fixture model family."""
    if isinstance(output, BaseException):
        return ObjectiveCase(job, math.inf, False, None, error=f"{type(output).__name__}: {output}")
    if output.returned_dtype == "bfloat16":
        return ObjectiveCase(job, math.inf, False, None, error=f"StepError: {BF16_REFUSED}")
    # A gradient that came back coarser than the params handed over is the step's own level.
    dtype = coarsest_level((job.dtype, output.returned_dtype)) or job.dtype
    allowed = auto_levels(dtype) if precision == "auto" else (precision,)
    names = [term.name for term in objective.terms]

    def at(level: str) -> ObjectiveDiagnosis:
        if columns is None:
            params, _ = objective_arrays(job.fixture, objective.param_names)
            batch = builtin_fixture(job.fixture).layout(job.world_size, job.accum_steps)
            return diagnose_objective(
                params, batch, objective.terms, output.grads, rtol=tolerance(level)
            )
        given = columns(job)
        g = given.flatten(output.grads)
        layout = (job.world_size, job.accum_steps)
        return diagnose_columns(
            g, given.sizes, names, given.basis, given.intended, given.found, layout,
            tolerance(level), given.dead,
        )  # fmt: skip

    try:
        level = allowed[0]
        d = at(level)
        # Coarser only while nothing fits: a float32 step never fits at float64, while a
        # float64 step whose term changed form (a large residual) is named at float64.
        if d.best_match == UNKNOWN and len(allowed) > 1 and math.isfinite(d.residual):
            level = level_of(d.residual, allowed) or allowed[-1]
            if level != allowed[0]:
                d = at(level)
    except (KeyError, ValueError) as error:  # wrong keys or shapes that got past the runner
        return ObjectiveCase(job, math.inf, False, None, error=f"StepError: {error}")
    return ObjectiveCase(
        job,
        d.intended_error,
        d.intended_fits,
        d,
        level,
        logged_denominator=output.logged_denominator,
    )


#: What each multi-term pattern did to term k, and what to change (docs/bugs.md).
_PATTERN_TEXT: dict[str, tuple[str, str]] = {
    "sibling-term-scope": (
        "{k} is normalized more locally than intended (per microbatch or per rank, its own "
        "count there): its tokens weigh by the size of their microbatch",
        "normalize {k} at its intended scope ({scope}): sum its per-token losses and divide by "
        "the term's own count over that scope, counted before the first backward and reduced "
        "over the ranks it spans (times R under DDP's averaging, as the main term)",
    ),
    "shifted-aux-count": (
        "{k}, whose shifted mask holds fewer tokens, is divided by the main term's count "
        "(Megatron-LM#2417)",
        "divide {k} by the count of its own mask (the valid shifted targets), not the main "
        "term's (Megatron-LM#3159)",
    ),
    "aux-world-size-factor": (
        "{k} was already complete on every rank and still took the main loss's world-size factor R",
        "add {k} after the main loss's x R (or compute it on the rank's own share of the "
        "update): a term each rank computes in full must not be multiplied by R",
    ),
    "aux-global-count-local-stats": (
        "{k}'s routing statistics (expert counts, router probability sums) are each "
        "microbatch's own, divided by the global token count like the main loss",
        "take {k}'s statistics at its intended scope ({scope}): at update scope, all-reduce the "
        "per-expert counts and the token count over the whole update before the backward; at "
        "microbatch scope, divide each microbatch's f · P by its own count and average over "
        "the microbatches",
    ),
    "aux-coefficient-twice": (
        "{k}'s coefficient is applied twice (the loss function returns λ L and the trainer "
        "multiplies by λ again)",
        "apply {k}'s coefficient once",
    ),
    "aux-summed-over-microbatches": (
        "{k}, meant as the mean over the update's R M forwards, is summed over them: it rides "
        "the main loss's factor R and is never divided by M (transformers' Trainer with a MoE "
        "model's router loss)",
        "add {k} after the main loss's x R and divide it by the M microbatches of the update "
        "(as TRL's SFTTrainer does, sft_trainer.py:1624-1629 at 1.16.0)",
    ),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class ObjectiveReport:
    """What `crosscheck.verify(..., objective=...)` found: one `ObjectiveCase` per case."""

    framework: str
    step: str
    objective: Objective
    precision: str = "auto"
    cases: list[ObjectiveCase] = field(default_factory=list)
    #: ``MODULE:FACTORY`` of the user's own model (``verify --model``), "" for the fixture
    #: model family; the dtype its reference ran in, and why not float64 when it is not.
    model: str = ""
    model_dtype: str = "float64"
    model_refused: str = ""

    @property
    def ok(self) -> bool:
        return bool(self.cases) and all(case.ok for case in self.cases)

    @property
    def intended_name(self) -> str:
        """The name of what the step was held to: the objective's."""
        return self.objective.name

    @property
    def max_rel_err(self) -> float:
        return max((case.max_rel_err for case in self.cases), default=math.inf)

    @property
    def diagnosed(self) -> list[ObjectiveCase]:
        return [case for case in self.cases if case.diagnosis is not None]

    @property
    def level(self) -> str | None:
        """The coarsest level a case was judged at (the one asked for, under a fixed one)."""
        levels = [case.level for case in self.diagnosed if case.level is not None]
        return max(levels, key=PRECISIONS.index) if levels else None

    @property
    def looks_bf16(self) -> bool:
        """Whether a failing case's residual, the step's rounding when its error is a
        reweighting, is beyond float32's tolerance and within bf16's: bf16 arithmetic behind
        a finer gradient, not a weighting that some pattern would explain."""
        return any(
            not case.ok and tolerance("float32") < case.diagnosis.residual <= tolerance("bfloat16")
            for case in self.diagnosed
        )

    @property
    def explanations(self) -> list[str]:
        """The names consistent with every diagnosed case (intended when each fits)."""
        sets = [case.consistent for case in self.diagnosed]
        if not sets:
            return []
        common = set.intersection(*sets)
        if all(case.ok for case in self.diagnosed):
            return [INTENDED]
        common.discard(INTENDED)
        patterns = sorted(n for n in common if n != TERM_SCALE)
        return patterns + ([TERM_SCALE] if TERM_SCALE in common else [])

    @property
    def best_match(self) -> str:
        """``intended``, the pattern that explains every case, ``ambiguous``, ``unknown``, or
        ``error`` when some case could not run and every one that did fits."""
        if not self.diagnosed or (not self.ok and all(c.ok for c in self.diagnosed)):
            return "error"
        names = self.explanations
        return names[0] if len(names) == 1 else (AMBIGUOUS if names else UNKNOWN)

    @property
    def described(self) -> ObjectiveCase | None:
        """The case the message details: a failing one named as the headline, on the largest
        layout with both ranks and microbatches, then the largest error."""
        diagnosed = self.diagnosed
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
        )

    @property
    def scale(self) -> float | None:
        """The scale of the term the run's name hits, on the detailed case (None where the
        name hits no one term)."""
        case = self.described
        _, _, term = self.best_match.partition("(")
        if case is None or not term:
            return None
        return case.diagnosis.term_scales.get(term.rstrip(")"))

    @property
    def weight_ratio(self) -> float | None:
        """None: an objective's weights are per term (`ObjectiveCase.term_verdicts`)."""
        return None

    def fix(self) -> str:
        """What to change for the run's name ("" when it fits or names nothing)."""
        if self.ok or self.best_match in ("error", AMBIGUOUS, UNKNOWN, TERM_SCALE):
            return ""
        pattern, _, term = self.best_match.partition("(")
        text = _PATTERN_TEXT.get(pattern)
        if text is None:
            return ""
        return _fill(text[1], term.rstrip(")"), self.objective)

    def headline(self) -> str:
        who = f"{self.step} ({self.framework})"
        n = len(self.cases)
        cases = f"{n} fixture/layout case{'s' * (n != 1)}"
        what = f"the objective {self.objective.name} ({self.objective.describe()})"
        ran = self.diagnosed
        if not ran:
            return f"{who} could not run: none of its {cases} ran (below)."
        finite = [c.max_rel_err for c in ran if math.isfinite(c.max_rel_err)]
        measured = [f"worst relative error {max(finite):.2e}"] if finite else []
        if len(finite) < len(ran):
            measured.append("a non-finite gradient")
        level = self.level
        at = f" at {LEVEL_NAMES[level]}" if level is not None else ""
        if level is not None:
            measured.append(f"tolerance {tolerance(level):.0e}")
        numbers = f" ({', '.join(measured)})" if measured else ""
        if self.ok:
            return f"{who} matches {what} on {cases}{at}{numbers}."
        failed = n - len(ran)
        if self.best_match == "error":
            return (
                f"{who} could not run {failed} of its {cases} (below); the {len(ran)} that ran "
                f"match {what}{at}{numbers}."
            )
        unran = f"; {failed} could not run (below)" if failed else ""
        return f"{who} does NOT match {what} on {cases}{at}{numbers}{unran}."

    def scales_line(self, term: str) -> str:
        """The least-squares scale of `term` on every layout run (per fixture where they
        differ by more than rounding): how a scale pattern's factor shows on each layout."""
        by_layout: dict[tuple[int, int], list[float]] = {}
        for case in self.diagnosed:
            scale = case.diagnosis.term_scales.get(term, math.nan)
            by_layout.setdefault((case.job.world_size, case.job.accum_steps), []).append(scale)
        parts = []
        for (R, M), scales in sorted(by_layout.items()):
            shown = sorted({f"{s:.4g}" for s in scales})
            parts.append(f"R={R},M={M}: {' / '.join(shown)}")
        return f"Scale of {term} on each layout: {'; '.join(parts)}."

    def term_lines(self, case: ObjectiveCase) -> list[str]:
        """One line per term of `case`: scope, scale, unit weights and the verdict."""
        lines = []
        for verdict in case.term_verdicts(self.objective):
            low, high = verdict["unit_weight_min"], verdict["unit_weight_max"]
            if low is None:
                weights = "no separable unit"
            else:
                weights = f"weights per microbatch {low:.4g}"
                weights += "" if f"{high:.4g}" == f"{low:.4g}" else f" to {high:.4g}"
            scale = verdict["scale"]
            scale_text = "scale -" if scale is None else f"scale {scale:.6g}"
            state = "as intended" if verdict["as_intended"] else "NOT as intended"
            if verdict["patterns"]:
                state = ", ".join(verdict["patterns"])
            lines.append(
                f"  {verdict['term']} ({verdict['kind']}, λ {verdict['coefficient']:g}, "
                f"{verdict['scope']}): {scale_text}, {weights}: {state}"
            )
        return lines

    def message(self) -> str:
        """The verdict, per term, the name and the fix, and any step errors."""
        lines = [self.headline()]
        if self.model_refused:
            lines.append(refused_float64_line(self.model_refused, self.model_dtype))
        best = self.best_match
        if self.ok:
            fixtures = sorted({c.job.fixture for c in self.cases})
            layouts = sorted({(c.job.world_size, c.job.accum_steps) for c in self.cases})
            text = ", ".join(f"({R}, {M})" for R, M in layouts)
            lines.append(
                f"Shown: every term weighted as intended on fixtures {', '.join(fixtures)} at "
                f"layouts (R, M) {text}."
            )
        elif best == AMBIGUOUS:
            lines.append(
                f"Every case fits {' and '.join(self.explanations)} alike: no case run tells "
                "them apart."
            )
        elif best == UNKNOWN:
            per_case = sorted({c.diagnosis.best_match for c in self.diagnosed if not c.ok})
            lines.append(
                "No single pattern explains every case (per case: " + ", ".join(per_case) + ")."
            )
            if self.looks_bf16:
                lines.append(
                    "The step's arithmetic looks bf16 (autocast, or a cast inside the model): "
                    "its gradient's residual is bf16-sized while the params are float32 or "
                    f"float64. {BF16_WHY[0].upper()}{BF16_WHY[1:]}: run it without the bf16 "
                    "arithmetic to check its weighting."
                )
        elif best != "error":
            pattern, _, term = best.partition("(")
            what = _PATTERN_TEXT.get(pattern)
            said = f": {_fill(what[0], term.rstrip(')'), self.objective)}" if what else ""
            lines.append(f"Explains every case: {best}{said}.")
            lines.append(self.scales_line(term.rstrip(")")))
        case = self.described
        if case is not None and best != "error":
            d = case.diagnosis
            lines.append(
                f"Per term on {case.job.fixture} R={case.job.world_size} "
                f"M={case.job.accum_steps} ({d.best_match}):"
            )
            lines += self.term_lines(case)
            fix = self.fix()
            if fix:
                lines.append(f"Fix: {fix} (docs/bugs.md#multi-term-objectives)")
        lines += [f"{c.job.describe()}: {c.error}" for c in self.cases if c.error]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        case = self.described
        level = self.level
        return {
            "ok": self.ok,
            "framework": self.framework,
            "step": self.step,
            "model": self.model or None,
            "model_dtype": self.model_dtype if self.model else None,
            "objective": self.objective.name,
            "terms": [term.to_data() for term in self.objective.terms],
            "precision": level,
            "precision_requested": self.precision,
            "max_rel_err": finite_or_none(self.max_rel_err),
            "tolerance": None if level is None else tolerance(level),
            "diagnosis": {
                "best_match": self.best_match,
                "matches": self.explanations,
                "fix": self.fix(),
                "fixture": None if case is None else case.job.fixture,
                "world_size": None if case is None else case.job.world_size,
                "accum_steps": None if case is None else case.job.accum_steps,
                "terms": [] if case is None else case.term_verdicts(self.objective),
            },
            "cases": [c.to_json(self.objective) for c in self.cases],
            "errors": [c.error for c in self.cases if c.error],
        }


def _fill(text: str, term_name: str, objective: Objective) -> str:
    term = next((t for t in objective.terms if t.name == term_name), None)
    scope = "update" if term is None else term_scope(term)
    return text.format(k=term_name, scope=scope)
