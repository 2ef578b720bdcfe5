"""One paragraph of plain language per diagnosis: what the weights are, why, and what to do."""

from __future__ import annotations

import math
from collections.abc import Sequence

from crosscheck.diagnosis.naming import AMBIGUOUS, UNKNOWN, kind_of, signature_of
from crosscheck.diagnosis.patterns import PATTERNS
from crosscheck.diagnosis.result import Diagnosis
from crosscheck.diagnosis.verdict import LEVEL_NAMES, PRECISIONS, auto_levels, level_of
from crosscheck.diagnosis.zero_count import ZERO_COUNT_NAN

#: Where each framework's right loop is shown: the section every fix points to, unless
#: `GUIDE_SECTIONS` names a closer one (tests/test_verdict.py checks that each exists).
GUIDES: dict[str, str] = {
    "torch": "docs/torch.md#the-loop-precount-four-changes-to-a-standard-ddp-loop",
    "jax": "docs/jax.md#precount-in-your-own-data-parallel-step-the-reduction-factor-s",
}
#: (framework, name) -> the section that shows the fix of that pattern or family.
GUIDE_SECTIONS: dict[tuple[str, str], str] = {
    ("torch", "missing-world-size"): "docs/torch.md#why-s--r",
    ("torch", "double-world-size"): "docs/torch.md#why-s--r",
    ("torch", "scale"): "docs/torch.md#why-s--r",
    ("torch", "local-group-count"): "docs/torch.md#schemes-as-data-contract-v2",
    ("jax", "microbatch-mean"): "docs/jax.md#optax-users-token-weighted-accumulation",
    ("jax", "microstep-mean"): "docs/jax.md#optax-users-token-weighted-accumulation",
    ("jax", "clip-per-microbatch"): "docs/jax.md#optax-users-token-weighted-accumulation",
    ("jax", "local-group-count"): "docs/jax.md#schemes-as-data-contract-v2",
}


def fix_text(name: str, framework: str | None) -> str:
    """What to change for pattern or family `name`, in `framework`'s terms (torch's words
    when the framework is not known and the two differ)."""
    if name in PATTERNS:
        pattern = PATTERNS[name]
        return pattern.jax_fix if framework == "jax" and pattern.jax_fix else pattern.fix
    return FAMILY_FIXES.get(name, f"the step computes {name}")


def guide(names: Sequence[str], framework: str | None) -> str:
    """The doc sections that show the right loop for `names`: `framework`'s, or both
    frameworks' when it is not known."""
    frameworks = [framework] if framework in GUIDES else list(GUIDES)
    sections = [GUIDE_SECTIONS.get((f, n), GUIDES[f]) for f in frameworks for n in names]
    return "; ".join(dict.fromkeys(sections))


#: What to do when a family (no catalogued pattern) names the gradient.
FAMILY_FIXES: dict[str, str] = {
    "scale": "every token is weighted right but the gradient is scaled: look for a factor on "
    "the loss (the world size, the accumulation steps, a loss scale) or a denominator other "
    "than the intended one",
    "rank-skew": "ranks weigh their tokens differently: every rank must divide by the same "
    "global denominator, counted with one all-reduce before the backward",
    "microbatch-skew": "microbatches weigh their tokens differently: every microbatch must be "
    "divided by the same denominator of the whole update, counted before the first backward",
}


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
    digits = 1 if ratio >= 1.1 else 6
    return f"tokens on {label(heavy)} weigh {ratio:.{digits}f}x tokens on {label(light)}"


def _ratio_text(value: float) -> str:
    return f"{value:.4g}" if value != float("inf") else "unbounded (some weight is 0 or negative)"


def _capitalized(text: str) -> str:
    return text[:1].upper() + text[1:]


def _precision_text(d: Diagnosis) -> str:
    return (
        f"at {LEVEL_NAMES[d.precision]} (relative error {d.intended_error:.1e} against "
        f"{d.intended}, group-fit residual {d.residual:.1e}, tolerance {d.tolerance:.0e})"
    )


def _sensitivity_text(d: Diagnosis) -> str:
    if d.detectable_skew is None:
        return ""
    per, minus_one = d.detectable_skew
    return (
        f" Given this step's noise, at {LEVEL_NAMES[d.skew_level]} scaling one {per}'s weights "
        f"by 1 + {minus_one:.1e} or more is flagged for sure."
    )


def _ambiguity_hint(d: Diagnosis) -> str:
    names = set(d.matches)
    if {"missing-world-size", "double-reduce-count"} <= names:
        return (
            " The logged denominator tells them apart (D for the first, R D for the other): "
            "call crosscheck.log_denominator(D) in the step."
        )
    reweighting = [n for n in names if kind_of(n, d.intended) == "pattern"]
    reweighting = [n for n in reweighting if signature_of(n, d.intended) != "scale"]
    if "scale" in names and reweighting:
        return (
            f" Here {' and '.join(reweighting)} weighs every token alike (a plain scale of "
            f"{d.scale:.6g}): a fixture or layout whose ranks and microbatches hold different "
            "token counts tells them apart."
        )
    layout_factors = {
        "missing-world-size",
        "double-reduce-count",
        "double-world-size",
        "double-accum-scale",
        "double-accum-divide",
    }
    if names <= layout_factors:
        return " A layout where they differ tells them apart (R != M, both above 1)."
    return " Another fixture or layout, where they predict different weights, tells them apart."


def explain(diagnosis: Diagnosis) -> tuple[str, str]:
    """The explanation paragraph of a finished diagnosis, and the fix ("" when correct)."""
    d = diagnosis
    best = d.best_match
    fix = ""
    if d.unusable and d.best_match == ZERO_COUNT_NAN:
        return (
            f"The gradient holds {d.unusable}: verification fails. It is {ZERO_COUNT_NAN}: "
            f"{d.notes.get(ZERO_COUNT_NAN, '')}.",
            f"{fix_text(ZERO_COUNT_NAN, d.framework)} ({guide([ZERO_COUNT_NAN], d.framework)})",
        )
    if d.unusable:
        huge = "NaN or inf" not in d.unusable
        return (
            f"The gradient holds {d.unusable}: verification fails and no weighting can match it.",
            "find where the step first produces a "
            + ("huge" if huge else "non-finite")
            + " loss or gradient (a division by 0 or by a tiny count, on a rank or microbatch "
            "without valid tokens, is the usual cause)",
        )
    if not math.isfinite(d.residual):
        return (
            "The gradient holds NaN or inf: verification fails and no weighting can match it.",
            "find where the step first produces a non-finite loss or gradient (a 0/0 on a "
            "rank or microbatch without valid tokens is the usual cause)",
        )
    if d.beyond_precision:
        text = (
            f"The gradient is not a per-document reweighting of {d.intended}'s weights at "
            f"{LEVEL_NAMES[d.precision]} or finer: the group fit leaves a residual of "
            f"{d.residual:.1e}, beyond the {d.tolerance:.0e} that {d.precision} rounding "
            "explains."
        )
        # A coarser level is suggested only where the step's params allow it: a float64 step
        # 1e-3 off is not bf16 noise, and calling it that would wave a real bug through.
        coarser = level_of(d.residual, auto_levels(d.dtype))
        if coarser is not None and PRECISIONS.index(coarser) > PRECISIONS.index(d.precision):
            text += (
                f" A residual that size is {LEVEL_NAMES[coarser]} rounding, which the step's "
                f"{d.dtype} params allow: judged at precision {coarser} (the automatic "
                "choice), its weighting can be checked."
            )
            return text, f"judge the step at precision {coarser} (drop --strict / --precision)"
        if level_of(d.residual, ("bfloat16",)) and d.precision != "bfloat16":
            # Not waved through: the step handed back a gradient of finer dtype, so its bf16
            # arithmetic (autocast, a cast inside the model) is a guess, stated with the flag
            # that tests it. Never a fix that blames the loss for rounding.
            text += (
                f" A residual that size is {LEVEL_NAMES['bfloat16']} rounding: the step's "
                f"arithmetic looks bf16 (autocast, or a cast inside the model), though its "
                f"params and gradient are {d.dtype}."
            )
            soft = " or soft weights ignored" if d.intended == "weighted_mean" else ""
            return text, (
                "if the step computes in bf16 on purpose, judge it at that level: rerun with "
                "--precision bfloat16 (verify(..., precision='bfloat16')); if it does not, "
                "something of that size changes the weights inside each document (label "
                f"smoothing, other params{soft}), and at bf16-level that would pass unseen"
            )
        soft = (
            " (soft weights ignored or changed, for weighted_mean)"
            if d.intended == "weighted_mean"
            else ""
        )
        text += (
            " The loss, the model or the params differ from the ones given, or the weights "
            f"vary inside a document{soft}."
        )
        fix = (
            "check that the step's loss is the cross-entropy of the given targets with the "
            f"given model and params, weighted as {d.intended} weighs tokens (no label "
            "smoothing, extra loss terms or parameter changes)"
        )
        return text, fix
    if best == d.intended:
        text = (
            f"The gradient is {d.scheme.name}'s {_precision_text(d)}: every valid token weighs "
            f"what the scheme says (weight ratio {_ratio_text(d.weight_ratio)} against it, "
            f"scale {d.scale:.12g})."
        )
        return text + _sensitivity_text(d) + _identifiability_text(d), ""
    if best == "rank-mean":
        skew = _skew(d, lambda g: g.rank, lambda r: f"rank {r}")
        text = (
            f"{_capitalized(skew)}: each rank averaged its own tokens and the ranks were "
            f"averaged (rank-mean; {PATTERNS['rank-mean'].upstream})."
        )
        fix = fix_text(best, d.framework)
    elif best == "microbatch-mean":
        skew = _skew(
            d,
            lambda g: (g.rank, g.microbatch),
            lambda k: f"rank {k[0]} microbatch {k[1]}",
        )
        text = (
            f"{_capitalized(skew)}: each accumulation microbatch took its own token mean and "
            f"the microbatches were averaged (microbatch-mean; "
            f"{PATTERNS['microbatch-mean'].upstream})."
        )
        fix = fix_text(best, d.framework)
    elif best == "microstep-mean":
        skew = _skew(d, lambda g: g.microbatch, lambda m: f"microbatch {m}")
        text = (
            f"{_capitalized(skew)}, on every rank alike: each accumulation microbatch took "
            "its token mean over all ranks and the microbatches were averaged "
            f"(microstep-mean; {PATTERNS[best].upstream})."
        )
        fix = fix_text(best, d.framework)
    elif best in PATTERNS:
        pattern = PATTERNS[best]
        text = (
            f"Matches {best} ({pattern.upstream}): {pattern.step}. The gradient is "
            f"{d.scale:.9g}x the intended {d.intended} one, with weight ratio "
            f"{_ratio_text(d.weight_ratio)} against it."
        )
        if d.notes.get(best):
            text += f" ({d.notes[best]}.)"
        fix = fix_text(best, d.framework)
    elif best == "scale":
        text = (
            f"Every valid token is weighted as {d.intended} says, but the gradient is "
            f"{d.scale:.9g}x the intended one: a scale that no catalogued pattern predicts at "
            "this layout."
        )
        fix = fix_text(best, d.framework)
    elif best == "rank-skew":
        skew = _skew(d, lambda g: g.rank, lambda r: f"rank {r}")
        text = (
            f"{_capitalized(skew)}: one factor per rank ({d.notes.get(best, '')}), which no "
            "catalogued pattern predicts."
        )
        fix = fix_text(best, d.framework)
    elif best == "microbatch-skew":
        skew = _skew(
            d, lambda g: (g.rank, g.microbatch), lambda k: f"rank {k[0]} microbatch {k[1]}"
        )
        text = (
            f"{_capitalized(skew)}: one factor per microbatch ({d.notes.get(best, '')}), which "
            "no catalogued pattern predicts."
        )
        fix = fix_text(best, d.framework)
    elif best == UNKNOWN:
        closest = min(d.candidate_errors, key=d.candidate_errors.get)
        text = (
            f"No known scheme, pattern or reweighting family fits {_precision_text(d)}: the "
            f"closest is {closest} at relative error {d.candidate_errors[closest]:.2e}. The "
            f"recovered weights have ratio {_ratio_text(d.weight_ratio)} and scale "
            f"{d.scale:.6g} against {d.intended}, worst at {d.worst_unit}"
        )
        text += f", and explain the gradient up to a residual of {d.residual:.1e}."
        fix = (
            "compare the recovered per-group weights (diagnosis.groups) with the intended "
            "ones to find which rows or documents are weighted wrongly"
        )
    elif best == AMBIGUOUS:
        text = (
            f"The gradient fits {' and '.join(d.matches)} alike at "
            f"{LEVEL_NAMES[d.precision]}: they predict the same gradient at this layout, so "
            "no name is given." + _ambiguity_hint(d)
        )
        fix = "; or ".join(fix_text(n, d.framework) for n in d.matches)
    else:
        text = (
            f"The gradient is {best}'s, not {d.intended}'s (weight ratio "
            f"{_ratio_text(d.weight_ratio)} against {d.intended}, scale {d.scale:.6g})."
        )
        fix = f"the step computes {best}: weight and count tokens as {d.intended} does"
    named = list(d.matches) if best == AMBIGUOUS else [best]
    return text + _identifiability_text(d), f"{fix} ({guide(named, d.framework)})"


def _identifiability_text(d: Diagnosis) -> str:
    if d.well_posed:
        return ""
    return (
        f" The group weights are not identifiable on this fixture (condition number "
        f"{d.condition_number:.2g}): the weight ratio is unreliable."
    )
