"""Summaries of interleaved timings: medians, extremes, and the ratio to the naive path.

Every round runs each path once, in turn (naive, precount, fused, naive, ...), so the i-th
time of every path was taken under the same conditions (the same neighbours on a shared
machine, the same clock speed). The ratio to naive is therefore taken per round and its
median reported, median_i(t_path_i / t_naive_i): drift that moves a whole round (another
process starting, frequency scaling) cancels in each ratio, where a ratio of medians would
keep it.

The noise of one round's ratio on a 2-core machine is mostly the round's own (gloo's
loopback TCP and its threads sharing the cores with the ranks: about 8% per step time,
hardly correlated between the paths of a round, so a ratio scatters by about 11%), and the
median of n rounds still moves by about 1.25 x 11% / sqrt(n) from run to run: 1.4% at
n = 100. The report gives that uncertainty with the ratio:
`ratio_ci95`, a percentile bootstrap of the median of ratios (resampling rounds, seeded, so
the same times give the same interval).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

BASELINE = "naive"
#: Bootstrap resamples of the rounds: the interval's ends move by under 0.1% between seeds.
BOOTSTRAP_RESAMPLES = 2000


def summarize(times: Mapping[str, Sequence[float]]) -> dict[str, dict[str, float | None]]:
    """Per path: median_s, min_s, max_s, ratio_to_naive (median of per-round ratios) and
    ratio_ci95, its 95% bootstrap interval ([lo, hi]).

    Every path must have the same number of rounds, each time finite and positive: a round
    missing or a NaN would make the per-round ratio compare different conditions or pass
    silently. ratio_to_naive and ratio_ci95 are None when there is no naive path.
    """
    lengths = {path: len(values) for path, values in times.items()}
    if len(set(lengths.values())) != 1 or 0 in lengths.values():
        raise ValueError(f"every path needs the same, nonzero number of rounds, got {lengths}")
    for path, values in times.items():
        bad = [t for t in values if not (math.isfinite(t) and t > 0)]
        if bad:
            raise ValueError(f"path {path}: step times must be finite and > 0, got {bad[:3]}")
    baseline = np.asarray(times[BASELINE], dtype=np.float64) if BASELINE in times else None
    summary = {}
    for path, values in times.items():
        array = np.asarray(values, dtype=np.float64)
        ratios = None if baseline is None else array / baseline
        summary[path] = {
            "median_s": float(np.median(array)),
            "min_s": float(array.min()),
            "max_s": float(array.max()),
            "ratio_to_naive": None if ratios is None else float(np.median(ratios)),
            "ratio_ci95": None if ratios is None else median_interval(ratios),
        }
    return summary


def median_interval(values: np.ndarray, level: float = 0.95) -> list[float]:
    """A percentile-bootstrap `level` interval for the median of `values` (seeded)."""
    rng = np.random.default_rng(0)
    picks = rng.integers(0, len(values), size=(BOOTSTRAP_RESAMPLES, len(values)))
    medians = np.median(values[picks], axis=1)
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(medians, [tail, 100 - tail])
    return [float(low), float(high)]
