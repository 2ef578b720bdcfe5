"""Judging hypotheses at a precision: which candidates fit a gradient, at which level.

The statistics are `crosscheck.diagnosis.verdict`'s; this module applies them to the candidates of a
diagnosis. It starts at the level the gradient's noise allows and moves to a coarser allowed
level only while nothing but a family (``crosscheck.diagnosis.families``) fits there: a float64 step
whose 1/D was rounded to float32 is 6e-8 off *inside* the span of the groups, where the
residual cannot see it, and agrees at float32-level; a float32 step never agrees at float64.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from crosscheck.diagnosis.candidates import Candidate
from crosscheck.diagnosis.naming import logged_agrees
from crosscheck.diagnosis.verdict import GroupFit, check_weights, level_of, tolerance


def per_group_weights(
    weights: np.ndarray, group_of: np.ndarray, units: np.ndarray
) -> np.ndarray | None:
    """A weighting's per-unit weight in every group, or None when it varies inside a group or
    weighs a token outside every group (then it is not a reweighting of the groups)."""
    carries = group_of >= 0
    if np.any(weights[~carries] != 0):
        return None
    num_groups = int(group_of.max(initial=-1)) + 1
    ratio = weights[carries] / units[carries]
    ids = group_of[carries]
    low = np.full(num_groups, np.inf)
    high = np.full(num_groups, -np.inf)
    np.minimum.at(low, ids, ratio)
    np.maximum.at(high, ids, ratio)
    spread = np.max(high - low, initial=0.0)
    if not spread <= 1e-12 * np.max(np.abs(ratio), initial=0.0):
        return None
    return low


@dataclass(frozen=True, slots=True)
class Judged:
    """One candidate judged at the diagnosis' precision."""

    candidate: Candidate
    error: float
    fits: bool


def noise_level(
    fit: GroupFit,
    gradient: np.ndarray,
    candidates: Sequence[Candidate],
    per_group: Sequence[np.ndarray | None],
    predict_flat: Callable[[Candidate], np.ndarray],
    allowed: Sequence[str],
) -> str | None:
    """The finest allowed level the gradient's noise admits (None: beyond every one).

    The noise is the group fit's residual; a weighting that varies inside the groups (another
    scheme's soft weights), or a candidate that is no weighting at all
    (`Candidate.leaf_scales`), is out of their span, and its own residual counts too
    (`predict_flat`: its flat gradient). When the fit leaves no dimension to see noise in,
    every hypothesis's residual counts.
    """
    norm_g = float(np.linalg.norm(gradient)) if np.isfinite(gradient).all() else math.inf
    if not (math.isfinite(norm_g) and norm_g > 0):
        return level_of(fit.residual, allowed)
    noise = fit.residual if fit.noise_measurable else math.inf
    for candidate, c_hyp in zip(candidates, per_group, strict=True):
        if c_hyp is None or not fit.noise_measurable:
            distance = float(np.linalg.norm(gradient - predict_flat(candidate)))
            noise = min(noise, distance / norm_g)
    return level_of(noise, allowed)


def _judge_at(
    level: str,
    fit: GroupFit,
    candidates: Sequence[Candidate],
    per_group: Sequence[np.ndarray | None],
    errors: Sequence[float],
    labels: Sequence[str],
    logged: float | None,
) -> tuple[list[Judged], str]:
    """Every candidate judged at `level`, and a note when the logged D agrees with no pattern.

    A logged denominator only breaks ties: among the patterns that fit, those that would have
    logged something else are dropped, unless that would drop them all (the gradient outranks
    a log that may count something else; the note says so).
    """
    fits = []
    for c_hyp, err in zip(per_group, errors, strict=True):
        ok = err <= tolerance(level)
        if ok and c_hyp is not None:
            ok = check_weights(fit, c_hyp, level, labels).ok
        fits.append(ok)
    note = ""
    if logged is not None:
        patterns = [i for i, c in enumerate(candidates) if fits[i] and c.kind == "pattern"]
        agree = [
            i
            for i in patterns
            if logged_agrees(candidates[i].logged_denominator, logged, tolerance(level))
        ]
        if agree:
            for i in set(patterns) - set(agree):
                fits[i] = False
        elif patterns:
            note = (
                f"the logged denominator {logged:g} is none of what the fitting patterns log; "
                "named from the gradient alone"
            )
    judged = [Judged(c, e, f) for c, e, f in zip(candidates, errors, fits, strict=True)]
    return judged, note


def judge_levels(
    fit: GroupFit,
    candidates: Sequence[Candidate],
    per_group: Sequence[np.ndarray | None],
    errors: Sequence[float],
    noise_level: str | None,
    allowed: Sequence[str],
    labels: Sequence[str],
    logged: float | None,
) -> tuple[str, list[Judged], str]:
    """(level, judged candidates, log note): from the noise's level towards the coarsest
    allowed one, the first level where the intended scheme, a pattern or a scheme fits; where
    none ever does, the noise's level (families may name the gradient there)."""
    if noise_level is None:
        never = [Judged(c, e, False) for c, e in zip(candidates, errors, strict=True)]
        return allowed[-1], never, ""
    first = None
    for level in allowed[allowed.index(noise_level) :]:
        judged, note = _judge_at(level, fit, candidates, per_group, errors, labels, logged)
        if first is None:
            first = (level, judged, note)
        if any(j.fits and j.candidate.kind != "family" for j in judged):
            return level, judged, note
    return first
