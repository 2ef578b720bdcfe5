"""One paragraph of plain language per diagnosis: what the weights are, and why."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from crosscheck.compare import RTOL_BY_DTYPE
from crosscheck.patterns import PATTERNS

if TYPE_CHECKING:
    from crosscheck.diagnose import Diagnosis


def _mean_weight_by(diagnosis: Diagnosis, key) -> dict:
    """Token-weighted mean recovered per-token weight of each key (rank, or rank+microbatch)."""
    sums: dict = {}
    for group in diagnosis.groups:
        total, count = sums.get(key(group), (0.0, 0))
        sums[key(group)] = (total + group.weight * group.tokens, count + group.tokens)
    return {k: total / count for k, (total, count) in sums.items() if count}


def _skew(diagnosis: Diagnosis, key, label) -> str:
    """'tokens on rank 0 weigh 9.0x tokens on rank 1' from the recovered weights."""
    means = _mean_weight_by(diagnosis, key)
    positive = {k: v for k, v in means.items() if v > 0}
    if len(positive) < 2:
        return "the recovered weights give no second group to compare with"
    heavy = max(positive, key=positive.get)
    light = min(positive, key=positive.get)
    ratio = positive[heavy] / positive[light]
    return f"tokens on {label(heavy)} weigh {ratio:.1f}x tokens on {label(light)}"


def _ratio_text(value: float) -> str:
    return f"{value:.4g}" if value != float("inf") else "unbounded (some weight is 0 or negative)"


def explain(diagnosis: Diagnosis, note: str = "") -> str:
    """The explanation paragraph for a finished diagnosis (`note`: the match's own details)."""
    d = diagnosis
    tol = RTOL_BY_DTYPE[d.dtype]
    best = d.best_match
    if best == d.intended:
        text = (
            f"The gradient is {d.intended}'s: every valid token weighs what the scheme says "
            f"(weight ratio {_ratio_text(d.weight_ratio)}, scale {d.scale:.12g}, relative error "
            f"{d.intended_error:.1e} within the {d.dtype} tolerance {tol:.0e})."
        )
    elif best == "rank-mean":
        skew = _skew(d, lambda g: g.rank, lambda r: f"rank {r}")
        text = (
            f"{skew[0].upper()}{skew[1:]}: each rank averaged its own tokens and the ranks "
            f"were averaged (rank-mean; {PATTERNS['rank-mean'].upstream})."
        )
    elif best == "microbatch-mean":
        skew = _skew(
            d,
            lambda g: (g.rank, g.microbatch),
            lambda k: f"rank {k[0]} microbatch {k[1]}",
        )
        text = (
            f"{skew[0].upper()}{skew[1:]}: each accumulation microbatch took its own token "
            f"mean and the microbatches were averaged (microbatch-mean; "
            f"{PATTERNS['microbatch-mean'].upstream})."
        )
    elif best in PATTERNS:
        pattern = PATTERNS[best]
        text = (
            f"Matches {best} ({pattern.upstream}): {pattern.step}. The gradient is "
            f"{d.scale:.9g}x the intended {d.intended} one, with weight ratio "
            f"{_ratio_text(d.weight_ratio)} (intended {_ratio_text(d.intended_weight_ratio)})."
        )
        if note:
            text += f" ({note}.)"
    elif best == "unknown" and not math.isfinite(d.residual):
        return "The gradient holds NaN or inf: verification fails and no weighting can match it."
    elif best == "unknown":
        closest = min(d.candidate_errors, key=d.candidate_errors.get)
        text = (
            f"No known scheme or pattern fits within {tol:.0e}: the closest is {closest} at "
            f"relative error {d.candidate_errors[closest]:.2e}. The recovered weights have "
            f"ratio {_ratio_text(d.weight_ratio)} and scale {d.scale:.6g} against {d.intended}"
        )
        text += (
            f", and they explain the gradient up to a residual of {d.residual:.1e}."
            if d.residual <= 1e-6
            else f"; they leave a residual of {d.residual:.1e}: the gradient is not a "
            "reweighting of token gradients (the model, the loss or the params differ)."
        )
    elif best == "ambiguous":
        text = (
            f"The gradient fits {' and '.join(d.matches)} alike: they predict the same "
            "gradient at this layout, so no name is given."
        )
        if {"missing-world-size", "double-reduce-count"} <= set(d.matches):
            text += " The logged denominator tells them apart (D for the first, R D for the other)."
        else:
            text += " Another layout or fixture tells them apart."
    else:
        text = (
            f"The gradient is {best}'s, not {d.intended}'s (weight ratio "
            f"{_ratio_text(d.weight_ratio)} against {_ratio_text(d.intended_weight_ratio)}, "
            f"scale {d.scale:.6g})."
        )
    if not d.well_posed:
        text += (
            f" The group weights are not identifiable on this fixture (condition number "
            f"{d.condition_number:.2g}): the weight ratio is unreliable."
        )
    return text
