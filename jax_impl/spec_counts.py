r"""One rank's a_t and denominators under a spec, with the count pre-pass; inside a named axis.

Runs on one rank's [M, B, T] `jax_impl.batch.Batch` inside ``pmap`` / ``shard_map``
(or a ``vmap`` with the same axis name: the global-view step). Everything here reads labels
and the v2 fields only, so all of it is known before any forward pass.

Counts. n_G(t) is the number of tokens u with m_u = 1 and G(u) = G(t) inside t's unit of the
count scope. Rows, segments and microbatches never cross a microbatch, and a rank never
crosses a rank, so their counts are local sums. A ``group`` (row-level id) or ``document``
(token-level id) may span microbatches and ranks: each rank scatters its mask into a per-id
vector per microbatch ([M, n], n = max id + 1, a static shape carried by the batch), sums it
to a rank vector [n], and one psum over the axis gives the update's vector before any
backward (the count pre-pass). Then n_G(t) is a gather, local again. All counts are int32.

Denominators. With U the denominator's scope and D_u over one unit of it:

- parts that add up over microbatches (tokens, slots, weight sums, the rows / segments /
  microbatches with a token, power sums over groups that never cross the unit's pieces) are
  kept per microbatch: an int32 channel ``mb_count`` [M] and an `ExactSum` channel
  ``mb_weight`` [M] in the denominator dtype, plus ``rank_count``, rank-level (the number
  of non-empty ranks, grouping ``rank``);
- distinct-id counts (``groups`` / ``all_groups`` of ``group`` or ``document``) are not sums
  of local parts: they come from the count vector at U's scope, ``derived`` (int32; for
  ``power_sum`` with update counts, float: sum over ids of N_g^(-alpha')).

Every part summed over ranks (U = update) is computed from local counts only, so in precount
it can ride in the pre-pass's psum (one collective before the backward). Parts that need the
update's count vector are only ever needed for U = rank or microbatch, where nothing more is
reduced. ``power_sum`` sums over the non-empty groups of u of n_{G'}^(-alpha') with counts at
the weight's count scope; with f the finer of U and that scope it is, token by token,
:math:`\sum_{t \in u,\ m'_t = 1} n_{cs}(t)^{-\alpha'} / n_f(t)` (each group's n_f tokens in
a piece f add up to one term), except for id groupings counted at update scope with U =
update, taken from the update's vector. A group or document counted in several units of a
count scope finer than U (count_scope microbatch, U = update) adds one term per unit, each
with its own count, as docs/schemes-as-data.md says.

Context parallel (docs/contract.md#context-parallel): with ``axis_name`` = (data axis,
context axis) every process holds its rows' positions of one context rank, and a "rank" is
a process. Rows and segments then cross processes: their counts over the update are taken
from the whole rows, gathered over the context axis (every context rank of a data rank
holds the same rows, so one ``all_gather`` of the mask and the segment ids gives them), and
a row-level part of D over the update (the non-empty rows or segments, the absolute row
weights) is counted by context rank 0 alone, so that the sum over the processes counts each
row once. Counts at scope ``rank`` or ``microbatch`` are the process's own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_impl.batch import IGNORE_INDEX, Batch
from jax_impl.denominators import ExactSum, check_weights_dtype, denominator_dtype, exact_sum
from jax_impl.spec import ID_GROUPINGS, SchemeSpec


def finer(a: str, b: str) -> str:
    """The finer of two scopes (microbatch < rank < update)."""
    order = ("microbatch", "rank", "update")
    return order[min(order.index(a), order.index(b))]


class Masks(NamedTuple):
    """Token masks [M, B, T] (bool) of one rank."""

    valid: jax.Array
    sample: jax.Array  # the row's sample_mask, broadcast over the row
    nonzero_weight: jax.Array


def masks(batch: Batch) -> Masks:
    valid = batch.targets != IGNORE_INDEX
    sample = jnp.broadcast_to((batch.sample_mask != 0)[..., None], valid.shape)
    return Masks(valid, sample, batch.weights != 0)


def token_mask(name: str, m: Masks) -> jax.Array:
    """m_t of a mask name: valid, sample (v_t times the row's sample_mask) or nonzero_weight."""
    if name == "valid":
        return m.valid
    if name == "sample":
        return m.valid & m.sample
    return m.valid & m.nonzero_weight


def presence_mask(grouping: str, mask_name: str, batch: Batch, m: Masks) -> jax.Array:
    """The tokens that make a group *present* for ``all_groups`` (empty groups included):
    every slot of a row, or of a nonzero segment or document id; with mask ``sample`` only in
    rows whose sample_mask is 1. Validity and weights do not matter here."""
    present = jnp.ones_like(m.valid)
    if grouping == "segment":
        present = batch.segment_ids != 0
    elif grouping == "document":
        present = batch.document_ids != 0
    return present & m.sample if mask_name == "sample" else present


def _first_id(grouping: str) -> int:
    """Document id 0 is padding, never a document; every group id is a group."""
    return 1 if grouping == "document" else 0


def id_vectors(mask: jax.Array, grouping: str, batch: Batch) -> jax.Array:
    """[M, n] int32: per microbatch, the tokens of `mask` per group or document id."""
    if grouping == "group":
        per_row = jnp.sum(mask, axis=-1, dtype=jnp.int32)  # [M, B]
        ids, values, n = batch.group_ids, per_row, batch.num_groups
    else:
        ids, values, n = batch.document_ids, mask.astype(jnp.int32), batch.num_documents
    flat = (ids.reshape(ids.shape[0], -1), values.reshape(values.shape[0], -1))
    return jax.vmap(lambda i, v: jax.ops.segment_sum(v, i, num_segments=n))(*flat)


class IdCounts(NamedTuple):
    """Count vectors of one (mask, id grouping) at the three scopes; `update` after psum."""

    microbatch: jax.Array  # [M, n]
    rank: jax.Array  # [n]
    update: jax.Array | None  # [n], None until the pre-pass psum ran


class Context(NamedTuple):
    """The context-parallel axis, or none (`context_of`)."""

    axis: str | None = None

    def whole_rows(self, x: jax.Array) -> jax.Array:
        """[..., T] of every context rank's positions of these rows (in rank order, a
        permutation of the row: counts do not depend on it); `x` itself without CP."""
        if self.axis is None:
            return x
        return jax.lax.all_gather(x, self.axis, axis=x.ndim - 1, tiled=True)

    def once_per_row(self, x: jax.Array) -> jax.Array:
        """`x` on context rank 0, 0 on the others: a row-level part summed over processes."""
        if self.axis is None:
            return x
        return jnp.where(jax.lax.axis_index(self.axis) == 0, x, jnp.zeros_like(x))


#: No context parallel: every process holds whole rows.
NO_CONTEXT = Context()


def context_of(axis_name: str | tuple[str, ...]) -> Context:
    """(data axis, context axis) under context parallel: the last name splits the positions."""
    if isinstance(axis_name, tuple) and len(axis_name) > 1:
        return Context(axis_name[-1])
    return NO_CONTEXT


def token_counts(
    mask: jax.Array,
    grouping: str,
    scope: str,
    batch: Batch,
    ids: IdCounts | None,
    context: Context = NO_CONTEXT,
) -> jax.Array:
    """n_G(t) (int32, broadcastable to [M, B, T]): `mask`'s tokens of t's group in t's unit."""
    if grouping in ("row", "segment") and scope == "update":
        # The whole row's tokens, whichever process holds them.
        whole = context.whole_rows(mask)
        if grouping == "row":
            return jnp.sum(whole, axis=-1, keepdims=True, dtype=jnp.int32)
        segments = context.whole_rows(batch.segment_ids)
        same = batch.segment_ids[..., :, None] == segments[..., None, :]
        return jnp.sum(same & whole[..., None, :], axis=-1, dtype=jnp.int32)
    if grouping == "row":
        return jnp.sum(mask, axis=-1, keepdims=True, dtype=jnp.int32)
    if grouping == "segment":
        same = batch.segment_ids[..., :, None] == batch.segment_ids[..., None, :]
        return jnp.sum(same & mask[..., None, :], axis=-1, dtype=jnp.int32)
    if grouping == "microbatch" or (grouping == "rank" and scope == "microbatch"):
        return jnp.sum(mask, axis=(-2, -1), keepdims=True, dtype=jnp.int32)
    if grouping == "rank":
        return jnp.sum(mask, keepdims=True, dtype=jnp.int32)
    assert ids is not None, f"{grouping} counts need the count vectors"
    token_ids = batch.group_ids[..., None] if grouping == "group" else batch.document_ids
    if scope == "microbatch":
        flat = token_ids.reshape(token_ids.shape[0], -1)
        gathered = jnp.take_along_axis(ids.microbatch, flat, axis=1)
        return gathered.reshape(token_ids.shape)
    vector = ids.rank if scope == "rank" else ids.update
    assert vector is not None, "update-scope counts need the pre-pass psum"
    return vector[token_ids]


def inverse_power(n: jax.Array, alpha: float, on: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """n^(-alpha) where `on`, else 0 (never 0^(-alpha)): 1/n for alpha = 1, a division
    that rounds once (a pow would round differently), 1 for alpha = 0."""
    safe = jnp.where(n > 0, n, 1).astype(dtype)
    if alpha == 1.0:
        value = 1 / safe
    elif alpha == 0.0:
        value = jnp.ones_like(safe)
    else:
        value = safe ** jnp.asarray(-alpha, dtype)
    return jnp.where(on, value, 0).astype(dtype)


def nonempty(counts: jax.Array, first: int) -> jax.Array:
    """How many ids from `first` on have a count > 0 (last axis), int32."""
    return jnp.sum(counts[..., first:] > 0, axis=-1, dtype=jnp.int32)


class DenominatorParts(NamedTuple):
    """D's pieces on one rank (see the module docstring); None where a kind has none."""

    mb_count: jax.Array  # [M] int32
    mb_weight: ExactSum  # [M] pairs, denominator dtype
    rank_count: jax.Array  # int32 scalar
    derived_count: jax.Array | None  # int32 at U's unit ([M] for microbatch, else scalar)
    derived_float: jax.Array | None  # denominator dtype, likewise


class SpecTerms(NamedTuple):
    """a_t of one rank's microbatches and D's parts."""

    token_weights: jax.Array  # [M, B, T], denominator dtype
    parts: DenominatorParts


def _groups_parts(
    mask: jax.Array, grouping: str, scope: str, batch: Batch, context: Context = NO_CONTEXT
) -> tuple[jax.Array | None, jax.Array | None]:
    """(mb_count [M], rank_count) of the groups with a token of `mask`, for the groupings
    that never cross a microbatch (row, segment, microbatch) or a rank (rank); under context
    parallel a row or segment of the update is counted on its whole row, by context rank 0."""
    segment_ids = batch.segment_ids
    if grouping in ("row", "segment") and scope == "update":
        mask, segment_ids = context.whole_rows(mask), context.whole_rows(segment_ids)
    else:
        context = NO_CONTEXT  # the process's own groups: counted where they are
    if grouping == "row":
        per_row = jnp.sum(mask, axis=-1, dtype=jnp.int32)
        return context.once_per_row(jnp.sum(per_row > 0, axis=-1, dtype=jnp.int32)), None
    if grouping == "segment":
        # A segment's first token of `mask` stands for it: an exact integer count.
        same = segment_ids[..., :, None] == segment_ids[..., None, :]
        seq_len = mask.shape[-1]
        earlier = jnp.tril(jnp.ones((seq_len, seq_len), dtype=bool), k=-1)  # u < t
        first = mask & ~jnp.any(same & mask[..., None, :] & earlier, axis=-1)
        return context.once_per_row(jnp.sum(first, axis=(-2, -1), dtype=jnp.int32)), None
    per_mb = jnp.sum(mask, axis=(-2, -1), dtype=jnp.int32)
    if grouping == "microbatch" or scope == "microbatch":
        # Grouping rank inside a microbatch unit: the rank's group there is the microbatch.
        return (per_mb > 0).astype(jnp.int32), None
    return None, (jnp.sum(per_mb) > 0).astype(jnp.int32)  # grouping rank: a non-empty rank


def denominator_parts(
    spec: SchemeSpec,
    batch: Batch,
    d_mask: jax.Array,
    ids: dict[tuple[str, str], IdCounts],
    with_derived: bool = True,
    context: Context = NO_CONTEXT,
) -> DenominatorParts:
    """D's parts of one rank (module docstring). Without `with_derived` the unit-level
    parts, which may need the update's count vectors, are left out (None)."""
    dtype = denominator_dtype()
    w, d, U = spec.weight, spec.denominator, spec.scope
    M = batch.targets.shape[0]
    # Zeros built from the data: under shard_map they vary across ranks like the real parts.
    zero_count = jnp.zeros_like(batch.targets, shape=(M,), dtype=jnp.int32)
    zero_weight = jnp.zeros_like(batch.targets, shape=(M,), dtype=dtype)
    mb_count, mb_weight = zero_count, ExactSum(zero_weight, zero_weight)
    rank_count = jnp.zeros_like(zero_count, shape=())
    derived_count = derived_float = None
    d_ids = ids.get(("d", d.group))
    if d.kind == "tokens":
        mb_count = jnp.sum(d_mask, axis=(-2, -1), dtype=jnp.int32)
    elif d.kind == "slots":
        mb_count = zero_count + batch.targets[0].size
    elif d.kind in ("groups", "all_groups") and d.group in ID_GROUPINGS:
        if with_derived:
            # Distinct ids with a token in the unit: from the unit's own count vector.
            vector = {"microbatch": d_ids.microbatch, "rank": d_ids.rank}.get(U, d_ids.update)
            derived_count = nonempty(vector, _first_id(d.group))
    elif d.kind in ("groups", "all_groups"):
        c, r = _groups_parts(d_mask, d.group, U, batch, context)
        mb_count = zero_count if c is None else c
        rank_count = rank_count if r is None else r
    elif d.kind == "weight_sum":
        mb_weight = exact_sum(jnp.where(d_mask, batch.weights.astype(dtype), 0), (-2, -1))
    elif d.kind == "abs_row_weight_sum":
        # Every row of the unit, whatever its mask (TRL weighted_nll divides by the absolute
        # weights of all rows, fully masked ones included).
        row_weights = jnp.abs(batch.row_weights).astype(dtype)
        if U == "update":
            row_weights = context.once_per_row(row_weights)
        mb_weight = exact_sum(row_weights, (-1,))
    elif d.kind == "power_sum":
        if d.group in ID_GROUPINGS and w.count_scope == "update" and U == "update":
            if with_derived:  # sum over the update's non-empty ids of N^(-alpha')
                counts = d_ids.update[_first_id(d.group) :]
                power = inverse_power(counts, d.alpha, counts > 0, dtype)
                derived_float = exact_sum(power).value()
        else:
            n_cs = token_counts(d_mask, d.group, w.count_scope, batch, d_ids, context)
            n_f = token_counts(d_mask, d.group, finer(U, w.count_scope), batch, d_ids, context)
            per_token = inverse_power(n_cs, d.alpha, d_mask, dtype)
            per_token = per_token * inverse_power(n_f, 1.0, d_mask, dtype)
            mb_weight = exact_sum(per_token, (-2, -1))
    return DenominatorParts(mb_count, mb_weight, rank_count, derived_count, derived_float)


def numerator_weights(
    spec: SchemeSpec,
    batch: Batch,
    mask: jax.Array,
    ids: dict[tuple[str, str], IdCounts],
    context: Context = NO_CONTEXT,
) -> jax.Array:
    """a_t = m_t s_t n_G(t)^(-alpha) in the denominator dtype, 0 where m_t = 0.

    Built as v_t as a float, where(v, 1 / n, 0) or where(v, w, 0): a mask times 1 is exact,
    and 1 / n rounds once."""
    dtype = denominator_dtype()
    w = spec.weight
    a = None
    if w.group != "none":
        n = token_counts(mask, w.group, w.count_scope, batch, ids.get(("w", w.group)), context)
        a = inverse_power(jnp.broadcast_to(n, mask.shape), w.alpha, mask, dtype)
    soft = None
    if w.soft == "token":
        soft = batch.weights.astype(dtype)
    elif w.soft == "row":
        soft = jnp.broadcast_to(batch.row_weights.astype(dtype)[..., None], mask.shape)
    if soft is not None:
        return jnp.where(mask, soft if a is None else soft * a, 0).astype(dtype)
    return mask.astype(dtype) if a is None else a


def rank_spec_terms(
    spec: SchemeSpec,
    batch: Batch,
    axis_name: str | tuple[str, ...],
    reduce_with_counts: Callable[[DenominatorParts], object] | None = None,
) -> tuple[SpecTerms, object]:
    """a_t and D's parts of one rank's [M, B, T] batch, with the count pre-pass.

    The pre-pass psum runs when an update-scope count vector is needed, or when
    `reduce_with_counts` is given (U = update only): then it maps the local parts to what
    should ride in the same psum (precount's denominator channels), and its reduced value is
    returned second (None otherwise). `axis_name` is the data-parallel axis, or (data axis,
    context axis) under context parallel (module docstring).
    """
    # The weights are read in the denominator dtype below; bfloat16 ones are already rounded.
    check_weights_dtype(batch.weights.dtype)
    w, d, U = spec.weight, spec.denominator, spec.scope
    context = context_of(axis_name)
    m = masks(batch)
    numerator_mask = token_mask(w.mask, m)
    d_mask = token_mask(d.mask, m)
    if d.kind == "all_groups":
        d_mask = presence_mask(d.group, d.mask, batch, m)

    vectors: dict[tuple[str, str], jax.Array] = {}
    if w.group in ID_GROUPINGS:
        vectors[("w", w.group)] = id_vectors(numerator_mask, w.group, batch)
    if d.kind in ("groups", "all_groups", "power_sum") and d.group in ID_GROUPINGS:
        vectors[("d", d.group)] = id_vectors(d_mask, d.group, batch)
    ids = {k: IdCounts(v, jnp.sum(v, axis=0, dtype=jnp.int32), None) for k, v in vectors.items()}
    # The update's vectors are needed by update-scope numerator counts, by distinct-id
    # denominators over the update, and by power sums of update-scope counts.
    d_update = w.count_scope == "update" if d.kind == "power_sum" else U == "update"
    need_update = (w.group in ID_GROUPINGS and w.count_scope == "update") or (
        ("d", d.group) in ids and d_update
    )

    early, to_reduce, reduced = None, None, None
    if U == "update" and reduce_with_counts is not None:
        # Every part summed over ranks uses local counts only (module docstring): it joins
        # the pre-pass psum, the one collective before the backward.
        early = denominator_parts(spec, batch, d_mask, ids, False, context)
        to_reduce = reduce_with_counts(early)
    if need_update or to_reduce is not None:
        rank_vectors = {key: c.rank for key, c in ids.items()} if need_update else {}
        total_vectors, reduced = jax.lax.psum((rank_vectors, to_reduce), axis_name)
        ids = {key: c._replace(update=total_vectors.get(key)) for key, c in ids.items()}
    parts = denominator_parts(spec, batch, d_mask, ids, True, context)
    if early is not None:
        # The same additive parts as went into the psum; the unit-level ones needed it.
        parts = early._replace(derived_count=parts.derived_count, derived_float=parts.derived_float)
    a = numerator_weights(spec, batch, numerator_mask, ids, context)
    return SpecTerms(a, parts), reduced
