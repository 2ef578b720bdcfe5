r"""Reweighting families: the shape of an error that no catalogued pattern predicts.

A family is a set of weightings around the intended one, fitted to the gradient itself:

=============== ===========================================================================
scale           :math:`s\, w^I_t`: every token weighted as intended, the gradient scaled
rank-skew       :math:`s_r\, w^I_t` for token t on rank r: one factor per rank
microbatch-skew :math:`s_{rm}\, w^I_t` for token t on rank r, microbatch m
=============== ===========================================================================

The factors are the least-squares fit of :math:`G \approx \sum_k s_k\, g^I_k`, where
:math:`g^I_k` is the intended gradient restricted to block k (the whole update, a rank, a
microbatch), and must all be positive. A family *fits* a gradient when its fitted prediction
passes the same precision-aware test as any named hypothesis (``crosscheck.diagnosis.verdict``); it
then names what a catalogue pattern cannot: a 1.001x heavier rank, a loss scale that no known bug
explains.

rank-skew at R = 1 is the scale family, and microbatch-skew at M = 1 is rank-skew: those are
marked degenerate, since the layout cannot show what sets them apart.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from crosscheck.contract.layout import LaidOutBatch
from crosscheck.diagnosis.candidates import Candidate

#: The families, from the fewest factors to the most.
FAMILIES: tuple[str, ...] = ("scale", "rank-skew", "microbatch-skew")

#: The flattened gradient of given [N, T] effective weights.
FlatGradOf = Callable[[np.ndarray], np.ndarray]


def _block_ids(family: str, batch: LaidOutBatch) -> np.ndarray:
    """Block index of every token, global [N, T] order."""
    R, M = batch.layout.world_size, batch.layout.accum_steps
    rank = np.arange(R)[:, None, None, None]
    step = np.arange(M)[None, :, None, None]
    ids = {
        "scale": 0 * rank + 0 * step,
        "rank-skew": rank + 0 * step,
        "microbatch-skew": rank * M + step,
    }[family]
    return batch.to_global(np.broadcast_to(ids, batch.targets.shape))


def _factors_text(family: str, factors: dict[int, float], M: int) -> str:
    if family == "scale":
        return f"every token weighted as intended, times {factors[0]:.9g}"
    if family == "rank-skew":
        return ", ".join(f"rank {k}: {v:.9g}" for k, v in sorted(factors.items()))
    return ", ".join(
        f"rank {k // M} microbatch {k % M}: {v:.9g}" for k, v in sorted(factors.items())
    )


def family_candidates(
    gradient: np.ndarray, intended: np.ndarray, batch: LaidOutBatch, flat_grad_of: FlatGradOf
) -> list[Candidate]:
    """Each family's best fit to `gradient` (flattened), as candidates with their factors.

    `intended` holds the intended effective weights [N, T]. Blocks where the intended scheme
    gives no weight (an empty rank) have no factor: they carry nothing either way.
    """
    if not np.isfinite(gradient).all():
        return []
    R, M = batch.layout.world_size, batch.layout.accum_steps
    out = []
    for family in FAMILIES:
        ids = _block_ids(family, batch)
        blocks = [k for k in np.unique(ids) if np.any(intended[ids == k])]
        if not blocks:
            continue
        columns = np.stack([flat_grad_of(np.where(ids == k, intended, 0.0)) for k in blocks], 1)
        solution, *_ = np.linalg.lstsq(columns, gradient, rcond=None)
        if not np.all(solution > 0):
            # A zero or negative factor is no reweighting of the intended one: a block that
            # contributes nothing, or a gradient pointing the other way, stays unexplained.
            continue
        factors = dict(zip((int(k) for k in blocks), (float(s) for s in solution), strict=True))
        scale_of = np.ones(int(ids.max()) + 1)
        for k, s in factors.items():
            scale_of[k] = s
        degenerate = (family == "rank-skew" and R == 1) or (family == "microbatch-skew" and M == 1)
        out.append(
            Candidate(
                family,
                "family",
                intended * scale_of[ids],
                note=_factors_text(family, factors, M),
                degenerate=degenerate,
            )
        )
    return out
