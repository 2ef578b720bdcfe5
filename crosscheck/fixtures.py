"""The Fixture type: one global batch plus the analytic model's params, and its .npz form.

A fixture is what every implementation runs on: `inputs`, `targets` (IGNORE_INDEX = -100 for
tokens without a loss), `segment_ids` (packed documents; 0 = padding) and `weights` (soft
per-token weights), each [N, T]; params `embed` [V, H] and `unembed` [H, V] in float64; a name
and a one-line description of the trap it sets. Construction validates everything, and an
error names the row and position of the first offending token.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from crosscheck.layout import IGNORE_INDEX, LaidOutBatch, Layout, lay_out

#: The exact keys of a fixture .npz: the batch, then the params.
NPZ_KEYS: tuple[str, ...] = ("inputs", "targets", "segment_ids", "weights", "embed", "unembed")
BATCH_KEYS: tuple[str, ...] = NPZ_KEYS[:4]
PARAM_KEYS: tuple[str, ...] = NPZ_KEYS[4:]


class FixtureError(ValueError):
    """A fixture that breaks the contract; the message names the fixture, row and position."""


def _first_position(mask: np.ndarray) -> tuple[int, int]:
    row, pos = np.argwhere(mask)[0]
    return int(row), int(pos)


@dataclass(frozen=True, eq=False)
class Fixture:
    """A global batch [N, T] and float64 params of the bilinear model (see docs/contract.md)."""

    name: str
    description: str
    inputs: np.ndarray
    targets: np.ndarray
    segment_ids: np.ndarray
    weights: np.ndarray
    embed: np.ndarray
    unembed: np.ndarray

    def __post_init__(self) -> None:
        # Own read-only copies: no implementation under test can change the shared batch.
        for key in NPZ_KEYS:
            array = np.array(getattr(self, key), copy=True)
            array.setflags(write=False)
            object.__setattr__(self, key, array)
        self._validate()

    @property
    def num_rows(self) -> int:
        return int(self.targets.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.targets.shape[1])

    @property
    def vocab_size(self) -> int:
        return int(self.embed.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.embed.shape[1])

    @property
    def valid(self) -> np.ndarray:
        return self.targets != IGNORE_INDEX

    @property
    def num_valid_tokens(self) -> int:
        return int(np.count_nonzero(self.valid))

    def params(self) -> dict[str, np.ndarray]:
        """Fresh float64 copies of the params, keyed by the names every model uses."""
        return {"embed": self.embed.copy(), "unembed": self.unembed.copy()}

    def layout(self, world_size: int, accum_steps: int) -> LaidOutBatch:
        """The batch split over `world_size` ranks x `accum_steps` microbatches ([R, M, B, T])."""
        return lay_out(
            self.inputs,
            self.targets,
            self.segment_ids,
            self.weights,
            Layout(world_size, accum_steps),
        )

    def valid_layouts(
        self, max_world_size: int = 8, max_accum_steps: int = 4
    ) -> list[tuple[int, int]]:
        """Every (R, M) within the bounds for which N is divisible by R * M."""
        return [
            (R, M)
            for R in range(1, max_world_size + 1)
            for M in range(1, max_accum_steps + 1)
            if self.num_rows % (R * M) == 0
        ]

    def save(self, path: str | Path) -> Path:
        """Write the six arrays (and nothing else) to an uncompressed .npz."""
        path = Path(path)
        np.savez(path, **{key: getattr(self, key) for key in NPZ_KEYS})
        return path if path.suffix == ".npz" else path.with_name(path.name + ".npz")

    @classmethod
    def load(cls, path: str | Path, name: str | None = None, description: str = "") -> Fixture:
        """Read a fixture .npz; its name defaults to the file's stem."""
        path = Path(path)
        with np.load(path, allow_pickle=False) as archive:
            keys = set(archive.files)
            if keys != set(NPZ_KEYS):
                raise FixtureError(
                    f"{path}: a fixture .npz holds exactly {list(NPZ_KEYS)}; "
                    f"missing {sorted(set(NPZ_KEYS) - keys)}, extra {sorted(keys - set(NPZ_KEYS))}"
                )
            arrays = {key: archive[key] for key in NPZ_KEYS}
        return cls(name=name or path.stem, description=description, **arrays)

    def _fail(self, message: str) -> None:
        raise FixtureError(f"fixture {self.name!r}: {message}")

    def _validate(self) -> None:
        shape = self.targets.shape
        if len(shape) != 2 or shape[0] < 1 or shape[1] < 1:
            self._fail(f"targets must be [N, T] with N, T >= 1, got shape {shape}")
        for key in BATCH_KEYS:
            array = getattr(self, key)
            if array.shape != shape:
                self._fail(f"{key} has shape {array.shape}, targets have {shape}")
        for key in ("inputs", "targets", "segment_ids"):
            if not np.issubdtype(getattr(self, key).dtype, np.integer):
                self._fail(f"{key} must be integers, got {getattr(self, key).dtype}")
        for key in PARAM_KEYS:
            if getattr(self, key).dtype != np.float64 or getattr(self, key).ndim != 2:
                self._fail(f"{key} must be a 2-D float64 array, got {getattr(self, key).dtype}")
        V, H = self.embed.shape
        if self.unembed.shape != (H, V):
            self._fail(f"unembed must be [H, V] = {(H, V)}, got {self.unembed.shape}")
        for key in PARAM_KEYS:
            if not np.isfinite(getattr(self, key)).all():
                self._fail(f"{key} holds a non-finite value")
        self._validate_tokens(V)

    def _validate_tokens(self, V: int) -> None:
        bad = (self.inputs < 0) | (self.inputs >= V)
        if bad.any():
            row, pos = _first_position(bad)
            self._fail(
                f"input token {int(self.inputs[row, pos])} at row {row}, position {pos} "
                f"is outside the vocabulary [0, {V})"
            )
        valid = self.valid
        bad = valid & ((self.targets < 0) | (self.targets >= V))
        if bad.any():
            row, pos = _first_position(bad)
            self._fail(
                f"target {int(self.targets[row, pos])} at row {row}, position {pos} is "
                f"neither {IGNORE_INDEX} (ignored) nor in the vocabulary [0, {V})"
            )
        bad = self.segment_ids < 0
        if bad.any():
            row, pos = _first_position(bad)
            self._fail(f"negative segment id at row {row}, position {pos}")
        bad = valid & (self.segment_ids == 0)
        if bad.any():
            row, pos = _first_position(bad)
            self._fail(
                f"valid target at row {row}, position {pos} lies in segment 0 (padding); "
                f"padding must carry target {IGNORE_INDEX}"
            )
        bad = ~np.isfinite(self.weights) | (self.weights < 0)
        if bad.any():
            row, pos = _first_position(bad)
            self._fail(
                f"weight {float(self.weights[row, pos])} at row {row}, position {pos} must be "
                f"finite and >= 0"
            )
