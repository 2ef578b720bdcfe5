"""What a diagnosis reports: the weighting a gradient has, against the one intended.

`crosscheck.diagnosis.diagnose` produces it; `explain` words it; the reports print it and
write it as JSON (`Diagnosis.to_json`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from crosscheck.contract.layout import Layout
from crosscheck.contract.spec import SchemeSpec
from crosscheck.diagnosis.verdict import tolerance
from crosscheck.judge.compare import finite_or_none

__all__ = ["Diagnosis", "GroupWeight"]


@dataclass(frozen=True, slots=True)
class GroupWeight:
    """The recovered per-token weight of one group of valid tokens."""

    rank: int
    microbatch: int
    row: int  # global row index
    segment: int
    tokens: int
    weight: float  # c_g: per-token weight (times u_t for weighted_mean)
    intended: float  # the intended scheme's c_g


@dataclass(frozen=True, kw_only=True, slots=True)
class Diagnosis:
    """What a gradient's weighting is, against what was intended."""

    fixture: str
    world_size: int
    accum_steps: int
    #: The intended scheme, with its parameters (Constant(C) keeps its C).
    scheme: SchemeSpec
    #: The dtype of the params the step was given.
    dtype: str
    #: The precision the verdict was given at: "float64", "float32" or "bfloat16".
    precision: str
    #: The measured noise placed the gradient at no allowed precision: nothing can fit.
    beyond_precision: bool
    #: Worst-leaf relative error against the intended scheme's gradient.
    intended_error: float
    #: Verification failed: the intended scheme does not fit at `precision`.
    detected: bool
    #: A candidate's name, "unknown" (nothing fits) or "ambiguous" (see `matches`).
    best_match: str
    #: The minimal explanations that fit (several when ambiguous).
    matches: tuple[str, ...]
    #: Every name that fits this case, those degenerate at this layout included: what a run
    #: intersects over its cases to find the name that explains them all.
    fits: tuple[str, ...]
    scale: float
    #: Largest over smallest ratio of a token's recovered weight to the intended weight.
    weight_ratio: float
    #: The intended scheme's own spread of per-token weights (largest over smallest).
    intended_weight_ratio: float
    #: Relative residual of the group least-squares fit, |G - sum c_g b_g| / |G|: the noise.
    residual: float
    condition_number: float
    well_posed: bool
    #: ("rank" or "microbatch", s - 1): the smallest skew of one rank's (microbatch's)
    #: weights this case is sure to flag at `skew_level`, given the measured noise; None at
    #: R = M = 1.
    detectable_skew: tuple[str, float] | None
    #: The worst unit of the weight test against the intended scheme, in words.
    worst_unit: str
    explanation: str
    #: What to change, in the user's terms ("" when the step is correct).
    fix: str = ""
    groups: tuple[GroupWeight, ...] = ()
    #: name -> smallest worst-leaf relative error of that name's predictions.
    candidate_errors: dict[str, float] = field(default_factory=dict)
    #: name -> the candidate's own details (a family's factors, a clipping convention).
    notes: dict[str, str] = field(default_factory=dict)
    #: Where the gradient holds NaN, inf or a value too large to fit (`unusable_entries`),
    #: in words; "" when it holds none.
    unusable: str = ""
    #: The level `detectable_skew` is for: the coarsest the verdict could have settled at
    #: (float32-level under auto for a float32 or float64 step), what it guarantees.
    skew_level: str = "float64"
    #: `detectable_skew` at float64 (what ``--strict`` is sure to flag).
    strict_skew: tuple[str, float] | None = None
    #: The framework of the step ("torch" or "jax"): the fix is said in its terms and points
    #: to its docs; None: both frameworks' are given.
    framework: str | None = None
    #: Context-parallel ranks splitting every row, and their order (1: none).
    context_size: int = 1
    context_order: str = "contiguous"

    @property
    def layout(self) -> Layout:
        return Layout(self.world_size, self.accum_steps, self.context_size, self.context_order)

    @property
    def case(self) -> str:
        """The fixture and layout in words: ``packed R=2 M=2`` (``... C=2 zigzag``)."""
        return f"{self.fixture} {self.layout.spelled()}"

    @property
    def intended(self) -> str:
        return self.scheme.name

    @property
    def tolerance(self) -> float:
        return tolerance(self.precision)

    def plot(self, path: str | Path, what: str = "") -> Path:
        """Draw the case as a PNG at `path` (`crosscheck.diagnosis.plot`): every group's
        recovered per-token weight against the intended one, a band per rank x microbatch
        unit, the pattern and its weight ratio in the title (`what`, e.g. the step, first).
        Needs matplotlib (``pip install 'gradweight[plot]'``)."""
        from crosscheck.diagnosis.plot import plot_diagnosis

        return plot_diagnosis(self, path, what)

    def to_json(self) -> dict[str, Any]:
        skew = self.detectable_skew
        return {
            "fixture": self.fixture,
            "world_size": self.world_size,
            "accum_steps": self.accum_steps,
            "context_size": self.context_size,
            "context_order": self.context_order,
            "intended": self.intended,
            "scheme": self.scheme.name,
            "dtype": self.dtype,
            "precision": self.precision,
            "tolerance": self.tolerance,
            "intended_error": finite_or_none(self.intended_error),
            "detected": self.detected,
            "best_match": self.best_match,
            "matches": list(self.matches),
            "fits": list(self.fits),
            "scale": finite_or_none(self.scale),
            "weight_ratio": finite_or_none(self.weight_ratio),
            "intended_weight_ratio": finite_or_none(self.intended_weight_ratio),
            "residual": finite_or_none(self.residual),
            "condition_number": finite_or_none(self.condition_number),
            "well_posed": self.well_posed,
            "detectable_skew": None if skew is None else {"per": skew[0], "minus_one": skew[1]},
            "skew_level": self.skew_level,
            "framework": self.framework,
            "worst_unit": self.worst_unit,
            "explanation": self.explanation,
            "fix": self.fix,
            "candidate_errors": {k: finite_or_none(v) for k, v in self.candidate_errors.items()},
            "notes": dict(self.notes),
        }
