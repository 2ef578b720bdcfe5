r"""Portable test vectors: the oracle's answers on every built-in fixture, as .npz files.

``python -m crosscheck export-vectors DIR`` writes what a framework in any language needs to
check its loss normalization without JAX, torch or this package:

- ``DIR/fixtures/<fixture>.npz``: the fixture's six arrays (the global batch and the params);
- ``DIR/expected/<fixture>/<scheme>/R<R>_M<M>.npz``, for every scheme (the two accidental
  ones included: they are what frameworks produce by mistake) and every layout (R, M) of the
  fixture with R <= 8, M <= 4 and R M <= 8: the objective, D, every token's effective weight
  :math:`c_t = a_t / D`, the gradient and the params after one AdamW update;
- ``DIR/manifest.json``: the format, every file and key, and the math that produced them.

For token t with input :math:`x_t` and target :math:`y_t` (ignored when -100),

.. math::

    z_t = E[x_t]\,U, \quad l_t = \operatorname{logsumexp}(z_t) - z_{t,y_t}, \quad
    L = \sum_t c_t\, l_t, \quad
    \frac{\partial L}{\partial U} = \sum_t c_t\, E[x_t]^\top e_t, \quad
    \frac{\partial L}{\partial E[x]} = \sum_{t:\,x_t = x} c_t\, U e_t,

with :math:`e_t = \operatorname{softmax}(z_t) - \operatorname{onehot}(y_t)`. Everything comes
from the float64 oracle (`crosscheck.optimizers.train`, one update, no clipping, the default
`AdamWConfig`, which is also what the harness's `TrainSettings` uses).

The export is deterministic: the .npz members are written with a fixed zip timestamp, in
sorted order, little-endian, uncompressed; the JSON has sorted keys and Python's shortest
round-trip float repr. Two exports on the same machine are byte-identical.

It never mixes itself into someone else's files: a directory that is not empty is refused
(`ExportDirectoryError`) unless ``force=True`` (``--force``), and then only the export's own
files are replaced (those the previous manifest lists and those this export writes); every
other file is left alone. Each file is written under a temporary name and renamed into place,
the manifest last, so an interrupted export leaves the old manifest or the new one, never half
of one.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import io
import json
import os
import zipfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from crosscheck.catalogue import BUILTIN_FIXTURES, builtin_fixture
from crosscheck.fixtures import NPZ_KEYS, Fixture
from crosscheck.layout import IGNORE_INDEX
from crosscheck.optimizers import AdamWConfig, train
from crosscheck.schemes import SCHEMES

FORMAT_NAME = "gradweight-test-vectors"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
#: Layouts exported: fixture.valid_layouts() (R <= 8, M <= 4, R M divides N) with R M <= 8.
MAX_MICROBATCHES = 8
#: The earliest date a zip header can hold: any fixed value makes the archive reproducible.
ZIP_DATE_TIME = (1980, 1, 1, 0, 0, 0)

#: (symbolic shape, dtype, meaning) of every key of a fixture file.
FIXTURE_KEYS: dict[str, tuple[str, str, str]] = {
    "inputs": ("[N, T]", "int32", "input token x_t, in [0, V)"),
    "targets": ("[N, T]", "int32", "target y_t in [0, V), or -100: no loss (v_t = 0)"),
    "segment_ids": ("[N, T]", "int32", "packed document of the token within its row; 0 = pad"),
    "weights": ("[N, T]", "float64", "soft per-token weight w_t >= 0 (weighted_mean only)"),
    "embed": ("[V, H]", "float64", "E, the embedding: row x is token x's vector"),
    "unembed": ("[H, V]", "float64", "U, the output projection"),
}
#: (symbolic shape, dtype, meaning) of every key of an expected-vector file.
EXPECTED_KEYS: dict[str, tuple[str, str, str]] = {
    "loss": ("[]", "float64", "L = sum_t c_t l_t (correctly rounded sum)"),
    "denominator": ("[]", "float64", "D of the scheme at this layout (see schemes)"),
    "token_weights": ("[N, T]", "float64", "c_t = a_t / D, every token's effective weight"),
    "grad_embed": ("[V, H]", "float64", "dL/dE"),
    "grad_unembed": ("[H, V]", "float64", "dL/dU"),
    "adamw_embed": ("[V, H]", "float64", "E after one AdamW update with g = grad_embed"),
    "adamw_unembed": ("[H, V]", "float64", "U after one AdamW update with g = grad_unembed"),
}

MODEL = {
    "params": "E = embed [V, H], U = unembed [H, V], float64",
    "logits": "z_t = E[x_t] @ U, a vector of V logits for every token t (row n, position p)",
    "per_token_loss": (
        "l_t = logsumexp(z_t) - z_t[y_t] (cross-entropy) when y_t != -100; "
        "l_t = 0 and v_t = 0 when y_t == -100 (ignore index)"
    ),
    "loss": "L = sum over all N T tokens of c_t l_t, with c = token_weights",
    "softmax_error": "e_t = softmax(z_t) - onehot(y_t), and e_t = 0 where y_t == -100",
    "grad_unembed": "dL/dU = sum_t c_t E[x_t]^T e_t  (outer product, [H, V])",
    "grad_embed": "dL/dE[x] = sum_{t: x_t = x} c_t U e_t  (row x of [V, H]; 0 for unseen x)",
    "ignore_index": IGNORE_INDEX,
}

LAYOUT = {
    "rule": (
        "A layout (R, M) splits the N rows of the global batch contiguously and rank-major: "
        "with B = N / (R M), rank r holds rows [r M B, (r + 1) M B) and its microbatch m "
        "(accumulation step) the rows [(r M + m) B, (r M + m + 1) B). Equivalently every "
        "[N, T] array is reshaped (C order) to [R, M, B, T]: row n is on rank n // (M B), "
        "microbatch (n // B) % M."
    ),
    "exported": "every (R, M) with 1 <= R <= 8, 1 <= M <= 4, R M <= 8 and N divisible by R M",
}

#: Each scheme's (a_t, d, D). The exact statement is the docstring, also exported.
SCHEME_FORMULAS: dict[str, dict[str, str]] = {
    "token_mean": {
        "a_t": "v_t",
        "d": "valid targets of the microbatch",
        "D": "valid targets of the global batch",
    },
    "sequence_mean": {
        "a_t": "v_t / n_seg(t), n_seg(t) = valid targets of t's (row, segment id) pair",
        "d": "(row, segment id) pairs of the microbatch with n_seg > 0",
        "D": "segments of the global batch holding a valid target",
    },
    "row_mean": {
        "a_t": "v_t / n_row(t), n_row(t) = valid targets of t's row",
        "d": "rows of the microbatch with n_row > 0",
        "D": "rows of the global batch holding a valid target",
    },
    "weighted_mean": {
        "a_t": "w_t v_t (w = the fixture's weights)",
        "d": "sum over the microbatch of w_t v_t",
        "D": "sum over the global batch of w_t v_t",
    },
    "constant": {
        "a_t": "v_t",
        "d": "B T: every target slot of the microbatch, ignored and padding included",
        "D": "N T",
    },
    "sum": {"a_t": "v_t", "d": "none", "D": "1"},
    "rank_mean": {
        "a_t": "v_t / n_r, n_r = valid targets of rank r over its M microbatches (rank-local)",
        "d": "none: each rank takes its own mean and the all-reduce averages the R ranks",
        "D": "R (so c_t = v_t / (R n_r); a rank with n_r = 0 adds 0 here, NaN in real code)",
    },
    "microbatch_mean": {
        "a_t": "v_t / n_rm, n_rm = valid targets of microbatch (r, m)",
        "d": "1 for every microbatch, empty ones included",
        "D": "R M (so c_t = v_t / (R M n_rm); an empty microbatch adds 0)",
    },
}


def _optimizer_record(config: AdamWConfig) -> dict[str, Any]:
    return {
        "name": "AdamW (decoupled weight decay; optax.adamw and torch.optim.AdamW agree)",
        "hyperparameters": asdict(config),
        "state": "m_0 = v_0 = 0; the exported update is step k = 1",
        "update": (
            "m_k = b1 m_{k-1} + (1 - b1) g; v_k = b2 v_{k-1} + (1 - b2) g^2; "
            "theta_k = theta_{k-1} - learning_rate * ((m_k / (1 - b1^k)) / "
            "(sqrt(v_k / (1 - b2^k)) + eps) + weight_decay * theta_{k-1}), elementwise, on "
            "embed and unembed alike"
        ),
        "gradient": "g = grad_embed / grad_unembed exactly: no gradient clipping is applied",
        "start": "theta_0 = the fixture's embed / unembed",
    }


def _little_endian(array: np.ndarray) -> np.ndarray:
    # A reader in another language should not have to handle byte order: always '<'.
    # (np.asarray, not np.ascontiguousarray: that one turns a 0-d scalar into shape [1].)
    return np.asarray(array, dtype=array.dtype.newbyteorder("<"), order="C")


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` under a temporary name in the same directory, then rename it.

    A reader (or an export interrupted half-way) sees the old file or the new one, never part
    of one; the temporary file is removed if the write fails or is interrupted.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def npz_bytes(arrays: Mapping[str, np.ndarray]) -> bytes:
    """`arrays` as an uncompressed .npz that is byte-identical for equal input.

    np.savez stamps every member with the current time; here each member ``<key>.npy`` (npy
    format 1.0, little-endian, C order) gets a fixed date, fixed attributes, sorted order.
    """
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as archive:
        for key in sorted(arrays):
            buffer = io.BytesIO()
            np.lib.format.write_array(
                buffer, _little_endian(np.asarray(arrays[key])), version=(1, 0), allow_pickle=False
            )
            info = zipfile.ZipInfo(f"{key}.npy", date_time=ZIP_DATE_TIME)
            info.compress_type = zipfile.ZIP_STORED
            info.create_system = 3  # unix, whatever the writing platform
            info.external_attr = 0o644 << 16
            archive.writestr(info, buffer.getvalue())
    return out.getvalue()


def write_npz(path: Path, arrays: Mapping[str, np.ndarray]) -> None:
    """Write `arrays` to `path` as `npz_bytes` does, atomically (`write_atomic`)."""
    write_atomic(path, npz_bytes(arrays))


def _file_record(
    directory: Path, path: Path, arrays: Mapping[str, np.ndarray], docs: Mapping[str, tuple]
) -> dict[str, Any]:
    """Path, size, sha256 and every key's actual and symbolic shape and dtype of one file."""
    data = path.read_bytes()
    return {
        "path": path.relative_to(directory).as_posix(),
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "keys": {
            key: {
                "shape": list(np.shape(arrays[key])),
                "symbolic_shape": docs[key][0],
                "dtype": _little_endian(np.asarray(arrays[key])).dtype.str,
            }
            for key in sorted(arrays)
        },
    }


def exported_layouts(fixture: Fixture) -> list[tuple[int, int]]:
    """The layouts with vectors: every valid (R, M) of the fixture with R M <= 8."""
    return [(R, M) for R, M in fixture.valid_layouts() if R * M <= MAX_MICROBATCHES]


def expected_arrays(
    fixture: Fixture, scheme: str, R: int, M: int, config: AdamWConfig
) -> dict[str, np.ndarray]:
    """The oracle's vector for one fixture, scheme and layout (float64)."""
    # One update from the fixture's params, unclipped: exactly the harness's first update
    # with TrainSettings(num_updates=1, max_grad_norm=None).
    (record,) = train(fixture, scheme, R, M, num_updates=1, optimizer=config, max_grad_norm=None)
    result = record.result
    return {
        "loss": np.asarray(result.loss, dtype=np.float64),
        "denominator": np.asarray(result.denominator, dtype=np.float64),
        "token_weights": np.asarray(result.token_weights, dtype=np.float64),
        "grad_embed": result.grads["embed"],
        "grad_unembed": result.grads["unembed"],
        "adamw_embed": record.params["embed"],
        "adamw_unembed": record.params["unembed"],
    }


@dataclass(frozen=True, slots=True)
class VectorExport:
    """What `export_vectors` wrote: the manifest (also on disk) and the totals."""

    manifest: dict[str, Any]
    manifest_path: Path
    #: Every file written, the manifest included.
    files: list[Path]
    num_bytes: int


class ExportDirectoryError(ValueError):
    """The export directory cannot take the export: not empty (without force), or a file."""


#: The top-level entries an export writes: only files under these are ever replaced or
#: removed on the say-so of a previous manifest.
EXPORT_ENTRIES: tuple[str, ...] = ("fixtures", "expected", MANIFEST_NAME)


def _listing(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_export_directory(directory: str | Path, force: bool = False) -> None:
    """Raise `ExportDirectoryError` unless `directory` may take an export.

    It may when it does not exist yet or is empty, or, with `force`, when it is any
    directory. Nothing is written or created here.
    """
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ExportDirectoryError(f"{directory} is a file, not a directory")
    if force or not directory.is_dir():
        return
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in directory.iterdir())
    if names:
        raise ExportDirectoryError(
            f"{directory} is not empty (it holds {_listing(names)}): pass --force "
            "(force=True) to replace the export's own files there; files it did not write are "
            "left alone"
        )


def _previous_files(directory: Path) -> set[Path]:
    """The files a previous export's manifest lists, where they lie under `directory` and
    inside the export's own entries (a manifest is not trusted to name anything else)."""
    try:
        manifest = json.loads((directory / MANIFEST_NAME).read_text())
        records = [*manifest["fixtures"], *manifest["vectors"]]
        paths = [Path(str(record["path"])) for record in records]
    except (OSError, ValueError, KeyError, TypeError):  # not ours, or not readable: none
        return set()
    root = directory.resolve()
    files = set()
    for relative in paths:
        if relative.is_absolute() or ".." in relative.parts or not relative.parts:
            continue
        if relative.parts[0] not in EXPORT_ENTRIES[:2]:
            continue
        path = (directory / relative).resolve()
        if path.is_relative_to(root) and path.is_file():
            files.add(directory / relative)
    return files


def _remove_stale(directory: Path, stale: set[Path]) -> None:
    """Remove a previous export's files that this export did not write, then the folders
    they leave empty (never `directory` itself, never a folder holding anything else)."""
    for path in sorted(stale):
        with contextlib.suppress(OSError):
            path.unlink()
    for folder in sorted({p.parent for p in stale}, key=lambda p: -len(p.parts)):
        while folder != directory and directory in folder.parents:
            try:
                folder.rmdir()  # only an empty folder goes
            except OSError:
                break
            folder = folder.parent


def export_vectors(
    directory: str | Path, config: AdamWConfig | None = None, *, force: bool = False
) -> VectorExport:
    """Write every built-in fixture and its expected vectors under `directory`.

    `directory` must not exist, or be empty: a directory holding anything is refused with
    `ExportDirectoryError` (naming what it holds), before anything is written, unless `force`.
    With `force`, the export replaces only its own files: those the previous manifest lists
    (the ones this export does not write again are removed) and those it writes; any other
    file stays as it was. Every file is written under a temporary name and renamed into
    place, the manifest last: an interrupted export leaves the old manifest or the new one.
    """
    directory = Path(directory)
    check_export_directory(directory, force)
    config = AdamWConfig() if config is None else config
    previous = _previous_files(directory) if force else set()
    fixtures, vectors, written = [], [], []
    for name in BUILTIN_FIXTURES:
        fixture = builtin_fixture(name)
        arrays = {key: getattr(fixture, key) for key in NPZ_KEYS}
        path = directory / "fixtures" / f"{name}.npz"
        write_npz(path, arrays)
        written.append(path)
        layouts = exported_layouts(fixture)
        record = _file_record(directory, path, arrays, FIXTURE_KEYS)
        record.update(
            name=name,
            description=fixture.description,
            sizes={
                "N": fixture.num_rows,
                "T": fixture.seq_len,
                "V": fixture.vocab_size,
                "H": fixture.hidden_size,
            },
            valid_targets=fixture.num_valid_tokens,
            layouts=[[R, M] for R, M in layouts],
        )
        fixtures.append(record)
        for scheme in SCHEMES:
            for R, M in layouts:
                expected = expected_arrays(fixture, scheme, R, M, config)
                path = directory / "expected" / name / scheme / f"R{R}_M{M}.npz"
                write_npz(path, expected)
                written.append(path)
                record = _file_record(directory, path, expected, EXPECTED_KEYS)
                record.update(fixture=name, scheme=scheme, R=R, M=M)
                vectors.append(record)
    manifest = _manifest(fixtures, vectors, config)
    manifest_path = directory / MANIFEST_NAME
    text = json.dumps(manifest, indent=1, sort_keys=True, ensure_ascii=True) + "\n"
    write_atomic(manifest_path, text.encode("ascii"))
    written.append(manifest_path)
    # Only now, with the new manifest in place: until here the old one still describes the
    # files it lists that are not yet replaced.
    _remove_stale(directory, previous - set(written))
    return VectorExport(
        manifest=manifest,
        manifest_path=manifest_path,
        files=written,
        num_bytes=sum(path.stat().st_size for path in written),
    )


def _key_docs(docs: Mapping[str, tuple[str, str, str]]) -> dict[str, dict[str, str]]:
    return {
        key: {"symbolic_shape": shape, "dtype": dtype, "meaning": meaning}
        for key, (shape, dtype, meaning) in docs.items()
    }


def _manifest(
    fixtures: list[dict[str, Any]], vectors: list[dict[str, Any]], config: AdamWConfig
) -> dict[str, Any]:
    schemes = {
        name: {
            **SCHEME_FORMULAS[name],
            "intended": scheme.intended,
            "definition": inspect.cleandoc(type(scheme).__doc__ or ""),
        }
        for name, scheme in SCHEMES.items()
    }
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "generator": "python -m crosscheck export-vectors (gradweight), float64 closed-form oracle",
        "files": {
            "fixture": "fixtures/<fixture>.npz",
            "expected": "expected/<fixture>/<scheme>/R<R>_M<M>.npz",
            "encoding": (
                "numpy .npz: an uncompressed zip of <key>.npy members (npy format 1.0, "
                "little-endian, C order); scalars are 0-d arrays"
            ),
        },
        "symbols": {
            "N": "rows of the global batch",
            "T": "positions per row",
            "V": "vocabulary size",
            "H": "hidden size",
            "R": "ranks (data-parallel world size)",
            "M": "accumulation microbatches per rank and update",
            "B": "rows per microbatch, N / (R M)",
            "t": "a token: one (row, position) of the global batch",
            "v_t": "1 if targets[t] != -100 else 0",
            "w_t": "the fixture's soft weight, weights[t] (not the effective weight c_t)",
            "c_t": "the effective weight a_t / D, stored as token_weights",
        },
        "keys": {"fixture": _key_docs(FIXTURE_KEYS), "expected": _key_docs(EXPECTED_KEYS)},
        "model": MODEL,
        "layout": LAYOUT,
        "contract": (
            "A scheme gives every token a weight a_t computable inside its own microbatch and "
            "every microbatch a denominator contribution d; D = sum of d over all R M "
            "microbatches of the update (or fixed), and c_t = a_t / D. If D = 0 every c_t is "
            "0. Intended schemes give the same c (and so the same vectors, up to rounding) at "
            "every layout; rank_mean and microbatch_mean are accidents that depend on it."
        ),
        "schemes": schemes,
        "optimizer": _optimizer_record(config),
        "comparison": (
            "relative error per array: max |actual - expected| / max |expected|; the project "
            "accepts 1e-12 in float64 and 1e-5 in float32"
        ),
        "fixtures": fixtures,
        "vectors": vectors,
    }


# ---- reading an export back ---------------------------------------------------------------


class VectorFileError(ValueError):
    """An exported file or manifest that cannot be used; the message names the file and key."""


#: Keys every manifest holds, and every file record of each kind.
MANIFEST_KEYS: tuple[str, ...] = ("format", "format_version", "keys", "fixtures", "vectors")
_RECORD_KEYS: dict[str, tuple[str, ...]] = {
    "fixture": ("path", "bytes", "sha256", "keys", "name", "sizes", "layouts"),
    "expected": ("path", "bytes", "sha256", "keys", "fixture", "scheme", "R", "M"),
}
_KIND_KEYS: dict[str, dict[str, tuple[str, str, str]]] = {
    "fixture": FIXTURE_KEYS,
    "expected": EXPECTED_KEYS,
}


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """The manifest of an export in `directory`, checked for what a reader relies on.

    Raises VectorFileError naming the file and the problem: missing, not JSON (a truncated
    write), another format or version, a missing top-level key, or a file record (in
    ``fixtures`` or ``vectors``) without one of its keys.
    """
    path = Path(directory) / MANIFEST_NAME
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise VectorFileError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError as exc:
        raise VectorFileError(
            f"{path}: not valid JSON at line {exc.lineno}, column {exc.colno} "
            f"(a truncated or hand-edited manifest?): {exc.msg}"
        ) from None
    if not isinstance(manifest, dict):
        raise VectorFileError(f"{path}: a manifest is a JSON object, got {type(manifest).__name__}")
    for key in MANIFEST_KEYS:
        if key not in manifest:
            raise VectorFileError(f"{path}: missing key {key!r}")
    if manifest["format"] != FORMAT_NAME or manifest["format_version"] != FORMAT_VERSION:
        raise VectorFileError(
            f"{path}: format {manifest['format']!r} version {manifest['format_version']!r}; "
            f"this reader knows {FORMAT_NAME!r} version {FORMAT_VERSION}"
        )
    for kind, list_key in (("fixture", "fixtures"), ("expected", "vectors")):
        records = manifest[list_key]
        if not isinstance(records, list):
            raise VectorFileError(f"{path}: {list_key!r} must be a list of file records")
        for index, record in enumerate(records):
            if not isinstance(record, dict):
                raise VectorFileError(f"{path}: {list_key}[{index}] is not a file record")
            for key in _RECORD_KEYS[kind]:
                if key not in record:
                    label = record.get("path", "no path")
                    raise VectorFileError(
                        f"{path}: {list_key}[{index}] ({label}) is missing key {key!r}"
                    )
    return manifest


def read_vector_file(
    directory: str | Path, record: Mapping[str, Any], kind: str
) -> dict[str, np.ndarray]:
    """The arrays of one exported file (`kind` "fixture" or "expected"), checked against its
    manifest `record`: size and sha256 (a truncated copy fails here, by name), then every
    key's presence, shape and dtype.

    Raises VectorFileError naming the file and, where it is about one, the key.
    """
    if kind not in _KIND_KEYS:
        raise ValueError(f"kind must be one of {list(_KIND_KEYS)}, got {kind!r}")
    path = Path(directory) / record["path"]
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise VectorFileError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if len(data) != record["bytes"]:
        raise VectorFileError(
            f"{path}: {len(data)} bytes, the manifest says {record['bytes']}: the file is "
            "truncated or was replaced"
        )
    if hashlib.sha256(data).hexdigest() != record["sha256"]:
        raise VectorFileError(f"{path}: sha256 differs from the manifest's: the file changed")
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as archive:
            arrays = {key: archive[key] for key in archive.files}
    except (OSError, EOFError, ValueError, zipfile.BadZipFile) as exc:
        raise VectorFileError(f"{path}: not a readable .npz: {type(exc).__name__}: {exc}") from None
    expected = _KIND_KEYS[kind]
    missing, extra = sorted(set(expected) - set(arrays)), sorted(set(arrays) - set(expected))
    if missing:
        raise VectorFileError(f"{path}: missing key {missing[0]!r}")
    if extra:
        raise VectorFileError(
            f"{path}: unexpected key {extra[0]!r} (a {kind} file holds {list(expected)})"
        )
    listed = record["keys"]
    for key in expected:
        entry = listed.get(key) if isinstance(listed, Mapping) else None
        if entry is None:
            raise VectorFileError(f"{path}: the manifest lists no key {key!r} for this file")
        array = arrays[key]
        if list(array.shape) != list(entry.get("shape", [])) or array.dtype.str != entry.get(
            "dtype"
        ):
            raise VectorFileError(
                f"{path}: key {key!r} is {array.dtype.str} {list(array.shape)}, the manifest "
                f"says {entry.get('dtype')} {entry.get('shape')}"
            )
    return arrays
