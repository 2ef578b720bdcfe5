"""Host-side checks of a global batch and its split into ranks and accumulation microbatches.

A global batch is four [N, T] arrays. Layout (R, M) gives rank r the rows [r N/R, (r+1) N/R)
and splits them again into M equal microbatches: a reshape of the row axis to (R, M, B) with
B = N / (R M). Everything here runs on concrete numpy arrays before any tracing, so a bad
input fails with an error naming the array, row and position instead of a silent NaN.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np

from jax_impl.denominators import check_weights_dtype, denominator_dtype
from jax_impl.losses import Microbatch
from jax_impl.schemes import IGNORE_INDEX

BATCH_KEYS: tuple[str, ...] = ("inputs", "targets", "segment_ids", "weights")


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


def lay_out_global_batch(
    batch: Mapping[str, np.ndarray],
    world_size: int,
    accum_steps: int,
    *,
    vocab_size: int,
    weights_dtype: np.dtype | type | str | None = None,
) -> Microbatch:
    """Validate a global batch and reshape each array to [R, M, B, T] (int32 token ids).

    Errors name the array, [row, position], and the rank and microbatch holding that row.

    The weights are cast to `weights_dtype`; by default the denominator dtype (float64 under
    ``jax_enable_x64``, else float32), which is where the steps read them whatever the
    params' dtype (`jax_impl.denominators`). A float dtype narrower than float32 (bfloat16,
    float16) is refused: it would round every w_t, and with them weighted_mean's D.
    """
    if weights_dtype is None:
        weights_dtype = denominator_dtype()
    check_weights_dtype(weights_dtype)
    arrays = _check_structure(batch)
    num_rows, seq_len = arrays["targets"].shape
    B = rows_per_microbatch(num_rows, world_size, accum_steps)
    # All on the host, before anything is traced or placed: in a multi-process run every
    # process validates the whole global batch, so every process names the same bad token.
    _check_values(arrays, vocab_size, (B, accum_steps))
    shape = (world_size, accum_steps, B, seq_len)
    return Microbatch(
        inputs=arrays["inputs"].astype(np.int32).reshape(shape),
        targets=arrays["targets"].astype(np.int32).reshape(shape),
        segment_ids=arrays["segment_ids"].astype(np.int32).reshape(shape),
        # jnp.dtype: numpy alone does not know dtype names such as "bfloat16".
        weights=arrays["weights"].astype(jnp.dtype(weights_dtype)).reshape(shape),
    )


def rank_slice(laid_out: Microbatch, rank: int, count: int = 1) -> Microbatch:
    """Ranks rank .. rank + count - 1's [count, M, B, T] block of an [R, M, B, T] batch (a
    multi-process shard: the ranks of one process's devices)."""
    world_size = np.shape(laid_out.targets)[0]
    if count < 1 or rank < 0 or rank + count > world_size:
        raise ValueError(f"ranks {rank} to {rank + count - 1} are outside [0, {world_size})")
    return Microbatch(*(np.asarray(x)[rank : rank + count] for x in laid_out))
