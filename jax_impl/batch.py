"""The batch every step reads, its host-side checks and its split into ranks and microbatches.

A global batch is four [N, T] token arrays (``inputs``, ``targets``, ``segment_ids``,
``weights``) and, optionally, the row and token fields of docs/schemes-as-data.md:

- ``group_ids`` [N] int: the prompt group of each row, a global id in [0, num_groups)
  (default: each row its own group);
- ``document_ids`` [N, T] int: a global document id per token, 0 = padding (default: one
  document per (row, segment), `default_document_ids`);
- ``row_weights`` [N]: a per-sample weight, any sign (default 1);
- ``sample_mask`` [N] (0 / 1): 0 drops the whole row (default 1).

Layout (R, M) gives rank r the rows [r N/R, (r+1) N/R) and splits them again into M equal
microbatches: a reshape of the row axis to (R, M, B) with B = N / (R M). Everything here
runs on concrete numpy arrays before any tracing, so a bad input fails with an error naming
the array, row and position instead of a silent NaN.

`Batch` is a pytree whose leaves are those eight arrays, the rank axis first. ``num_groups``
and ``num_documents`` (the largest id + 1) are *static* pytree metadata: the count pre-pass
(`jax_impl.spec_counts`) builds per-id count vectors of that length, a shape, which must be
known before tracing; they travel with the batch, so a compiled step is retraced only when
they change, and every process of a multi-process run derives the same numbers from the same
global batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from jax_impl.denominators import check_weights_dtype, denominator_dtype

IGNORE_INDEX = -100
"""Target value of a token without a loss (the torch / Hugging Face convention)."""

BATCH_KEYS: tuple[str, ...] = ("inputs", "targets", "segment_ids", "weights")

#: The optional per-row fields ([N] in a global batch) and the per-token one ([N, T]).
ROW_KEYS = ("group_ids", "row_weights", "sample_mask")
TOKEN_KEYS = ("document_ids",)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Batch:
    """A laid-out batch (see the module docstring); leading axes [R, M] (a whole update),
    [M] (one rank) or none (one microbatch), then [B] for the row fields and [B, T] for the
    token ones."""

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


#: Ids are laid out as int32 (what the steps index with): a segment id past this would wrap.
_INT32_MAX = int(np.iinfo(np.int32).max)


def _first(mask: np.ndarray) -> tuple[int, ...]:
    return tuple(int(i) for i in np.argwhere(mask)[0])


def _ids_dtype_problem(key: str, array: np.ndarray) -> str | None:
    """Why `array` cannot hold token or segment ids, or None for an integer dtype."""
    if np.issubdtype(array.dtype, np.integer):
        return None
    if np.issubdtype(array.dtype, np.floating):
        integral = np.isfinite(array) & (np.floor(array) == array)
        if integral.all():
            # Float arrays of whole numbers are the usual slip (ids that passed through a
            # float buffer): name it and the fix instead of only the dtype.
            return (
                f"batch: {key} must be integers, got {array.dtype} holding whole numbers; "
                f"convert with np.asarray({key}, dtype=np.int32)"
            )
        row, pos = _first(~integral)
        return (
            f"batch: {key} must be integers, got {array.dtype}; {key}[{row}, {pos}] = "
            f"{array[row, pos].item()!r} is not a whole number"
        )
    return f"batch: {key} must be integers, got {array.dtype}"


def _check_structure(batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Keys, one [N, T] shape, integer ids and floating weights; the arrays as numpy."""
    missing = [key for key in BATCH_KEYS if key not in batch]
    if missing:
        raise ValueError(f"batch is missing {missing}; a batch holds {list(BATCH_KEYS)}")
    arrays = {key: np.asarray(batch[key]) for key in BATCH_KEYS}
    shape = arrays["targets"].shape
    if len(shape) != 2:
        raise ValueError(f"batch: targets must be [N, T], got shape {shape}")
    for key in BATCH_KEYS:
        if arrays[key].shape != shape:
            raise ValueError(f"batch: {key} has shape {arrays[key].shape}, targets {shape}")
    for key in ("inputs", "targets", "segment_ids"):
        problem = _ids_dtype_problem(key, arrays[key])
        if problem:
            raise ValueError(problem)
    if not np.issubdtype(arrays["weights"].dtype, np.floating):
        # Not cast silently: integer weights are usually a mask or a count passed by mistake,
        # and the contract's w_t are real numbers laid out in the denominator dtype.
        raise ValueError(
            f"batch: weights must be floating point (soft per-token weights), got "
            f"{arrays['weights'].dtype}"
        )
    return arrays


def _locate(row: int, rows_per_rank_step: tuple[int, int] | None) -> str:
    """' (rank r, microbatch m, row b of it)' for a global row under a layout, else ''."""
    if rows_per_rank_step is None:
        return ""
    B, M = rows_per_rank_step
    block, b = divmod(row, B)
    rank, step = divmod(block, M)
    return f" (rank {rank}, microbatch {step}, row {b} of that microbatch)"


def _check_values(
    arrays: Mapping[str, np.ndarray], vocab_size: int, layout: tuple[int, int] | None
) -> None:
    """The first bad token, by array, [row, position] and, under a layout, rank and microbatch."""
    inputs, targets = arrays["inputs"], arrays["targets"]
    segment_ids, weights = arrays["segment_ids"], arrays["weights"]
    checks = (
        ("inputs", (inputs < 0) | (inputs >= vocab_size), f"outside [0, {vocab_size})"),
        (
            "targets",
            (targets != IGNORE_INDEX) & ((targets < 0) | (targets >= vocab_size)),
            f"neither {IGNORE_INDEX} nor in [0, {vocab_size})",
        ),
        ("segment_ids", segment_ids < 0, "negative"),
        ("segment_ids", segment_ids > _INT32_MAX, "past int32, the dtype the steps use"),
        ("weights", ~np.isfinite(weights) | (weights < 0), "not finite and >= 0"),
    )
    for key, bad, why in checks:
        if bad.any():
            row, pos = _first(bad)
            value = arrays[key][row, pos].item()
            raise ValueError(
                f"batch: {key}[{row}, {pos}] = {value!r} is {why}{_locate(row, layout)}"
            )
    padding_with_loss = (targets != IGNORE_INDEX) & (segment_ids == 0)
    if padding_with_loss.any():
        row, pos = _first(padding_with_loss)
        raise ValueError(
            f"batch: targets[{row}, {pos}] carries a loss but segment_ids[{row}, {pos}] = 0 "
            f"(padding); padding must have target {IGNORE_INDEX}{_locate(row, layout)}"
        )


def validate_global_batch(batch: Mapping[str, np.ndarray], vocab_size: int) -> None:
    """Raise ValueError naming the first offending array and [row, position].

    Checked: the four keys, one [N, T] shape, integer ids (a float array of whole numbers is
    named as such), floating weights, inputs in [0, V), targets in [0, V) or -100, segment
    ids >= 0 (and within int32), weights finite and >= 0, no loss on padding (segment 0).
    """
    _check_values(_check_structure(batch), vocab_size, None)


def rows_per_microbatch(num_rows: int, world_size: int, accum_steps: int) -> int:
    """B = N / (R M); raises naming the three numbers when N is not divisible by R M."""
    if world_size < 1 or accum_steps < 1:
        raise ValueError(
            f"need world_size >= 1 and accum_steps >= 1, got {world_size}, {accum_steps}"
        )
    if num_rows % (world_size * accum_steps):
        raise ValueError(
            f"a global batch of {num_rows} rows cannot be split over world_size={world_size} "
            f"x accum_steps={accum_steps}: {num_rows} is not divisible by "
            f"{world_size * accum_steps}"
        )
    return num_rows // (world_size * accum_steps)


def _check_ids(key: str, ids: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if ids.shape != shape:
        raise ValueError(f"batch: {key} must have shape {shape}, got {ids.shape}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"batch: {key} must be integers, got {ids.dtype}")
    if (ids < 0).any() or (ids > np.iinfo(np.int32).max).any():
        row = int(np.argwhere((ids < 0) | (ids > np.iinfo(np.int32).max))[0][0])
        raise ValueError(f"batch: {key} of row {row} is outside [0, 2^31)")
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


def lay_out_global_batch(
    arrays: Mapping[str, np.ndarray],
    world_size: int,
    accum_steps: int,
    *,
    vocab_size: int,
    weights_dtype: np.dtype | type | str | None = None,
    num_groups: int | None = None,
    num_documents: int | None = None,
) -> Batch:
    """Validate a global batch and its optional v2 fields; reshape to [R, M, B(, T)].

    `arrays` holds ``inputs``, ``targets``, ``segment_ids``, ``weights`` ([N, T]) and
    optionally ``group_ids`` [N], ``document_ids`` [N, T], ``row_weights`` [N] and
    ``sample_mask`` [N] (defaults in the module docstring). Errors name the array,
    [row, position], and the rank and microbatch holding that row. A token with a loss must
    have a nonzero document id; row weights must be finite; the sample mask 0 or 1.

    The token weights are cast to `weights_dtype`; by default the denominator dtype (float64
    under ``jax_enable_x64``, else float32), which is where the steps read them whatever the
    params' dtype (`jax_impl.denominators`). A float dtype narrower than float32 (bfloat16,
    float16) is refused: it would round every w_t, and with them weighted_mean's D. Row
    weights are laid out in the denominator dtype (any sign).

    `num_groups` / `num_documents` (default: the largest id + 1) may be set larger, so that
    batches with different ids share one compiled step (they are static shapes).
    """
    if weights_dtype is None:
        weights_dtype = denominator_dtype()
    check_weights_dtype(weights_dtype)
    token_arrays = _check_structure(arrays)
    num_rows, seq_len = token_arrays["targets"].shape
    B = rows_per_microbatch(num_rows, world_size, accum_steps)
    # All on the host, before anything is traced or placed: in a multi-process run every
    # process validates the whole global batch, so every process names the same bad token.
    _check_values(token_arrays, vocab_size, (B, accum_steps))
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
            f"batch: document_ids[{row}, {pos}] = {int(document_ids[row, pos])} with "
            f"segment id {int(arrays['segment_ids'][row, pos])}: document 0 is padding, "
            "exactly where segment 0 is"
        )
    row_weights = np.asarray(arrays.get("row_weights", np.ones(num_rows)))
    if row_weights.shape != (num_rows,) or not np.isfinite(row_weights).all():
        raise ValueError(
            f"batch: row_weights must be {num_rows} finite numbers, got shape {row_weights.shape}"
        )
    sample_mask = np.asarray(arrays.get("sample_mask", np.ones(num_rows, np.int32)))
    if sample_mask.shape != (num_rows,) or not np.isin(sample_mask, (0, 1)).all():
        raise ValueError(f"batch: sample_mask must be {num_rows} values of 0 or 1")
    rows = (world_size, accum_steps, B)
    shape = (*rows, seq_len)
    return Batch(
        inputs=token_arrays["inputs"].astype(np.int32).reshape(shape),
        targets=token_arrays["targets"].astype(np.int32).reshape(shape),
        segment_ids=token_arrays["segment_ids"].astype(np.int32).reshape(shape),
        # jnp.dtype: numpy alone does not know dtype names such as "bfloat16".
        weights=token_arrays["weights"].astype(jnp.dtype(weights_dtype)).reshape(shape),
        group_ids=group_ids.reshape(rows),
        document_ids=document_ids.reshape(shape),
        row_weights=row_weights.astype(np.dtype(denominator_dtype().name)).reshape(rows),
        sample_mask=sample_mask.astype(np.int32).reshape(rows),
        num_groups=_id_space("num_groups", int(group_ids.max()) + 1, num_groups),
        num_documents=_id_space("num_documents", int(document_ids.max()) + 1, num_documents),
    )


def _id_space(key: str, needed: int, given: int | None) -> int:
    if given is None:
        return needed
    if given < needed:
        raise ValueError(f"batch: {key} = {given} but the ids need {needed}")
    return int(given)


def rank_slice(batch: Batch, rank: int, count: int = 1) -> Batch:
    """Ranks rank .. rank + count - 1's [count, M, ...] block (what one process of a
    multi-process run places: the ranks of its devices)."""
    world_size = np.shape(batch.targets)[0]
    if count < 1 or rank < 0 or rank + count > world_size:
        raise ValueError(f"ranks {rank} to {rank + count - 1} are outside [0, {world_size})")
    return jax.tree.map(lambda x: np.asarray(x)[rank : rank + count], batch)
