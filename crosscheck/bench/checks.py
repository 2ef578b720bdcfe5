"""The gradient each path must give, judged once before any timing.

A bench that times a wrong path measures nothing worth knowing, so every framework computes,
before its first timed round, each path's gradient and two references from this rank's
unnormalized gradient sum G_r and valid-token count n_r (its own code, in its own framework):

    intended  = sum_r G_r / sum_r n_r          (the global token mean)
    rank_mean = (1/R) sum_r G_r / n_r          (each rank's mean, averaged: what naive gives)

and hands them here as numpy arrays. precount and fused must give `intended` (and each
other), naive must give `rank_mean`, each to the float32 tolerance; and where the ranks hold
different counts, naive must also differ from `intended` by more than 10x that tolerance, or
the batch would not show the difference the bench is about. A path that fails is refused:
named, with its error, and not timed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from crosscheck.judge.compare import RTOL_BY_DTYPE, tree_rel_err

Grads = Mapping[str, np.ndarray]

#: The paths and the reference each must match.
INTENDED_BY_PATH = {"naive": "rank_mean", "precount": "intended", "fused": "intended"}
#: float32 steps: the paths differ from the float64-accumulated references only by float32
#: rounding (eps 6e-8) through a forward and backward over ~1000 tokens: ~1e-6, under the
#: project's float32 tolerance of 1e-5 (`crosscheck.judge.compare`).
RTOL = RTOL_BY_DTYPE["float32"]
#: How far naive must be from the global token mean when counts differ: 10x the tolerance,
#: so that "differs" is never float32 noise. With counts ~930 vs ~550 the gap is ~25%.
MIN_NAIVE_GAP = 10 * RTOL


def refusals(
    path_grads: Mapping[str, Grads],
    references: Mapping[str, Grads],
    rank_counts: Sequence[int],
) -> dict[str, str]:
    """path -> why it is refused, for every path whose gradient is not the one it should be
    (an empty dict: every path may be timed). NaN or inf is never within tolerance."""
    why: dict[str, str] = {}
    for path, grads in path_grads.items():
        expected = INTENDED_BY_PATH[path]
        worst = tree_rel_err(grads, references[expected])
        if not (math.isfinite(worst.max_rel_err) and worst.max_rel_err <= RTOL):
            why[path] = f"gradient is not {expected}'s: {worst.describe()} exceeds {RTOL:.0e}"
    if "precount" in path_grads and "fused" in path_grads and "fused" not in why:
        # Both against each other too: the same objective by two routes, float32 apart.
        worst = tree_rel_err(path_grads["fused"], path_grads["precount"])
        if not (math.isfinite(worst.max_rel_err) and worst.max_rel_err <= RTOL):
            why["fused"] = f"gradient is not precount's: {worst.describe()} exceeds {RTOL:.0e}"
    if "naive" in path_grads and len(set(rank_counts)) > 1:
        gap = tree_rel_err(path_grads["naive"], references["intended"]).max_rel_err
        if not gap > MIN_NAIVE_GAP:
            why["naive"] = (
                f"ranks hold {list(rank_counts)} valid targets, yet naive's gradient is "
                f"within {gap:.1e} of the global token mean's (expected > {MIN_NAIVE_GAP:.0e})"
            )
    return why


def float64_tree(tree: Mapping[str, object]) -> dict[str, np.ndarray]:
    """A gradient tree as float64 numpy arrays (what `refusals` compares)."""
    return {name: np.asarray(value, dtype=np.float64) for name, value in tree.items()}
