"""The batch a spec step reads: the four token arrays plus contract v2's row and token fields.

`SpecBatch` holds ``inputs``, ``targets``, ``segment_ids``, ``weights`` ([R, M, B, T], the
fields of `jax_impl.losses.Microbatch`, under the same names so that every code path that
reads a Microbatch reads a SpecBatch too) and the fields of docs/schemes-as-data.md:

- ``group_ids`` [R, M, B] int32: the prompt group of each row, a global id in [0, num_groups);
- ``document_ids`` [R, M, B, T] int32: a global document id per token, 0 = padding;
- ``row_weights`` [R, M, B] in the denominator dtype: a per-sample weight, any sign;
- ``sample_mask`` [R, M, B] int32 (0 / 1): 0 drops the whole row.

It is a pytree whose leaves are those eight arrays, placed and sharded like a Microbatch (the
rank axis first). ``num_groups`` and ``num_documents`` (the largest id + 1) are *static*
pytree metadata: the count pre-pass (`jax_impl.spec_counts`) builds per-id count vectors of
that length, a shape, which must be known before tracing; they travel with the batch, so a
compiled step is retraced only when they change, and every process of a multi-process run
derives the same numbers from the same global batch.

`lay_out_spec_batch` builds one on the host from [N, T] / [N] arrays, every new field
defaulted as the doc says (each row its own group; one document per (row, segment); row
weight 1; sample mask 1), and validates it (errors name the array and row).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import jax
import numpy as np

from jax_impl.batch import lay_out_global_batch
from jax_impl.denominators import denominator_dtype

#: The per-row fields ([N] in a global batch) and the per-token one ([N, T]).
ROW_KEYS = ("group_ids", "row_weights", "sample_mask")
TOKEN_KEYS = ("document_ids",)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SpecBatch:
    """A laid-out batch with contract v2's fields (see the module docstring); leading axes
    [R, M] (a whole update), [M] (one rank) or none (one microbatch)."""

    inputs: jax.Array
    targets: jax.Array
    segment_ids: jax.Array
    weights: jax.Array
    group_ids: jax.Array
    document_ids: jax.Array
    row_weights: jax.Array
    sample_mask: jax.Array
    num_groups: int = field(default=1, metadata={"static": True})
    num_documents: int = field(default=1, metadata={"static": True})


def _check_ids(key: str, ids: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if ids.shape != shape:
        raise ValueError(f"spec batch: {key} must have shape {shape}, got {ids.shape}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"spec batch: {key} must be integers, got {ids.dtype}")
    if (ids < 0).any() or (ids > np.iinfo(np.int32).max).any():
        row = int(np.argwhere((ids < 0) | (ids > np.iinfo(np.int32).max))[0][0])
        raise ValueError(f"spec batch: {key} of row {row} is outside [0, 2^31)")
    return ids.astype(np.int32)


def default_document_ids(segment_ids: np.ndarray) -> np.ndarray:
    """One global id per (row, nonzero segment id), numbered 1, 2, ... in row order; 0 on
    padding. A packed document is then a document that never crosses its row."""
    segment_ids = np.asarray(segment_ids)
    key = np.arange(segment_ids.shape[0])[:, None] * (int(segment_ids.max()) + 1) + segment_ids
    _, dense = np.unique(np.where(segment_ids > 0, key, -1), return_inverse=True)
    dense = dense.reshape(segment_ids.shape)
    # np.unique sorts: -1 (padding) is 0 when present, so the documents start at 1 or 0.
    first_document = 1 if (segment_ids == 0).any() else 0
    return np.where(segment_ids > 0, dense + 1 - first_document, 0).astype(np.int32)


def lay_out_spec_batch(
    arrays: Mapping[str, np.ndarray],
    world_size: int,
    accum_steps: int,
    *,
    vocab_size: int,
    weights_dtype: np.dtype | type | str | None = None,
    num_groups: int | None = None,
    num_documents: int | None = None,
) -> SpecBatch:
    """Validate a global batch and its optional v2 fields; reshape to [R, M, B(, T)].

    `arrays` holds ``inputs``, ``targets``, ``segment_ids``, ``weights`` ([N, T], checked by
    `jax_impl.batch.lay_out_global_batch`) and optionally ``group_ids`` [N], ``document_ids``
    [N, T], ``row_weights`` [N] and ``sample_mask`` [N] (defaults in the module docstring).
    A token with a loss must have a nonzero document id; row weights must be finite; the
    sample mask 0 or 1. Row weights are laid out in the denominator dtype (any sign).

    `num_groups` / `num_documents` (default: the largest id + 1) may be set larger, so that
    batches with different ids share one compiled step (they are static shapes).
    """
    token = lay_out_global_batch(
        arrays, world_size, accum_steps, vocab_size=vocab_size, weights_dtype=weights_dtype
    )
    targets = np.asarray(arrays["targets"])
    num_rows, seq_len = targets.shape
    group_ids = _check_ids(
        "group_ids", np.asarray(arrays.get("group_ids", np.arange(num_rows))), (num_rows,)
    )
    if "document_ids" in arrays:
        document_ids = _check_ids(
            "document_ids", np.asarray(arrays["document_ids"]), (num_rows, seq_len)
        )
    else:
        document_ids = default_document_ids(arrays["segment_ids"])
    # Document 0 is padding, exactly where segment 0 is (and padding carries no loss).
    bad = (document_ids == 0) != (np.asarray(arrays["segment_ids"]) == 0)
    if bad.any():
        row, pos = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"spec batch: document_ids[{row}, {pos}] = {int(document_ids[row, pos])} with "
            f"segment id {int(arrays['segment_ids'][row, pos])}: document 0 is padding, "
            "exactly where segment 0 is"
        )
    row_weights = np.asarray(arrays.get("row_weights", np.ones(num_rows)))
    if row_weights.shape != (num_rows,) or not np.isfinite(row_weights).all():
        raise ValueError(
            f"spec batch: row_weights must be {num_rows} finite numbers, got shape "
            f"{row_weights.shape}"
        )
    sample_mask = np.asarray(arrays.get("sample_mask", np.ones(num_rows, np.int32)))
    if sample_mask.shape != (num_rows,) or not np.isin(sample_mask, (0, 1)).all():
        raise ValueError(f"spec batch: sample_mask must be {num_rows} values of 0 or 1")
    B = num_rows // (world_size * accum_steps)
    rows = (world_size, accum_steps, B)
    return SpecBatch(
        *token,
        group_ids=group_ids.reshape(rows),
        document_ids=document_ids.reshape(*rows, seq_len),
        row_weights=row_weights.astype(np.dtype(denominator_dtype().name)).reshape(rows),
        sample_mask=sample_mask.astype(np.int32).reshape(rows),
        num_groups=_id_space("num_groups", int(group_ids.max()) + 1, num_groups),
        num_documents=_id_space("num_documents", int(document_ids.max()) + 1, num_documents),
    )


def _id_space(key: str, needed: int, given: int | None) -> int:
    if given is None:
        return needed
    if given < needed:
        raise ValueError(f"spec batch: {key} = {given} but the ids need {needed}")
    return int(given)


def spec_rank_slice(batch: SpecBatch, rank: int, count: int = 1) -> SpecBatch:
    """Ranks rank .. rank + count - 1's [count, M, ...] block (what one process of a
    multi-process run places: the ranks of its devices)."""
    return jax.tree.map(lambda x: np.asarray(x)[rank : rank + count], batch)
