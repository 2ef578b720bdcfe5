r"""The weighting schemes in JAX: each microbatch's token weights a_t and denominator d.

One optimizer update sees R ranks x M microbatches. A scheme gives every token a weight
:math:`a_t` that is computable inside its own microbatch and every microbatch a denominator
contribution :math:`d`; the objective is

.. math::

    L = \frac{\sum_t a_t\, l_t}{D}, \qquad D = \sum_{\text{microbatches}} d

(``sum`` fixes :math:`D = 1`; ``constant`` may fix :math:`D = C`). Only labels enter a_t and d,
so the whole denominator of an update can be known before any forward pass (the precount
strategy).

d is returned in two channels, ``count`` (int32) and ``weight_sum`` (an `ExactSum` pair in the
denominator dtype): every scheme but ``weighted_mean`` counts something, and an int32 count
stays exact up to 2^31 tokens where a float32 one stops being exact past 2^24 (the
float32-count bug of docs/bugs.md); weighted_mean's :math:`d = \sum_t w_t v_t` is summed with its
rounding errors kept. Exactly one channel is nonzero for each scheme, and D rounds once:

.. math::

    D = \mathrm{fl}\Big(\sum_{r,m} \mathrm{count}_{rm}\Big) \quad\text{or}\quad
    D = \mathrm{fl}\Big(\sum_{r,m} \mathrm{weight\_sum}_{rm}\Big)

in the denominator dtype (float64 under ``jax_enable_x64``, else float32), never in the
params' dtype. The token weights a_t are in that dtype too; the rule and its reasons are in
`jax_impl.denominators`.

Written from docs/contract.md's table, independently of the numpy contract in ``crosscheck``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_impl.denominators import ExactSum, exact_sum, weights_for_denominator

IGNORE_INDEX = -100
"""Target value of a token without a loss (the torch / Hugging Face convention)."""


class Scheme(enum.IntEnum):
    """The intended schemes; the integer value indexes ``lax.switch`` in a compiled step."""

    TOKEN_MEAN = 0
    """a_t = v_t, d = valid tokens: every valid token of the update weighs the same."""
    SEQUENCE_MEAN = 1
    """a_t = v_t / n_seg(t), d = segments (row, segment id) with n_seg > 0."""
    ROW_MEAN = 2
    """a_t = v_t / n_row(t), d = rows with n_row > 0."""
    WEIGHTED_MEAN = 3
    """a_t = w_t v_t, d = sum of w_t v_t."""
    CONSTANT = 4
    """a_t = v_t, d = B * T target slots (padding included), unless a normalizer C fixes D."""
    SUM = 5
    """a_t = v_t, D = 1."""

    @property
    def label(self) -> str:
        """The contract's name of the scheme, e.g. ``"token_mean"``."""
        return self.name.lower()

    @classmethod
    def from_name(cls, name: str | int) -> Scheme:
        """Look a scheme up by its contract name (``"token_mean"``) or index."""
        try:
            return cls(name) if isinstance(name, int) else cls[name.upper()]
        except (KeyError, ValueError):
            known = ", ".join(f"{s.label} ({s.value})" for s in cls)
            raise ValueError(f"unknown scheme {name!r}; known schemes: {known}") from None


class SchemeTerms(NamedTuple):
    """a_t for every token of a microbatch and its denominator contribution d (two channels)."""

    token_weights: jax.Array  # [B, T], the denominator dtype
    count: jax.Array  # int32 scalar: d of the counting schemes
    weight_sum: ExactSum  # scalar pair, denominator dtype: d of weighted_mean


def _valid(targets: jax.Array) -> jax.Array:
    return targets != IGNORE_INDEX


def _inverse_group_size(group_size: jax.Array, valid: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """v_t / n_group(t), with 0 (not 0/0) where the token is invalid."""
    safe = jnp.where(group_size > 0, group_size, 1).astype(dtype)
    return jnp.where(valid, 1 / safe, 0).astype(dtype)


def _terms(
    weights: jax.Array, count: jax.Array | int = 0, weight_sum: ExactSum | None = None
) -> SchemeTerms:
    """Pack a branch's result. Constant channels are built with ``full_like`` of the data so
    that under shard_map they carry the data's varying-manual-axes type: ``lax.switch`` needs
    every branch to return the same type, and a literal 0 would be axis-invariant."""
    if not isinstance(count, jax.Array):
        count = jnp.full_like(weights, count, shape=(), dtype=jnp.int32)
    if weight_sum is None:
        zero = jnp.zeros_like(weights, shape=())
        weight_sum = ExactSum(zero, zero)
    return SchemeTerms(weights, count.astype(jnp.int32), weight_sum)


def token_mean_terms(targets: jax.Array, segment_ids: jax.Array, weights: jax.Array) -> SchemeTerms:
    """Global token mean (torchtitan's ``global_valid_tokens``): a_t = v_t, d = sum v_t."""
    del segment_ids
    valid = _valid(targets)
    return _terms(valid.astype(weights.dtype), jnp.sum(valid, dtype=jnp.int32))


def sequence_mean_terms(
    targets: jax.Array, segment_ids: jax.Array, weights: jax.Array
) -> SchemeTerms:
    """Mean over packed documents of each document's token mean.

    A document is a (row, segment id) pair. ``same[b, t, u]`` says tokens t and u of row b share
    a segment; n_seg(t) is the number of valid u among them, computed by comparison rather than
    by a segment-indexed scatter so that segment ids need no bound known at trace time. The
    document count d counts each document's first valid token, an exact integer.
    """
    valid = _valid(targets)
    same = segment_ids[:, :, None] == segment_ids[:, None, :]  # [B, T, T]
    same_valid = same & valid[:, None, :]
    n_seg = jnp.sum(same_valid, axis=-1, dtype=jnp.int32)
    seq_len = targets.shape[-1]
    earlier = jnp.tril(jnp.ones((seq_len, seq_len), dtype=bool), k=-1)  # u < t
    has_earlier_valid = jnp.any(same_valid & earlier, axis=-1)
    first_of_segment = valid & ~has_earlier_valid
    return _terms(
        _inverse_group_size(n_seg, valid, weights.dtype),
        jnp.sum(first_of_segment, dtype=jnp.int32),
    )


def row_mean_terms(targets: jax.Array, segment_ids: jax.Array, weights: jax.Array) -> SchemeTerms:
    """Mean over rows of each row's token mean: a_t = v_t / n_row(t), d = rows with n_row > 0."""
    del segment_ids
    valid = _valid(targets)
    n_row = jnp.sum(valid, axis=-1, keepdims=True, dtype=jnp.int32)
    a = _inverse_group_size(jnp.broadcast_to(n_row, valid.shape), valid, weights.dtype)
    return _terms(a, jnp.sum(n_row > 0, dtype=jnp.int32))


def weighted_mean_terms(
    targets: jax.Array, segment_ids: jax.Array, weights: jax.Array
) -> SchemeTerms:
    """Soft-weighted mean: a_t = w_t v_t, d = sum w_t v_t (ignored tokens drop their w_t).

    d is an `ExactSum`: its value rounds once, however many tokens the microbatch has.
    """
    del segment_ids
    a = jnp.where(_valid(targets), weights, 0).astype(weights.dtype)
    return _terms(a, 0, exact_sum(a))


def constant_terms(targets: jax.Array, segment_ids: jax.Array, weights: jax.Array) -> SchemeTerms:
    """Sum over a normalizer fixed before the batch is seen: a_t = v_t, d = B * T slots.

    Counting every slot, padding included, makes D = N * T for the update (T5X's
    NUM_TOTAL_TARGET_TOKENS); a normalizer C given to the step replaces it.
    """
    del segment_ids
    return _terms(_valid(targets).astype(weights.dtype), targets.size)


def sum_terms(targets: jax.Array, segment_ids: jax.Array, weights: jax.Array) -> SchemeTerms:
    """Plain sum: a_t = v_t; d = 0 here because D is fixed to 1 for the update."""
    del segment_ids
    return _terms(_valid(targets).astype(weights.dtype))


SchemeFn = Callable[[jax.Array, jax.Array, jax.Array], SchemeTerms]

#: The branch of every scheme, in the order of the enum (``lax.switch`` indexes this tuple).
SCHEME_FNS: tuple[SchemeFn, ...] = (
    token_mean_terms,
    sequence_mean_terms,
    row_mean_terms,
    weighted_mean_terms,
    constant_terms,
    sum_terms,
)


def scheme_terms(
    scheme: Scheme | str | int | jax.Array,
    targets: jax.Array,
    segment_ids: jax.Array,
    weights: jax.Array,
) -> SchemeTerms:
    """(a_t, d) for a stack of microbatches [..., B, T] under a static or traced scheme.

    A Scheme (or its name) calls its branch directly. A traced int32 scheme index selects the
    branch with ``lax.switch``, so one compiled step serves every scheme: the test matrix
    compiles once per layout, not once per (layout, scheme).

    The weights are read in the denominator dtype (float64 under x64, else float32), whatever
    dtype the params have; weights narrower than float32 are refused
    (`jax_impl.denominators.weights_for_denominator`).
    """
    if targets.ndim < 2:
        raise ValueError(f"scheme_terms needs targets of shape [..., B, T], got {targets.shape}")
    weights = weights_for_denominator(weights)
    if isinstance(scheme, int | str):
        fn = _vectorize(SCHEME_FNS[Scheme.from_name(scheme)], targets.ndim - 2)
        return fn(targets, segment_ids, weights)
    return _switch_terms(scheme, targets, segment_ids, weights)


def _vectorize(fn: SchemeFn, batch_dims: int) -> SchemeFn:
    for _ in range(batch_dims):
        fn = jax.vmap(fn)
    return fn


@jax.jit
def _switch_terms(
    scheme: jax.Array, targets: jax.Array, segment_ids: jax.Array, weights: jax.Array
) -> SchemeTerms:
    # jit-wrapped so that its trace is cached per shape: a step that computes several
    # strategies side by side (a sweep) traces the six branches once, not once per strategy.
    branches = [_vectorize(fn, targets.ndim - 2) for fn in SCHEME_FNS]
    return jax.lax.switch(scheme, branches, targets, segment_ids, weights)


def global_denominator(
    scheme: Scheme | jax.Array,
    total_count: jax.Array,
    total_weight_sum: ExactSum,
    constant_normalizer: float | jax.Array = 0.0,
) -> jax.Array:
    """D from the summed d channels: count + weight_sum, except sum (1) and constant with C > 0.

    Both channels are complete sums over every microbatch and rank of the update; D is in the
    dtype of the weight-sum pair (the denominator dtype). The int32 count is converted once,
    after all reductions: a single rounding (relative 2^-24 in float32, none in float64 below
    2^53) instead of one per addition; the weight-sum pair rounds once too. One channel is
    zero for every scheme, so their sum adds no rounding.
    """
    dtype = jnp.result_type(total_weight_sum.hi)
    D = total_count.astype(dtype) + total_weight_sum.value()
    D = jnp.where(scheme == Scheme.SUM, jnp.ones((), dtype), D)
    normalizer = jnp.asarray(constant_normalizer, dtype)
    return jnp.where((scheme == Scheme.CONSTANT) & (normalizer > 0), normalizer, D)


def safe_denominator(D: jax.Array) -> jax.Array:
    """D where D > 0, else 1. D = 0 only when every a_t of the update is 0, so the numerator
    is exactly 0 and 0 / 1 = 0 is the objective's value; 0 / 0 would be NaN (and NaN grads)."""
    return jnp.where(D > 0, D, jnp.ones_like(D))
