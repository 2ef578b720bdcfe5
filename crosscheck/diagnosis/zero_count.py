r"""Naming a non-finite gradient: ``zero-count-nan``, a local mean that divided 0 by 0.

A gradient that holds NaN or inf fits no weighting, so the fit-based diagnosis can only say
where the first bad entry is. One cause is common enough to be catalogued
(`crosscheck.diagnosis.patterns`, mcore-bridge#104, Megatron-LM#3396, verl#6464, prime-rl#808,
NeMo-RL#212): a loop normalizes per microbatch (or per rank), and one microbatch of the layout
holds no token the intended scheme counts. Its local denominator is

.. math:: d_{rm} = 0, \qquad \frac{\sum_{t \in (r, m)} a_t l_t}{d_{rm}} = \frac{0}{0} = \text{NaN},

its backward is NaN, and the gradient all-reduce spreads NaN to every entry on every rank.

The diagnosis names it when both hold: the gradient is not finite, and the layout has a unit
with a zero count of the intended scheme (:func:`empty_units`). A finite gradient never
reaches this module, so no verdict on a finite gradient changes; and NaN never passes.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from crosscheck.contract.layout import LaidOutBatch
from crosscheck.contract.spec import SchemeSpec

ZERO_COUNT_NAN = "zero-count-nan"

#: Denominator kinds that no unit can make 0: a fixed number, or every slot of the unit.
_NEVER_ZERO = ("one", "configured", "slots")


def local_counts(scheme: SchemeSpec, batch: LaidOutBatch) -> np.ndarray | None:
    """d_rm, the intended scheme's denominator of each (rank, microbatch), [R, M].

    None when the scheme's denominator cannot be 0 on a unit (``sum``, a constant): a local
    mean of such a scheme never divides by 0.
    """
    if scheme.denominator.kind in _NEVER_ZERO:
        return None
    # The same spec at microbatch scope: one D_u per (rank, microbatch), rank-major.
    R, M = batch.layout.world_size, batch.layout.accum_steps
    per_unit = replace(scheme, scope="microbatch").unit_denominators(batch)
    return np.asarray(per_unit, dtype=np.float64).reshape(R, M)


def empty_units(scheme: SchemeSpec, batch: LaidOutBatch) -> list[str]:
    """The ranks and microbatches of the layout whose intended count is 0, described.

    A rank all of whose microbatches are empty is named as the rank ("rank 1 (all 2
    microbatches)"): its rank-local mean divides 0 by 0 too. Empty list: no unit is empty.
    """
    counts = local_counts(scheme, batch)
    if counts is None:
        return []
    R, M = counts.shape
    out = []
    for r in range(R):
        empty = [m for m in range(M) if counts[r, m] == 0]
        if M > 1 and len(empty) == M:
            out.append(f"rank {r} (all {M} microbatches)")
        elif M == 1 and empty:
            out.append(f"rank {r} (its only microbatch)")
        else:
            out += [f"rank {r} microbatch {m}" for m in empty]
    return out


def zero_count_note(scheme: SchemeSpec, batch: LaidOutBatch, unusable: str) -> str:
    """The explanation of ``zero-count-nan`` for a gradient whose `unusable` entries are NaN or
    inf, or "" when the pattern does not apply (a finite or merely huge gradient, or no empty
    unit at this layout)."""
    if "NaN or inf" not in unusable:
        return ""
    empty = empty_units(scheme, batch)
    if not empty:
        return ""
    return (
        f"{', '.join(empty)} {'has' if len(empty) == 1 else 'have'} no token that "
        f"{scheme.name} counts: a mean taken there divides 0 by 0, and the gradient "
        "all-reduce spreads the NaN to every entry"
    )
