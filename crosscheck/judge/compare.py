"""Comparing parameter trees: the relative error of docs/contract.md and the tolerances per dtype.

The error of a leaf is max |a - b| / max(max |b|, tiny); a tree's error is its worst leaf's.
NaN or inf anywhere in `a` makes the error inf, so NaN never passes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

# float64: every path is a handful of sums and products on O(1) numbers (~1e-16 each); a
# reordered sum over a few thousand tokens stays below 1e-13, so 1e-12 only admits rounding.
FLOAT64_RTOL = 1e-12
# float32: eps 6e-8; sums over up to a few thousand tokens and the softmax accumulate to
# ~1e-6 relative, so 1e-5 admits rounding while a single token weighted wrongly (>= 1e-4 of
# the gradient in every fixture) still fails.
FLOAT32_RTOL = 1e-5
# bfloat16: 8-bit mantissa, eps 7.8e-3; two or three roundings on the way -> 2e-2.
BFLOAT16_RTOL = 2e-2

RTOL_BY_DTYPE: dict[str, float] = {
    "float64": FLOAT64_RTOL,
    "float32": FLOAT32_RTOL,
    "bfloat16": BFLOAT16_RTOL,
}

TINY = 1e-300  # only guards 0/0 when the reference leaf is exactly zero


class TreeError(NamedTuple):
    """The worst leaf's relative error and where it is."""

    max_rel_err: float
    leaf: str
    index: tuple[int, ...]
    actual: float
    expected: float

    def describe(self) -> str:
        return (
            f"{self.leaf}{list(self.index)}: got {self.actual!r}, expected {self.expected!r} "
            f"(relative error {self.max_rel_err:.3e})"
        )


def leaf_rel_err(actual: np.ndarray, expected: np.ndarray) -> tuple[float, tuple[int, ...]]:
    """max |a - b| / max(max |b|, tiny) and the index of the worst element (inf on NaN)."""
    a = np.asarray(actual, dtype=np.float64)
    b = np.asarray(expected, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: got {a.shape}, expected {b.shape}")
    if a.size == 0:
        return 0.0, ()
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf: judged below, not raised
        diff = np.abs(a - b)
    if not np.isfinite(diff).all():
        worst = np.unravel_index(int(np.argmin(np.isfinite(diff))), a.shape)
        return float("inf"), tuple(int(i) for i in worst)
    worst = np.unravel_index(int(np.argmax(diff)), a.shape)
    scale = max(float(np.max(np.abs(b))), TINY)
    return float(diff[worst]) / scale, tuple(int(i) for i in worst)


def tree_rel_err(actual: Mapping[str, np.ndarray], expected: Mapping[str, np.ndarray]) -> TreeError:
    """The worst leaf of two trees with the same keys (a missing key is an error)."""
    if set(actual) != set(expected):
        raise ValueError(
            f"parameter names differ: got {sorted(actual)}, expected {sorted(expected)}"
        )
    if not expected:
        raise ValueError(
            "no parameters to compare: an empty tree would pass having checked nothing"
        )
    worst = TreeError(0.0, "", (), 0.0, 0.0)
    for key in sorted(expected):
        try:
            err, index = leaf_rel_err(actual[key], expected[key])
        except ValueError as error:
            raise ValueError(f"{key}: {error}") from None
        a = np.asarray(actual[key], dtype=np.float64)
        if a.size == 0:  # nothing to be wrong about; the other leaves decide
            continue
        if err > worst.max_rel_err or not worst.leaf:
            b = np.asarray(expected[key], dtype=np.float64)
            worst = TreeError(err, key, index, float(a[index]), float(b[index]))
    return worst


def assert_tree_close(
    actual: Mapping[str, np.ndarray],
    expected: Mapping[str, np.ndarray],
    rtol: float,
    what: str = "",
) -> float:
    """Raise AssertionError naming the worst leaf unless the trees agree within `rtol`."""
    worst = tree_rel_err(actual, expected)
    # NaN or inf never passes, whatever the tolerance (inf <= inf would).
    if not (math.isfinite(worst.max_rel_err) and worst.max_rel_err <= rtol):
        raise AssertionError(f"{what}: {worst.describe()} exceeds {rtol:.0e}")
    return worst.max_rel_err


def finite_or_none(value: float) -> float | None:
    """A float for JSON: JSON has no NaN or inf, so a non-finite value becomes null."""
    return float(value) if math.isfinite(value) else None
