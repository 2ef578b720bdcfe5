r"""The dtype a denominator lives in, and sums of soft weights that round once, not per addition.

The rule (whatever the params' dtype, float64, float32 or bfloat16):

- **Counts** (valid tokens, segments, rows, slots) are int32 from the labels to the end and
  are converted to a float exactly once, when a unit's D is assembled
  (`jax_impl.accumulate.unit_denominator`), after every reduction over microbatches and ranks:
  exact up to :math:`2^{31}-1` (a float32 count stops being exact past :math:`2^{24}`, a
  bfloat16 one past :math:`2^8`). Past :math:`2^{31}` valid
  tokens in one update the int32 sum wraps around (XLA integer addition is two's complement)
  and D is garbage; that is ~100x the largest global batches trained today (16M tokens), and
  a step that needs it must carry the count in int64 (``jax_enable_x64``) or as two int32
  words.
- **Sums of soft weights** :math:`W = \sum_t w_t v_t` (weighted_mean's d), the loss sums
  logged as metrics, and the division of the gradient by D happen in the *denominator dtype*
  (`denominator_dtype`): float64 under ``jax_enable_x64``, float32 otherwise. Never the params'
  dtype: bfloat16 keeps 8 significant bits, so W would be off by up to :math:`2^{-9}` relative
  before any gradient is computed.
- W is summed as an unevaluated pair :math:`(h, \ell)` with :math:`h + \ell = W` (up to
  :math:`O(n\, u^2) W`, u the unit roundoff of the dtype): every addition is Knuth's two-sum,
  which returns the rounded sum :math:`s = \mathrm{fl}(a + b)` and its exact rounding error
  :math:`e = a + b - s`, and the errors are carried in :math:`\ell`. Across ranks the pairs
  are not added by the all-reduce (each of its additions would round): every rank writes its
  pair into its own slot of an [R] vector, zeros elsewhere, so the psum adds only zeros and
  is exact, and every rank then sums the R slots with two-sum itself. The one rounding left
  is :math:`D = \mathrm{fl}(h + \ell)`: relative error :math:`u + O(n u^2)` (:math:`u =
  2^{-24}` in float32) for every layout and every order of the additions, where a running
  float32 sum of n weights is off by up to :math:`n u` relative (the float32-count bug of
  docs/bugs.md, once W passes :math:`2^{24}`).

The weights themselves are read in the denominator dtype (`jax_impl.spec_counts`); a batch
whose weights are already narrower than float32 is refused, since their rounding cannot be
undone here.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


def denominator_dtype() -> jnp.dtype:
    """float64 under ``jax_enable_x64``, else float32: where d, D and the loss sums live."""
    return jnp.dtype(jnp.float64 if jax.config.jax_enable_x64 else jnp.float32)


def loss_dtype(dtype: jnp.dtype | type) -> jnp.dtype:
    """The dtype of the per-token cross-entropy for logits of `dtype`: at least float32.

    bfloat16 logits are upcast before the log-softmax, as Hugging Face's ``logits.float()``
    does: logsumexp over a vocabulary in 8 bits would round every l_t by up to 2^-9.
    """
    return jnp.promote_types(dtype, jnp.float32)


def refuse_narrow_float(dtype: jnp.dtype | type | str, message: str) -> jnp.dtype:
    """`dtype` as a ``jnp.dtype``; ValueError(`message`) when it is a float narrower than
    float32 (bfloat16, float16), whose few significant bits would round a denominator.

    `message` is formatted with ``{dtype}`` and ``{bits}``, the dtype's significant bits.
    """
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32:
        raise ValueError(message.format(dtype=dtype, bits=jnp.finfo(dtype).nmant + 1))
    return dtype


def check_weights_dtype(dtype: jnp.dtype | type | str) -> None:
    """Raise ValueError when soft weights of `dtype` are a float narrower than float32."""
    refuse_narrow_float(
        dtype,
        "soft weights arrived as {dtype}: each w_t is already rounded to {bits} significant "
        "bits, and so would be the weighted mean's denominator sum w_t. Lay the batch out with "
        "weights_dtype=float32 (or float64), whatever the params' dtype.",
    )


class ExactSum(NamedTuple):
    r"""A sum as an unevaluated pair: its value is ``hi + lo``, with ``hi`` the rounded sum and
    ``lo`` the rounding error that the additions made (:math:`|\ell| \lesssim n u |h|`)."""

    hi: jax.Array
    lo: jax.Array

    def value(self) -> jax.Array:
        """hi + lo, rounded once."""
        return self.hi + self.lo


def two_sum(a: jax.Array, b: jax.Array) -> ExactSum:
    r"""Knuth's error-free addition: :math:`s = \mathrm{fl}(a + b)`, :math:`e = (a + b) - s`
    exactly, for any a, b of one binary floating dtype (no ordering of |a|, |b| needed).

    The compensation survives compilation because XLA does not reassociate floating-point
    additions (JAX leaves XLA's CPU fast-math off); tests/test_jax_denominators.py checks it on
    CPU, where a plain float32 sum of the same values loses what this keeps.
    """
    s = a + b
    b_virtual = s - a
    a_virtual = s - b_virtual
    return ExactSum(s, (a - a_virtual) + (b - b_virtual))


def add_exact(x: ExactSum, y: ExactSum) -> ExactSum:
    """The pair of x + y: the his added with two_sum, its error joining the los."""
    s = two_sum(x.hi, y.hi)
    return ExactSum(s.hi, s.lo + (x.lo + y.lo))


def exact_sum(values: jax.Array | ExactSum, axis: int | tuple[int, ...] | None = None) -> ExactSum:
    """Sum `values` (an array, or a pair of arrays) over `axis` (all axes when None) as a pair.

    One variadic ``lax.reduce`` whose combiner is `add_exact`: every addition, in whatever
    order XLA performs them, keeps its rounding error.
    """
    pair = values if isinstance(values, ExactSum) else ExactSum(values, jnp.zeros_like(values))
    axes = tuple(range(pair.hi.ndim)) if axis is None else axis
    axes = (axes,) if isinstance(axes, int) else tuple(a % pair.hi.ndim for a in axes)
    # Zeros built from the data: under shard_map they carry its varying-axes type.
    zero = jnp.zeros_like(pair.hi, shape=())
    hi, lo = lax.reduce(
        (pair.hi, pair.lo),
        (zero, zero),
        lambda x, y: tuple(add_exact(ExactSum(*x), ExactSum(*y))),
        axes,
    )
    return ExactSum(hi, lo)


def rank_slots(local: ExactSum, axis_name: str) -> ExactSum:
    """This rank's pair in slot r of [R] zeros: a psum of the slots adds only zeros (exact),
    and `exact_sum` of the psummed slots is the pair of the total. Call inside `axis_name`'s
    mapping; the slots ride in the same psum as whatever else is reduced."""
    world_size = lax.axis_size(axis_name)
    mine = jnp.arange(world_size) == lax.axis_index(axis_name)
    return ExactSum(jnp.where(mine, local.hi, 0), jnp.where(mine, local.lo, 0))


def divide_by_denominator(grad_sums: Any, safe_D: jax.Array) -> Any:
    """Every leaf g / D, divided in the wider of g's dtype and D's, then cast back to g's.

    With bfloat16 gradients the quotient is formed in float32 (or float64) and rounded once
    into bfloat16, instead of rounding D to 8 bits first (`safe_D`: D > 0, see
    `safe_denominator`).
    """

    def divide(g: jax.Array) -> jax.Array:
        dtype = jnp.promote_types(g.dtype, safe_D.dtype)
        return (g.astype(dtype) / safe_D.astype(dtype)).astype(g.dtype)

    return jax.tree.map(divide, grad_sums)


def safe_denominator(D: jax.Array) -> jax.Array:
    """D where D > 0, else 1. D = 0 only when every a_t of the unit is 0, so the numerator
    is exactly 0 and 0 / 1 = 0 is the objective's value; 0 / 0 would be NaN (and NaN grads)."""
    return jnp.where(D > 0, D, jnp.ones_like(D))
