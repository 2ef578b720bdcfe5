"""Microbatches as torch tensors, the contiguous (R, M) split, and input validation.

A global batch is four [N, T] arrays: ``inputs``, ``targets`` (IGNORE_INDEX = -100 where a
token has no loss), ``segment_ids`` (packed documents; 0 = padding) and ``weights`` (soft
per-token weights). Under a layout (R, M) rank r holds rows [r N/R, (r+1) N/R), split again into
M equal microbatches of B = N / (R M) rows. Validation errors name the rank, the microbatch,
and the row (within the microbatch and in the global batch) and position of the first bad token;
wrong keys, shapes and dtypes are refused with the array's name before anything is split.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np
import torch

IGNORE_INDEX = -100
"""Target of a token without a loss: the default ``ignore_index`` of ``F.cross_entropy``."""

BATCH_KEYS: tuple[str, ...] = ("inputs", "targets", "segment_ids", "weights")
#: Contract v2's optional per-row / per-token fields (docs/schemes-as-data.md): ``group_ids``
#: [N] int (a row's prompt group), ``document_ids`` [N, T] int (0 = padding; a document may
#: continue across rows), ``row_weights`` [N] float (any sign), ``sample_mask`` [N] 0/1.
ROW_KEYS: tuple[str, ...] = ("group_ids", "row_weights", "sample_mask")
OPTIONAL_KEYS: tuple[str, ...] = ("group_ids", "document_ids", "row_weights", "sample_mask")


class BatchError(ValueError):
    """A microbatch that breaks the contract; the message says where."""


#: Token ids and segment ids: any integer dtype (bool is refused: a mask is not an id).
_ID_DTYPES = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})


def _tensor_not_ids(key: str, tensor: torch.Tensor) -> str | None:
    """Why `tensor` cannot hold ids, or None when its dtype is an integer one."""
    if tensor.dtype in _ID_DTYPES:
        return None
    if tensor.is_floating_point():
        whole = torch.isfinite(tensor) & (tensor == torch.round(tensor))
        if bool(whole.all()):
            return (
                f"{key} must be an integer tensor, got {tensor.dtype} holding whole numbers: "
                "convert it with .long()"
            )
        return f"{key} must be an integer tensor, got {tensor.dtype} with non-integer values"
    return f"{key} must be an integer tensor, got {tensor.dtype}"


def _array_not_ids(key: str, array: np.ndarray) -> str | None:
    """Why a numpy `array` cannot hold ids, or None when its dtype is an integer one."""
    if np.issubdtype(array.dtype, np.integer):
        return None
    if np.issubdtype(array.dtype, np.floating):
        whole = np.isfinite(array) & (array == np.round(array))
        if whole.all():
            return (
                f"{key} must be integers, got {array.dtype} holding whole numbers: cast it "
                "with .astype(np.int64)"
            )
        row, pos = (int(i) for i in np.argwhere(~whole)[0])
        return (
            f"{key} must be integers, got {array.dtype} with the non-integer value "
            f"{float(array[row, pos])!r} at global row {row}, position {pos}"
        )
    return f"{key} must be integers, got {array.dtype}"


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
    #: Contract v2's optional fields (None: the doc's default, see ``torch_impl.spec_counts``).
    group_ids: torch.Tensor | None = None  # [B] integer
    document_ids: torch.Tensor | None = None  # [B, T] integer, 0 = padding
    row_weights: torch.Tensor | None = None  # [B] float, any sign
    sample_mask: torch.Tensor | None = None  # [B] 0/1
    #: Context parallel: this microbatch holds context rank `context_rank`'s positions of its
    #: rows, of `context_size` ranks (`context_microbatches`); 0 of 1 for whole rows.
    context_rank: int = 0
    context_size: int = 1
    #: [B, T] y'_t (the next target in the segment) taken on whole rows, before the context
    #: split: a shard cannot shift its own targets across its edge (`context_microbatches`).
    #: None: computed from `targets` where needed (whole rows).
    mtp_targets: torch.Tensor | None = None

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
            problem = _tensor_not_ids(key, getattr(self, key))
            if problem is not None:
                raise BatchError(f"{self.where}: {problem}")
        if not self.weights.is_floating_point():
            raise BatchError(
                f"{self.where}: weights must be a floating-point tensor (soft per-token "
                f"weights), got {self.weights.dtype}"
            )
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
        self._check(
            self.segment_ids < 0,
            lambda r, t: f"segment id {int(self.segment_ids[r, t])} is negative",
        )
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
        self._validate_optional()
        return self

    def _validate_optional(self) -> None:
        """The optional v2 fields, when present: shapes, dtypes, then values."""
        rows = self.targets.shape[:1]
        for key in OPTIONAL_KEYS:
            value = getattr(self, key)
            want = self.targets.shape if key == "document_ids" else rows
            if value is not None and value.shape != want:
                raise BatchError(
                    f"{self.where}: {key} has shape {tuple(value.shape)}, expected {tuple(want)}"
                )
        for key in ("group_ids", "document_ids"):
            value = getattr(self, key)
            problem = None if value is None else _tensor_not_ids(key, value)
            if problem is not None:
                raise BatchError(f"{self.where}: {problem}")
        if self.group_ids is not None:
            self._check(
                (self.group_ids < 0)[:, None].expand_as(self.targets),
                lambda r, t: f"group id {int(self.group_ids[r])} is negative",
            )
        if self.document_ids is not None:
            self._check(
                self.document_ids < 0,
                lambda r, t: f"document id {int(self.document_ids[r, t])} is negative",
            )
            self._check(
                self.valid & (self.document_ids == 0),
                lambda r, t: "valid target in document 0 (padding)",
            )
        if self.row_weights is not None:
            if not self.row_weights.is_floating_point():
                raise BatchError(f"{self.where}: row_weights must be floating point")
            self._check(
                (~torch.isfinite(self.row_weights))[:, None].expand_as(self.targets),
                lambda r, t: f"row weight {float(self.row_weights[r])!r} must be finite",
            )
        if self.sample_mask is not None:
            self._check(
                ((self.sample_mask != 0) & (self.sample_mask != 1))[:, None].expand_as(
                    self.targets
                ),
                lambda r, t: f"sample_mask {float(self.sample_mask[r])!r} must be 0 or 1",
            )

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
    ``torch.tensor`` copies each slice (fixture arrays are read-only numpy arrays). Keys, shapes
    and dtypes of the whole batch are checked first (BatchError naming the array); the token
    values of each microbatch are checked by `TokenBatch.validate`, with their position.
    """
    arrays = _checked_arrays(batch)
    num_rows = int(arrays["targets"].shape[0])
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
    rows = num_rows // (world_size * accum_steps)
    out = []
    for step in range(accum_steps):
        start = (rank * accum_steps + step) * rows
        part = {key: array[start : start + rows] for key, array in arrays.items()}
        optional = {
            key: torch.tensor(part[key], dtype=_OPTIONAL_DTYPES[key])
            for key in OPTIONAL_KEYS
            if key in part
        }
        out.append(
            TokenBatch(
                inputs=torch.tensor(part["inputs"], dtype=torch.long),
                targets=torch.tensor(part["targets"], dtype=torch.long),
                segment_ids=torch.tensor(part["segment_ids"], dtype=torch.long),
                weights=torch.tensor(part["weights"], dtype=torch.float64),
                rank=rank,
                microbatch=step,
                first_row=start,
                **optional,
            )
        )
    return out


CONTEXT_ORDERS: tuple[str, ...] = ("contiguous", "zigzag")


def context_positions(
    seq_len: int, context_size: int, order: str = "contiguous"
) -> list[list[int]]:
    """The positions of a row each of C context ranks holds, in increasing order.

    ``contiguous``: rank c holds [c T/C, (c+1) T/C). ``zigzag`` (Megatron-LM's and
    torchtitan's load balance under causal attention): the row cut into 2C chunks of
    T/(2C), rank c holding chunks c and 2C - 1 - c.
    """
    if order not in CONTEXT_ORDERS:
        raise BatchError(f"context order must be one of {', '.join(CONTEXT_ORDERS)}, got {order!r}")
    chunks = context_size * (2 if order == "zigzag" else 1)
    if context_size < 1 or seq_len % chunks:
        raise BatchError(
            f"rows of {seq_len} positions cannot be split over {context_size} context ranks "
            f"({order}): {seq_len} is not divisible by {chunks}"
        )
    width = seq_len // chunks
    held: list[list[int]] = [[] for _ in range(context_size)]
    for chunk in range(chunks):
        rank = chunk if chunk < context_size else chunks - 1 - chunk
        held[rank].extend(range(chunk * width, (chunk + 1) * width))
    return [sorted(positions) for positions in held]


def context_microbatches(
    batch: Mapping[str, np.ndarray],
    process: int,
    world_size: int,
    context_size: int,
    accum_steps: int,
    order: str = "contiguous",
) -> list[TokenBatch]:
    """Process `process`'s M microbatches under context parallel: data-parallel rank
    r = process // C's rows (`rank_microbatches`) at context rank c = process % C's
    positions (`context_positions`), [B, T/C] each; `rank` is the process."""
    if not 0 <= process < world_size * context_size:
        raise BatchError(
            f"process {process} is not one of world_size={world_size} x context_size={context_size}"
        )
    rank, context_rank = divmod(process, context_size)
    seq_len = int(np.shape(batch["targets"])[1])
    positions = torch.tensor(context_positions(seq_len, context_size, order)[context_rank])
    token_keys = (*BATCH_KEYS, "document_ids", "mtp_targets")
    return [
        mb._replace(
            **{
                key: getattr(mb, key)[:, positions]
                for key in token_keys
                if getattr(mb, key) is not None
            },
            rank=process,
            context_rank=context_rank,
            context_size=context_size,
        )
        for mb in (
            whole._replace(mtp_targets=shifted_targets(whole.targets, whole.segment_ids))
            for whole in rank_microbatches(batch, rank, world_size, accum_steps)
        )
    ]


def shifted_targets(targets: torch.Tensor, segment_ids: torch.Tensor) -> torch.Tensor:
    """y'_t = y_{t+1} where t + 1 < T and segment t + 1 is segment t, else IGNORE_INDEX: the
    targets of a multi-token-prediction head, on whole rows [B, T]."""
    same = segment_ids[:, 1:] == segment_ids[:, :-1]
    shifted = torch.full_like(targets, IGNORE_INDEX)
    shifted[:, :-1] = torch.where(same, targets[:, 1:], IGNORE_INDEX)
    return shifted


_OPTIONAL_DTYPES = {
    "group_ids": torch.long,
    "document_ids": torch.long,
    "row_weights": torch.float64,
    "sample_mask": torch.float64,
}


def _checked_arrays(batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The four global arrays, refused by name when a key is missing or a shape or dtype is
    wrong: a silent cast (float ids to long, integer weights to float64) would hide the slip,
    and a mismatched shape would only fail later, per microbatch, on the wrong message."""
    missing = [key for key in BATCH_KEYS if key not in batch]
    if missing:
        raise BatchError(f"the batch is missing {missing}; a batch holds {list(BATCH_KEYS)}")
    arrays = {key: np.asarray(batch[key]) for key in BATCH_KEYS}
    shape = arrays["targets"].shape
    if len(shape) != 2:
        raise BatchError(f"targets must be [N, T], got shape {shape}")
    for key, array in arrays.items():
        if array.shape != shape:
            raise BatchError(f"{key} has shape {array.shape}, targets have {shape}")
    for key in ("inputs", "targets", "segment_ids"):
        problem = _array_not_ids(key, arrays[key])
        if problem is not None:
            raise BatchError(problem)
    if not np.issubdtype(arrays["weights"].dtype, np.floating):
        raise BatchError(
            f"weights must be floating point (soft per-token weights), got "
            f"{arrays['weights'].dtype}; cast it with .astype(np.float64)"
        )
    for key in OPTIONAL_KEYS:
        if batch.get(key) is None:
            continue
        array = np.asarray(batch[key])
        want = shape if key == "document_ids" else shape[:1]
        if array.shape != want:
            raise BatchError(f"{key} has shape {array.shape}, expected {want}")
        if key in ("group_ids", "document_ids"):
            if not np.issubdtype(array.dtype, np.integer):
                raise BatchError(f"{key} must be integers, got {array.dtype}")
        elif not (np.issubdtype(array.dtype, np.number) or array.dtype == np.bool_):
            raise BatchError(f"{key} must be numbers, got {array.dtype}")
        arrays[key] = array
    return arrays
