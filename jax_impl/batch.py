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


def _first(mask: np.ndarray) -> tuple[int, ...]:
    return tuple(int(i) for i in np.argwhere(mask)[0])


def validate_global_batch(batch: Mapping[str, np.ndarray], vocab_size: int) -> None:
    """Raise ValueError naming the first offending array and [row, position]."""
    missing = [key for key in BATCH_KEYS if key not in batch]
    if missing:
        raise ValueError(f"batch is missing {missing}; a batch holds {list(BATCH_KEYS)}")
    shape = np.shape(batch["targets"])
    if len(shape) != 2:
        raise ValueError(f"batch: targets must be [N, T], got shape {shape}")
    for key in BATCH_KEYS:
        if np.shape(batch[key]) != shape:
            raise ValueError(f"batch: {key} has shape {np.shape(batch[key])}, targets {shape}")
    for key in ("inputs", "targets", "segment_ids"):
        if not np.issubdtype(np.asarray(batch[key]).dtype, np.integer):
            raise ValueError(f"batch: {key} must be integers, got {np.asarray(batch[key]).dtype}")
    inputs, targets = np.asarray(batch["inputs"]), np.asarray(batch["targets"])
    checks = (
        ("inputs", (inputs < 0) | (inputs >= vocab_size), f"outside [0, {vocab_size})"),
        (
            "targets",
            (targets != IGNORE_INDEX) & ((targets < 0) | (targets >= vocab_size)),
            f"neither {IGNORE_INDEX} nor in [0, {vocab_size})",
        ),
        ("segment_ids", np.asarray(batch["segment_ids"]) < 0, "negative"),
        (
            "weights",
            ~np.isfinite(np.asarray(batch["weights"])) | (np.asarray(batch["weights"]) < 0),
            "not finite and >= 0",
        ),
    )
    for key, bad, why in checks:
        if bad.any():
            row, pos = _first(bad)
            value = np.asarray(batch[key])[row, pos].item()
            raise ValueError(f"batch: {key}[{row}, {pos}] = {value!r} is {why}")
    padding_with_loss = (targets != IGNORE_INDEX) & (np.asarray(batch["segment_ids"]) == 0)
    if padding_with_loss.any():
        row, pos = _first(padding_with_loss)
        raise ValueError(
            f"batch: targets[{row}, {pos}] carries a loss but segment_ids[{row}, {pos}] = 0 "
            f"(padding); padding must have target {IGNORE_INDEX}"
        )


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

    The weights are cast to `weights_dtype`; by default the denominator dtype (float64 under
    ``jax_enable_x64``, else float32), which is where the steps read them whatever the
    params' dtype (`jax_impl.denominators`). A float dtype narrower than float32 (bfloat16,
    float16) is refused: it would round every w_t, and with them weighted_mean's D.
    """
    if weights_dtype is None:
        weights_dtype = denominator_dtype()
    check_weights_dtype(weights_dtype)
    validate_global_batch(batch, vocab_size)
    num_rows, seq_len = np.shape(batch["targets"])
    B = rows_per_microbatch(num_rows, world_size, accum_steps)
    shape = (world_size, accum_steps, B, seq_len)
    return Microbatch(
        inputs=np.asarray(batch["inputs"], dtype=np.int32).reshape(shape),
        targets=np.asarray(batch["targets"], dtype=np.int32).reshape(shape),
        segment_ids=np.asarray(batch["segment_ids"], dtype=np.int32).reshape(shape),
        # jnp.dtype: numpy alone does not know dtype names such as "bfloat16".
        weights=np.asarray(batch["weights"], dtype=jnp.dtype(weights_dtype)).reshape(shape),
    )


def rank_slice(laid_out: Microbatch, rank: int) -> Microbatch:
    """Rank `rank`'s [1, M, B, T] block of an [R, M, B, T] batch (a multi-process shard)."""
    world_size = np.shape(laid_out.targets)[0]
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, {world_size})")
    return Microbatch(*(np.asarray(x)[rank : rank + 1] for x in laid_out))
