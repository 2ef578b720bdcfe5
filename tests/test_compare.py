"""The judge itself (`crosscheck.judge.compare`), at its boundaries.

Every verdict of the harness goes through `leaf_rel_err`, `tree_rel_err` and
`assert_tree_close`: the relative error max |a - b| / max(max |b|, tiny) per leaf, the worst
leaf of a tree, and a tolerance per dtype. These tests pin the formula with exact values on
cases where dividing by the wrong array gives another number, the tolerances themselves, an
error just inside and just outside each tolerance, and what never passes (NaN, inf, a nonzero
gradient where the reference is exactly zero).

Most values here are exact in binary floating point (powers of two and small integers), so
the relative errors are asserted with ==, not with a tolerance of their own.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from crosscheck.judge.compare import (
    BFLOAT16_RTOL,
    FLOAT32_RTOL,
    FLOAT64_RTOL,
    RTOL_BY_DTYPE,
    TINY,
    TreeError,
    assert_tree_close,
    finite_or_none,
    leaf_rel_err,
    tree_rel_err,
)

#: docs/contract.md, "Tolerances": float64 1e-12 (every path is a handful of reductions; anything
#: larger is a bug), float32 1e-5, bf16 2e-2. Written out here, not read from the module, so
#: that a tolerance changed in compare.py fails these tests instead of moving them along.
CONTRACT_RTOL = {"float64": 1e-12, "float32": 1e-5, "bfloat16": 2e-2}
DTYPES = sorted(CONTRACT_RTOL)


def arr(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float64)


# --- the tolerances are docs/contract.md's ------------------------------------------------------


def test_the_tolerances_are_the_contracts():
    # docs/contract.md, "Tolerances": float64 1e-12, float32 1e-5, bf16 2e-2. These numbers are the
    # contract every implementation is held to; changing one is a change of the contract,
    # not of this file.
    assert FLOAT64_RTOL == 1e-12
    assert FLOAT32_RTOL == 1e-5
    assert BFLOAT16_RTOL == 2e-2
    assert RTOL_BY_DTYPE == CONTRACT_RTOL


# --- the formula: divided by max |expected|, exactly --------------------------------------


@pytest.mark.parametrize(
    ("actual", "expected", "error", "index"),
    [
        # max|b| = 2, max|a| = 3: |3 - 2| / 2 = 0.5 (by max|a| it would be 1/3).
        (arr(1.0, 3.0), arr(1.0, 2.0), 0.5, (1,)),
        # max|b| = 2, max|a| = 0.5: 1.5 / 2 = 0.75 (by max|a|: 3).
        (arr(0.0, 0.5), arr(0.0, 2.0), 0.75, (1,)),
        # Signs: max|b| = 1, max|a| = 4: |-4 - -1| / 1 = 3 (by max|a|: 0.75).
        (arr(-4.0, 1.0), arr(-1.0, 1.0), 3.0, (0,)),
        # 2-D, the worst element elsewhere than max|b|'s: 4 / 8 = 0.5 (by max|a| = 4: 1).
        (np.array([[1.0, 2.0], [3.0, 4.0]]), np.array([[1.0, 2.0], [3.0, 8.0]]), 0.5, (1, 1)),
        # The largest |b| is not where the largest difference is: 0.75 / 16 (by max|a|:
        # 0.75 / 15.5).
        (arr(15.5, 1.75), arr(16.0, 1.0), 0.75 / 16.0, (1,)),
    ],
)
def test_relative_error_is_divided_by_max_abs_expected(actual, expected, error, index):
    assert leaf_rel_err(actual, expected) == (error, index)
    worst = tree_rel_err({"embed": actual}, {"embed": expected})
    assert worst == TreeError(error, "embed", index, float(actual[index]), float(expected[index]))


def test_the_denominator_decides_the_verdict():
    # 0 -> 4 against a reference of max 1: error 3. Dividing by max|a| = 4 would give 0.75.
    # The tolerance 1.0 is not a dtype's: it lies between the two denominators' answers.
    with pytest.raises(AssertionError, match=r"relative error 3\.000e\+00"):
        assert_tree_close({"w": arr(0.0, 4.0)}, {"w": arr(0.0, 1.0)}, rtol=1.0, what="grads")
    # The other way round: reference max 4, error 3 / 4 = 0.75 passes at 1.0.
    assert assert_tree_close({"w": arr(0.0, 1.0)}, {"w": arr(0.0, 4.0)}, rtol=1.0) == 0.75


def test_each_leaf_is_scaled_by_its_own_reference_and_the_worst_leaf_is_reported():
    # embed: 1 / 128 (small relative to its scale); unembed: 0.5 / 1. The tree's error is the
    # worst leaf's, not the error against the largest leaf of the tree.
    actual = {"embed": arr(128.0, 1.0), "unembed": arr(1.0, 0.5)}
    expected = {"embed": arr(128.0, 0.0), "unembed": arr(1.0, 0.0)}
    assert tree_rel_err(actual, expected) == TreeError(0.5, "unembed", (1,), 0.5, 0.0)
    assert tree_rel_err({"embed": actual["embed"]}, {"embed": expected["embed"]}) == TreeError(
        1.0 / 128.0, "embed", (1,), 1.0, 0.0
    )


# --- each dtype's tolerance: 2x fails, 0.5x passes, exactly 1x passes ---------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [1.0, 1024.0, 2.0**-10])
@pytest.mark.parametrize("factor", [0.5, 1.0, 2.0])
def test_an_error_at_a_multiple_of_the_tolerance(dtype, scale, factor):
    """The reference is [s, 0]; the actual leaf differs by factor x rtol x s where the
    reference is 0, rtol the contract's tolerance. With s a power of two every step is
    exact, so the relative error is exactly factor x rtol: at 0.5x and 1x it passes, at 2x
    it fails, through both the `tree_rel_err` + RTOL_BY_DTYPE path (the harness's rows) and
    `assert_tree_close`."""
    delta = factor * CONTRACT_RTOL[dtype]
    actual = {"embed": arr(scale, 0.0), "unembed": arr(scale, delta * scale)}
    expected = {"embed": arr(scale, 0.0), "unembed": arr(scale, 0.0)}
    worst = tree_rel_err(actual, expected)
    assert worst.max_rel_err == delta and worst.leaf == "unembed" and worst.index == (1,)
    passes = factor <= 1.0
    assert (worst.max_rel_err <= RTOL_BY_DTYPE[dtype]) is passes
    if passes:
        assert assert_tree_close(actual, expected, RTOL_BY_DTYPE[dtype], what=dtype) == delta
    else:
        with pytest.raises(AssertionError, match=rf"^{dtype}: unembed\[1\]: got "):
            assert_tree_close(actual, expected, RTOL_BY_DTYPE[dtype], what=dtype)


# --- what never passes ---------------------------------------------------------------------


NON_FINITE = [
    pytest.param(arr(1.0, np.nan), arr(1.0, 2.0), (1,), id="nan-in-actual"),
    pytest.param(arr(1.0, 2.0), arr(np.nan, 2.0), (0,), id="nan-in-expected"),
    pytest.param(arr(1.0, np.nan), arr(1.0, np.nan), (1,), id="nan-in-both"),
    pytest.param(arr(np.inf, 2.0), arr(1.0, 2.0), (0,), id="inf-in-actual"),
    pytest.param(arr(1.0, 2.0), arr(1.0, -np.inf), (1,), id="inf-in-expected"),
    pytest.param(arr(1.0, np.inf), arr(1.0, np.inf), (1,), id="same-inf-in-both"),
]


# inf - inf is NaN: numpy warns, and the judge must still call it inf, not 0.
@pytest.mark.filterwarnings("ignore:invalid value encountered in subtract:RuntimeWarning")
@pytest.mark.parametrize(("actual", "expected", "index"), NON_FINITE)
@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_and_inf_never_pass(actual, expected, index, dtype):
    err, where = leaf_rel_err(actual, expected)
    assert err == math.inf and where == index
    worst = tree_rel_err(
        {"embed": arr(1.0), "unembed": actual}, {"embed": arr(1.0), "unembed": expected}
    )
    assert worst.max_rel_err == math.inf and worst.leaf == "unembed" and worst.index == index
    # Judged at the dtype's own tolerance, the one the harness applies: even the loosest
    # (bf16's 2e-2) lets no NaN or inf through.
    assert not worst.max_rel_err <= RTOL_BY_DTYPE[dtype]
    with pytest.raises(AssertionError, match=r"relative error inf"):
        assert_tree_close({"unembed": actual}, {"unembed": expected}, RTOL_BY_DTYPE[dtype])
    assert finite_or_none(worst.max_rel_err) is None  # JSON null, never a number


def test_a_nan_is_reported_where_it_is():
    worst = tree_rel_err({"embed": arr(1.0, np.nan, 3.0)}, {"embed": arr(1.0, 2.0, 3.0)})
    assert worst.index == (1,) and math.isnan(worst.actual) and worst.expected == 2.0
    assert worst.describe() == "embed[1]: got nan, expected 2.0 (relative error inf)"


def test_nan_fails_even_at_an_infinite_tolerance():
    with pytest.raises(AssertionError):
        assert_tree_close({"w": arr(np.nan)}, {"w": arr(1.0)}, rtol=math.inf)


def test_a_zero_reference_leaf():
    zeros = {"embed": np.zeros((2, 3))}
    # An exactly zero gradient (an empty rank's) against an exactly zero reference: no error.
    assert tree_rel_err({"embed": np.zeros((2, 3))}, zeros).max_rel_err == 0.0
    assert tree_rel_err({"embed": -np.zeros((2, 3))}, zeros).max_rel_err == 0.0
    # The tightest tolerance (float64's 1e-12): an exact zero passes even that.
    assert assert_tree_close({"embed": np.zeros((2, 3))}, zeros, FLOAT64_RTOL) == 0.0
    # Anything nonzero against it: TINY only guards 0/0, so the error is |a| / 1e-300, far
    # beyond every tolerance, or inf once that overflows.
    tiny_gradient = np.zeros((2, 3))
    tiny_gradient[1, 2] = 1e-20
    worst = tree_rel_err({"embed": tiny_gradient}, zeros)
    assert worst == TreeError(1e-20 / TINY, "embed", (1, 2), 1e-20, 0.0)
    assert worst.max_rel_err > 1e279
    huge = np.zeros((2, 3))
    huge[0, 0] = 1e10
    assert tree_rel_err({"embed": huge}, zeros).max_rel_err == math.inf
    for rtol in RTOL_BY_DTYPE.values():  # every dtype's, the loosest (2e-2) included
        with pytest.raises(AssertionError, match=r"embed\[1, 2\]: got 1e-20, expected 0\.0"):
            assert_tree_close({"embed": tiny_gradient}, zeros, rtol)


# --- malformed trees ------------------------------------------------------------------------


def test_an_empty_leaf_has_no_error():
    assert leaf_rel_err(np.zeros(0), np.zeros(0)) == (0.0, ())
    assert leaf_rel_err(np.zeros((0, 3)), np.zeros((0, 3))) == (0.0, ())
    with pytest.raises(ValueError, match=r"shape mismatch: got \(0,\), expected \(0, 3\)"):
        leaf_rel_err(np.zeros(0), np.zeros((0, 3)))


def test_a_tree_with_an_empty_leaf_is_judged_by_its_other_leaves():
    actual = {"bias": np.zeros(0), "embed": arr(1.0, 3.0)}
    expected = {"bias": np.zeros(0), "embed": arr(1.0, 2.0)}
    assert tree_rel_err(actual, expected) == TreeError(0.5, "embed", (1,), 3.0, 2.0)


def test_a_shape_mismatch_raises_with_both_shapes():
    match = r"^unembed: shape mismatch: got \(2, 3\), expected \(3, 2\)$"
    with pytest.raises(ValueError, match=match):
        tree_rel_err({"unembed": np.zeros((2, 3))}, {"unembed": np.zeros((3, 2))})
    with pytest.raises(ValueError, match=r"shape mismatch"):
        # Any tolerance: the shapes are checked before any error is computed.
        assert_tree_close({"unembed": np.zeros(3)}, {"unembed": np.zeros(4)}, FLOAT64_RTOL)


def test_a_shape_mismatch_names_the_leaf():
    with pytest.raises(ValueError, match=r"unembed"):
        tree_rel_err(
            {"embed": np.zeros(2), "unembed": np.zeros((2, 3))},
            {"embed": np.zeros(2), "unembed": np.zeros((3, 2))},
        )


def test_missing_and_extra_keys_raise_naming_the_leaves():
    expected = {"embed": np.zeros(2), "unembed": np.zeros(2)}
    with pytest.raises(ValueError) as missing:
        tree_rel_err({"embed": np.zeros(2)}, expected)
    assert str(missing.value) == (
        "parameter names differ: got ['embed'], expected ['embed', 'unembed']"
    )
    with pytest.raises(ValueError) as extra:
        # Any tolerance: the names are checked before any error is computed.
        assert_tree_close({**expected, "bias": np.zeros(1)}, expected, FLOAT64_RTOL)
    assert str(extra.value) == (
        "parameter names differ: got ['bias', 'embed', 'unembed'], expected ['embed', 'unembed']"
    )


# --- the messages ---------------------------------------------------------------------------


def test_tree_error_describe_names_the_leaf_the_index_and_both_values():
    error = TreeError(0.5, "unembed", (1, 2), 3.0, 2.0)
    assert error.describe() == "unembed[1, 2]: got 3.0, expected 2.0 (relative error 5.000e-01)"


def test_assert_tree_close_says_what_where_and_against_which_tolerance():
    actual = {"embed": np.array([[1.0, 2.0], [3.0, 4.0]])}
    expected = {"embed": np.array([[1.0, 2.0], [3.0, 8.0]])}
    with pytest.raises(AssertionError) as failed:
        # float32's 1e-5, so that the message's tolerance (formatted 1e-05) is checked too.
        assert_tree_close(actual, expected, FLOAT32_RTOL, what="torch-ddp packed/token_mean")
    assert str(failed.value) == (
        "torch-ddp packed/token_mean: embed[1, 1]: got 4.0, expected 8.0 "
        "(relative error 5.000e-01) exceeds 1e-05"
    )


def test_under_the_cli_error_state_inf_against_inf_is_an_infinite_error():
    # `crosscheck.cli.commands.main` runs with np.errstate(divide="raise", invalid="raise"): inf -
    # inf must still give an infinite error (it never passes), not raise inside the judge.
    with np.errstate(divide="raise", invalid="raise"):
        assert tree_rel_err({"w": arr(np.inf)}, {"w": arr(np.inf)}).max_rel_err == math.inf
        assert tree_rel_err({"w": arr(np.nan)}, {"w": arr(1.0)}).max_rel_err == math.inf


def test_an_empty_tree_is_refused():
    with pytest.raises(ValueError, match="no parameters to compare"):
        tree_rel_err({}, {})
