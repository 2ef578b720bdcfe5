"""How one global batch is laid out over R ranks and M accumulation microbatches.

A layout (R, M) splits the N rows of a global batch contiguously: rank r gets rows
[r N/R, (r+1) N/R), and those are split again into M equal microbatches. That is exactly a
reshape of the row axis from N to (R, M, B) with B = N / (R M), so every [N, T] array of a
fixture becomes [R, M, B, T] and the global token order is preserved.

Context parallel (docs/contract.md#context-parallel): a layout may also split every row's T
positions over C context-parallel ranks, so that data-parallel rank r and context rank c
form process r C + c of R C. ``contiguous`` gives context rank c the positions
[c T/C, (c+1) T/C); ``zigzag`` (the load-balanced order of Megatron-LM and torchtitan) cuts
the row into 2C chunks of T/(2C) and gives context rank c chunks c and 2C - 1 - c, so that
every rank holds as many early (cheap under causal attention) as late positions. The arrays
stay [R, M, B, T]; `Layout.context_ranks` says which context rank holds each position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

IGNORE_INDEX = -100
"""Target value that marks a token without a loss (the torch / Hugging Face convention)."""


CONTEXT_ORDERS: tuple[str, ...] = ("contiguous", "zigzag")


@dataclass(frozen=True, slots=True, order=True)
class Layout:
    """R ranks (data-parallel world size) times M accumulation microbatches per update, and C
    context-parallel ranks splitting every row's positions in `context_order`."""

    world_size: int
    accum_steps: int
    context_size: int = 1
    context_order: str = "contiguous"

    def __post_init__(self) -> None:
        if self.context_order not in CONTEXT_ORDERS:
            raise ValueError(
                f"layout context_order must be one of {', '.join(CONTEXT_ORDERS)}, "
                f"got {self.context_order!r}"
            )
        if isinstance(self.context_size, bool) or not isinstance(
            self.context_size, int | np.integer
        ):
            raise ValueError(f"layout context_size must be an integer, got {self.context_size!r}")
        if self.context_size < 1:
            raise ValueError(f"layout needs context_size >= 1, got {self.context_size}")
        for name in ("world_size", "accum_steps"):
            value = getattr(self, name)
            # bool is an int, and 2.0 would reshape to a float shape: both are slips.
            if isinstance(value, bool) or not isinstance(value, int | np.integer):
                raise ValueError(f"layout {name} must be an integer, got {value!r}")
        if self.world_size < 1 or self.accum_steps < 1:
            raise ValueError(
                f"layout needs world_size >= 1 and accum_steps >= 1, "
                f"got world_size={self.world_size}, accum_steps={self.accum_steps}"
            )

    @property
    def num_microbatches(self) -> int:
        """R * M: microbatches in one optimizer update, over all ranks."""
        return self.world_size * self.accum_steps

    @property
    def chunks(self) -> int:
        """How many equal chunks a row's positions are cut into: C, or 2 C for zigzag."""
        return self.context_size * (2 if self.context_order == "zigzag" else 1)

    def splits(self, seq_len: int) -> bool:
        """Whether T positions cut into `chunks` equal chunks."""
        return seq_len % self.chunks == 0

    def context_ranks(self, seq_len: int) -> np.ndarray:
        """[T] int: the context rank holding each position (module docstring)."""
        if not self.splits(seq_len):
            raise ValueError(
                f"rows of {seq_len} positions cannot be split over context_size="
                f"{self.context_size} ({self.context_order}): {seq_len} is not divisible by "
                f"{self.chunks}"
            )
        chunk = np.arange(seq_len) // (seq_len // self.chunks)
        if self.context_order == "zigzag":
            chunk = np.minimum(chunk, self.chunks - 1 - chunk)
        return chunk

    def divides(self, num_rows: int) -> bool:
        """Whether N rows lay out over this layout: N divisible by R M (the one place the
        rule is written; `crosscheck.contract.fixture.Fixture.fits` asks it)."""
        return num_rows % self.num_microbatches == 0

    def rows_per_microbatch(self, num_rows: int) -> int:
        """B = N / (R M); raises when N is not divisible by R M."""
        if not self.divides(num_rows):
            raise ValueError(
                f"a global batch of {num_rows} rows cannot be laid out over "
                f"world_size={self.world_size} x accum_steps={self.accum_steps}: "
                f"{num_rows} is not divisible by {self.num_microbatches}"
            )
        return num_rows // self.num_microbatches

    def spelled(self) -> str:
        """The layout in words, as messages name a case: ``R=2 M=2`` (``R=2 M=2 C=2 zigzag``)."""
        context = f" C={self.context_size} {self.context_order}" if self.context_size > 1 else ""
        return f"R={self.world_size} M={self.accum_steps}{context}"

    def __str__(self) -> str:
        text = f"R={self.world_size},M={self.accum_steps}"
        if self.context_size > 1:
            text += f",C={self.context_size}" + ("z" if self.context_order == "zigzag" else "")
        return text


class Microbatch(NamedTuple):
    """One microbatch of one rank: token arrays are [B, T], row arrays [B].

    The row arrays and `document_ids` are contract v2's (docs/schemes-as-data.md); a
    microbatch built by hand may leave them None, and only a v2 scheme spec reads them.
    """

    inputs: np.ndarray
    targets: np.ndarray
    segment_ids: np.ndarray
    weights: np.ndarray
    group_ids: np.ndarray | None = None
    document_ids: np.ndarray | None = None
    row_weights: np.ndarray | None = None
    sample_mask: np.ndarray | None = None

    @property
    def valid(self) -> np.ndarray:
        """v_t: 1 where the target carries a loss, 0 where it is IGNORE_INDEX."""
        return self.targets != IGNORE_INDEX


class LaidOutBatch(NamedTuple):
    """A global batch reshaped to [R, M, B, T] per token array ([R, M, B] per row array).

    The four contract-v2 fields (`group_ids`, `document_ids`, `row_weights`, `sample_mask`)
    are None only for a batch laid out without them; `Fixture.layout` always fills them.
    """

    layout: Layout
    inputs: np.ndarray
    targets: np.ndarray
    segment_ids: np.ndarray
    weights: np.ndarray
    group_ids: np.ndarray | None = None
    document_ids: np.ndarray | None = None
    row_weights: np.ndarray | None = None
    sample_mask: np.ndarray | None = None

    def microbatch(self, rank: int, step: int) -> Microbatch:
        """The microbatch that rank `rank` processes at accumulation step `step`."""
        return Microbatch(
            *(
                None if array is None else array[rank, step]
                for array in (
                    self.inputs,
                    self.targets,
                    self.segment_ids,
                    self.weights,
                    self.group_ids,
                    self.document_ids,
                    self.row_weights,
                    self.sample_mask,
                )
            )
        )

    def microbatches(self) -> list[tuple[int, int, Microbatch]]:
        """Every (rank, step, microbatch) of the update, rank-major."""
        R, M = self.layout.world_size, self.layout.accum_steps
        return [(r, m, self.microbatch(r, m)) for r in range(R) for m in range(M)]

    @property
    def valid(self) -> np.ndarray:
        return self.targets != IGNORE_INDEX

    def to_global(self, per_token: np.ndarray) -> np.ndarray:
        """Reshape a [R, M, B, T] per-token array back to the global [N, T] order."""
        R, M, B, T = per_token.shape
        return per_token.reshape(R * M * B, T)


def lay_out(
    inputs: np.ndarray,
    targets: np.ndarray,
    segment_ids: np.ndarray,
    weights: np.ndarray,
    layout: Layout,
    *,
    group_ids: np.ndarray | None = None,
    document_ids: np.ndarray | None = None,
    row_weights: np.ndarray | None = None,
    sample_mask: np.ndarray | None = None,
) -> LaidOutBatch:
    """Split [N, T] arrays contiguously into [R, M, B, T] and [N] arrays into [R, M, B].

    The token arrays must share one [N, T] shape and the row arrays be [N] (checked here,
    naming the array: a reshape of a mismatched array would fail with numpy's own message
    or, worse, succeed with rows from the wrong place); token values are the fixture's to
    validate (`Fixture`). No copy.
    """
    arrays = {
        "inputs": np.asarray(inputs),
        "targets": np.asarray(targets),
        "segment_ids": np.asarray(segment_ids),
        "weights": np.asarray(weights),
    }
    if document_ids is not None:
        arrays["document_ids"] = np.asarray(document_ids)
    rows = {
        key: np.asarray(value)
        for key, value in (
            ("group_ids", group_ids),
            ("row_weights", row_weights),
            ("sample_mask", sample_mask),
        )
        if value is not None
    }
    shape = arrays["targets"].shape
    if len(shape) != 2:
        raise ValueError(f"lay_out: targets must be [N, T], got shape {shape}")
    for key, array in arrays.items():
        if array.shape != shape:
            raise ValueError(f"lay_out: {key} has shape {array.shape}, targets have {shape}")
    N, T = shape
    for key, array in rows.items():
        if array.shape != (N,):
            raise ValueError(f"lay_out: {key} has shape {array.shape}, a row array is [{N}]")
    B = layout.rows_per_microbatch(N)
    layout.context_ranks(T)  # C must split the positions: raises saying so
    new_shape = (layout.world_size, layout.accum_steps, B, T)
    laid = {key: array.reshape(new_shape) for key, array in arrays.items()}
    laid.update({key: array.reshape(new_shape[:3]) for key, array in rows.items()})
    return LaidOutBatch(layout, **laid)
