"""Microbatches as torch tensors, the contiguous (R, M) split, and input validation.

A global batch is four [N, T] arrays: ``inputs``, ``targets`` (IGNORE_INDEX = -100 where a
token has no loss), ``segment_ids`` (packed documents; 0 = padding) and ``weights`` (soft
per-token weights). Under a layout (R, M) rank r holds rows [r N/R, (r+1) N/R), split again into
M equal microbatches of B = N / (R M) rows. Validation errors name the rank, the microbatch,
and the row (within the microbatch and in the global batch) and position of the first bad token.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np
import torch

IGNORE_INDEX = -100
"""Target of a token without a loss: the default ``ignore_index`` of ``F.cross_entropy``."""

BATCH_KEYS: tuple[str, ...] = ("inputs", "targets", "segment_ids", "weights")


class BatchError(ValueError):
    """A microbatch that breaks the contract; the message says where."""


class TokenBatch(NamedTuple):
    """One microbatch of one rank, each tensor [B, T]. Where it sits is kept for messages."""

    inputs: torch.Tensor
    targets: torch.Tensor
    segment_ids: torch.Tensor
    weights: torch.Tensor
    rank: int = 0
    microbatch: int = 0
    #: Global row index of this microbatch's first row (for error messages).
    first_row: int = 0

    @property
    def valid(self) -> torch.Tensor:
        """v_t: True where the target carries a loss."""
        return self.targets != IGNORE_INDEX

    @property
    def where(self) -> str:
        return f"rank {self.rank}, microbatch {self.microbatch}"

    def validate(self, vocab_size: int) -> TokenBatch:
        """Raise BatchError at the first token that breaks the contract; return self."""
        shape = self.targets.shape
        if self.targets.dim() != 2:
            raise BatchError(f"{self.where}: targets must be [B, T], got shape {tuple(shape)}")
        for key in BATCH_KEYS:
            if getattr(self, key).shape != shape:
                raise BatchError(
                    f"{self.where}: {key} has shape {tuple(getattr(self, key).shape)}, "
                    f"targets have {tuple(shape)}"
                )
        for key in ("inputs", "targets", "segment_ids"):
            if getattr(self, key).is_floating_point():
                raise BatchError(f"{self.where}: {key} must be integers")
        self._check(
            (self.inputs < 0) | (self.inputs >= vocab_size),
            lambda r, t: f"input token {int(self.inputs[r, t])} is outside [0, {vocab_size})",
        )
        self._check(
            self.valid & ((self.targets < 0) | (self.targets >= vocab_size)),
            lambda r, t: (
                f"target {int(self.targets[r, t])} is neither {IGNORE_INDEX} (ignored) "
                f"nor in the vocabulary [0, {vocab_size})"
            ),
        )
        self._check(self.segment_ids < 0, lambda r, t: "segment id is negative")
        self._check(
            self.valid & (self.segment_ids == 0),
            lambda r, t: (
                f"valid target in segment 0 (padding); padding must carry target {IGNORE_INDEX}"
            ),
        )
        self._check(
            ~torch.isfinite(self.weights) | (self.weights < 0),
            lambda r, t: f"weight {float(self.weights[r, t])!r} must be finite and >= 0",
        )
        return self

    def _check(self, bad: torch.Tensor, message: Callable[[int, int], str]) -> None:
        if bool(bad.any()):
            row, pos = (int(i) for i in torch.nonzero(bad)[0])
            raise BatchError(
                f"{self.where}, row {row} (global row {self.first_row + row}), "
                f"position {pos}: {message(row, pos)}"
            )


def rank_microbatches(
    batch: Mapping[str, np.ndarray], rank: int, world_size: int, accum_steps: int
) -> list[TokenBatch]:
    """Rank `rank`'s M microbatches of a global batch of [N, T] numpy arrays.

    Rows [r N/R, (r+1) N/R) belong to rank r, in M consecutive slices of B = N/(R M) rows.
    ``torch.tensor`` copies each slice (fixture arrays are read-only numpy arrays).
    """
    num_rows = int(np.asarray(batch["targets"]).shape[0])
    if not 0 <= rank < world_size or accum_steps < 1:
        raise BatchError(
            f"rank {rank} is not in a world of size {world_size}, or accum_steps={accum_steps} < 1"
        )
    if num_rows % (world_size * accum_steps):
        raise BatchError(
            f"a global batch of {num_rows} rows cannot be laid out over world_size={world_size} "
            f"x accum_steps={accum_steps}: {num_rows} is not divisible by "
            f"{world_size * accum_steps}"
        )
    for key in ("inputs", "targets", "segment_ids"):
        if not np.issubdtype(np.asarray(batch[key]).dtype, np.integer):
            raise BatchError(f"{key} must be integers, got {np.asarray(batch[key]).dtype}")
    rows = num_rows // (world_size * accum_steps)
    out = []
    for step in range(accum_steps):
        start = (rank * accum_steps + step) * rows
        part = {key: np.asarray(batch[key])[start : start + rows] for key in BATCH_KEYS}
        out.append(
            TokenBatch(
                inputs=torch.tensor(part["inputs"], dtype=torch.long),
                targets=torch.tensor(part["targets"], dtype=torch.long),
                segment_ids=torch.tensor(part["segment_ids"], dtype=torch.long),
                weights=torch.tensor(part["weights"], dtype=torch.float64),
                rank=rank,
                microbatch=step,
                first_row=start,
            )
        )
    return out
