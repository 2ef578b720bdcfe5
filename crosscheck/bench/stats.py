"""Summaries of interleaved timings: medians, extremes, and the ratio to the naive path.

Every round runs each path once, in turn (naive, precount, fused, naive, ...), so the i-th
time of every path was taken under the same conditions (the same neighbours on a shared
machine, the same clock speed). The ratio to naive is therefore taken per round and its
median reported, median_i(t_path_i / t_naive_i): drift that moves a whole round (another
process starting, frequency scaling) cancels in each ratio, where a ratio of medians would
keep it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

BASELINE = "naive"


def summarize(times: Mapping[str, Sequence[float]]) -> dict[str, dict[str, float | None]]:
    """Per path: median_s, min_s, max_s and ratio_to_naive (median of per-round ratios).

    Every path must have the same number of rounds, each time finite and positive: a round
    missing or a NaN would make the per-round ratio compare different conditions or pass
    silently. ratio_to_naive is None when there is no naive path to compare with.
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
        summary[path] = {
            "median_s": float(np.median(array)),
            "min_s": float(array.min()),
            "max_s": float(array.max()),
            "ratio_to_naive": None if baseline is None else float(np.median(array / baseline)),
        }
    return summary
