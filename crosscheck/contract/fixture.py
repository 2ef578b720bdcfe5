"""The Fixture type: one global batch plus the analytic model's params, and its .npz form.

A fixture is what every implementation runs on: `inputs`, `targets` (IGNORE_INDEX = -100 for
tokens without a loss), `segment_ids` (packed documents; 0 = padding) and `weights` (soft
per-token weights), each [N, T]; params `embed` [V, H] and `unembed` [H, V] in float64; a name
and a one-line description of the trap it sets. Construction validates everything, and an
error names the fixture, the array, and the row and position of the first offending token.
`Fixture.load` reads a user's .npz and says which file and what is wrong with it (unreadable
or truncated, a missing or extra key, a wrong shape, dtype or value).
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from crosscheck.contract.layout import IGNORE_INDEX, LaidOutBatch, Layout, lay_out
from crosscheck.contract.row_fields import ROW_FIELD_KEYS, check_row_fields, default_row_fields

#: The exact keys of a fixture .npz: the batch, then the params.
NPZ_KEYS: tuple[str, ...] = ("inputs", "targets", "segment_ids", "weights", "embed", "unembed")
BATCH_KEYS: tuple[str, ...] = NPZ_KEYS[:4]
PARAM_KEYS: tuple[str, ...] = NPZ_KEYS[4:]


class FixtureError(ValueError):
    """A fixture that breaks the contract; the message names the fixture, row and position.

    `reason` is the message without the fixture's name, so that `Fixture.load` can name the
    file instead.
    """

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = message if reason is None else reason


#: What np.load and reading a member raise for a file that is not a complete .npz: an empty
#: file (EOFError), a few bytes (ValueError: taken for a pickle), a cut zip (BadZipFile), a
#: damaged member (BadZipFile: bad CRC, ValueError: bad .npy header), an unreadable path.
_UNREADABLE = (OSError, EOFError, ValueError, zipfile.BadZipFile)


#: The first bytes of an .npy file, and those a zip archive (an .npz) may start with: a local
#: file header, or the end-of-directory record of an empty archive.
_NPY_MAGIC = b"\x93NUMPY"
_ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")


def _not_a_zip(head: bytes) -> str:
    """Why a file starting with `head` (neither a zip nor an .npy) is no fixture file."""
    if not head:
        return "the file is empty"
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "it is a Python pickle, and fixture files are never unpickled"
    return (
        "it does not start as an .npz (a zip archive) does; a fixture file is an .npz "
        "written by Fixture.save"
    )


def _pickled(archive: np.lib.npyio.NpzFile, key: str) -> bool:
    """Whether the member `key` of `archive` holds Python objects (an object dtype)."""
    npy_format = np.lib.format
    try:
        with archive.zip.open(f"{key}.npy") as member:
            version = npy_format.read_magic(member)
            if version == (1, 0):
                _, _, dtype = npy_format.read_array_header_1_0(member)
            else:
                _, _, dtype = npy_format.read_array_header_2_0(member)
    except (*_UNREADABLE, KeyError):  # a damaged header: not known to hold objects
        return False
    return bool(dtype.hasobject)


def _frozen_copy(value: np.ndarray) -> np.ndarray:
    array = np.array(value, copy=True)
    array.setflags(write=False)
    return array


def _first_position(mask: np.ndarray) -> tuple[int, int]:
    row, pos = np.argwhere(mask)[0]
    return int(row), int(pos)


def _not_integers(key: str, array: np.ndarray) -> str:
    """Why a 2-D `array` of a non-integer dtype cannot hold token ids or segment ids."""
    if np.issubdtype(array.dtype, np.floating):
        whole = np.isfinite(array) & (array == np.round(array))
        if whole.all():
            # The common slip: ids that went through a float array (np.full(..., -100.0), a
            # pandas column with NaNs). Say so, and how to fix it, rather than just "float".
            return (
                f"{key} must be an integer array, got {array.dtype} holding whole numbers: "
                f"cast it with .astype(np.int64)"
            )
        row, pos = _first_position(~whole)
        return (
            f"{key} must be an integer array, got {array.dtype} with the non-integer value "
            f"{float(array[row, pos])!r} at row {row}, position {pos}"
        )
    return f"{key} must be an integer array, got {array.dtype}"


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
    #: Contract v2's optional fields (`crosscheck.contract.row_fields`). After construction
    #: each holds its value, the default when it was not given; `explicit_row_fields` names
    #: the given ones, the only ones `save` writes.
    group_ids: np.ndarray | None = None
    document_ids: np.ndarray | None = None
    row_weights: np.ndarray | None = None
    sample_mask: np.ndarray | None = None

    def __post_init__(self) -> None:
        # Own read-only copies: no implementation under test can change the shared batch.
        for key in NPZ_KEYS:
            object.__setattr__(self, key, _frozen_copy(getattr(self, key)))
        self._validate()
        given = {
            k: np.asarray(getattr(self, k)) for k in ROW_FIELD_KEYS if getattr(self, k) is not None
        }
        why = check_row_fields(given, self.segment_ids)
        if why is not None:
            self._fail(why)
        object.__setattr__(self, "explicit_row_fields", tuple(given))
        values = {**default_row_fields(self.segment_ids), **given}
        for key in ROW_FIELD_KEYS:
            object.__setattr__(self, key, _frozen_copy(values[key]))

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

    def layout(
        self,
        world_size: int,
        accum_steps: int,
        context_size: int = 1,
        context_order: str = "contiguous",
    ) -> LaidOutBatch:
        """The batch split over `world_size` ranks x `accum_steps` microbatches ([R, M, B, T]),
        every row's positions over `context_size` context-parallel ranks in `context_order`."""
        return lay_out(
            self.inputs,
            self.targets,
            self.segment_ids,
            self.weights,
            Layout(world_size, accum_steps, context_size, context_order),
            **{key: getattr(self, key) for key in ROW_FIELD_KEYS},
        )

    def fits(self, world_size: int, accum_steps: int) -> bool:
        """Whether the batch lays out over `world_size` ranks x `accum_steps` microbatches."""
        return Layout(world_size, accum_steps).divides(self.num_rows)

    def valid_layouts(
        self, max_world_size: int = 8, max_accum_steps: int = 4
    ) -> list[tuple[int, int]]:
        """Every (R, M) within the bounds for which N is divisible by R * M."""
        return [
            (R, M)
            for R in range(1, max_world_size + 1)
            for M in range(1, max_accum_steps + 1)
            if self.fits(R, M)
        ]

    def npz_arrays(self) -> dict[str, np.ndarray]:
        """What `save` writes: the six v1 arrays, then the v2 fields that were given."""
        keys = (*NPZ_KEYS, *self.explicit_row_fields)
        return {key: getattr(self, key) for key in keys}

    def save(self, path: str | Path) -> Path:
        """Write `npz_arrays` (and nothing else) to an uncompressed .npz."""
        path = Path(path)
        np.savez(path, **self.npz_arrays())
        return path if path.suffix == ".npz" else path.with_name(path.name + ".npz")

    @classmethod
    def load(cls, path: str | Path, name: str | None = None, description: str = "") -> Fixture:
        """Read a fixture .npz; its name defaults to the file's stem.

        Every problem raises FixtureError naming the file: missing or unreadable (truncated,
        not an .npz), a missing or extra key, and anything the contract refuses (shape, dtype,
        a token outside the vocabulary, with its row and position).
        """
        path = Path(path)
        where = f"fixture file {path}"
        if not path.is_file():
            why = "is a directory" if path.is_dir() else "does not exist"
            raise FixtureError(f"{where} {why}; a fixture file is an .npz written by Fixture.save")
        unreadable = f"{where} is not a readable .npz (truncated, or not a fixture file): "
        # What the file is, from its first bytes, before numpy reads it: np.load takes anything
        # that is neither a zip nor an .npy for a pickle, and says so in its own words.
        try:
            with path.open("rb") as file:
                head = file.read(len(_NPY_MAGIC))
        except OSError as exc:
            raise FixtureError(f"{unreadable}{exc.strerror or exc}") from exc
        if head.startswith(_NPY_MAGIC):
            raise FixtureError(
                f"{where} holds a single array (.npy), not an .npz of {list(NPZ_KEYS)}"
            )
        if not head.startswith(_ZIP_MAGIC):
            raise FixtureError(unreadable + _not_a_zip(head))
        try:
            archive = np.load(path, allow_pickle=False)
        except _UNREADABLE as exc:
            raise FixtureError(f"{unreadable}{type(exc).__name__}: {exc}") from exc
        with archive:
            keys = set(archive.files)
            known = set(NPZ_KEYS) | set(ROW_FIELD_KEYS)
            missing, extra = sorted(set(NPZ_KEYS) - keys), sorted(keys - known)
            if missing or extra:
                raise FixtureError(
                    f"{where}: a fixture .npz holds exactly {list(NPZ_KEYS)}, and optionally "
                    f"{list(ROW_FIELD_KEYS)}; missing {missing}, extra {extra}"
                )
            arrays = {}
            for key in (*NPZ_KEYS, *(k for k in ROW_FIELD_KEYS if k in keys)):
                try:
                    arrays[key] = archive[key]
                except _UNREADABLE as exc:
                    if _pickled(archive, key):
                        raise FixtureError(
                            f"{where}: key {key!r} holds Python objects (pickled data), not "
                            "numbers; fixture files are read without unpickling anything"
                        ) from None
                    raise FixtureError(
                        f"{where}: key {key!r} cannot be read (truncated or damaged file): "
                        f"{type(exc).__name__}: {exc}"
                    ) from exc
        try:
            return cls(name=name or path.stem, description=description, **arrays)
        except FixtureError as exc:
            # Name the file, not only the fixture name it was given (its stem).
            raise FixtureError(f"{where}: {exc.reason}", reason=exc.reason) from None

    def _fail(self, message: str) -> None:
        raise FixtureError(f"fixture {self.name!r}: {message}", reason=message)

    def _validate(self) -> None:
        shape = self.targets.shape
        if len(shape) != 2 or shape[0] < 1 or shape[1] < 1:
            self._fail(f"targets must be [N, T] with N, T >= 1, got shape {shape}")
        for key in BATCH_KEYS:
            array = getattr(self, key)
            if array.shape != shape:
                self._fail(f"{key} has shape {array.shape}, targets have {shape}")
        for key in ("inputs", "targets", "segment_ids"):
            array = getattr(self, key)
            if not np.issubdtype(array.dtype, np.integer):
                self._fail(_not_integers(key, array))
        if not np.issubdtype(self.weights.dtype, np.floating):
            # Integer weights would be summed as integers by numpy and cast differently by
            # each framework; the contract's w_t are real numbers.
            self._fail(
                f"weights must be a floating-point array (soft per-token weights), got "
                f"{self.weights.dtype}; cast it with .astype(np.float64)"
            )
        for key in PARAM_KEYS:
            array = getattr(self, key)
            if array.dtype != np.float64 or array.ndim != 2:
                self._fail(
                    f"{key} must be a 2-D float64 array, got {array.dtype} of shape {array.shape}"
                )
        V, H = self.embed.shape
        if self.unembed.shape != (H, V):
            self._fail(f"unembed must be [H, V] = {(H, V)}, got {self.unembed.shape}")
        for key in PARAM_KEYS:
            bad = ~np.isfinite(getattr(self, key))
            if bad.any():
                i, j = _first_position(bad)
                self._fail(f"{key}[{i}, {j}] = {float(getattr(self, key)[i, j])!r} is not finite")
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
