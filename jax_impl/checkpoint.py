"""Atomic orbax checkpoints of a training run, between updates or inside an accumulation window.

A checkpoint holds the train state of `jax_impl.train_state` (params, optax state, the number of
complete updates and, for a stop inside a window, the per-rank partial sums) as one orbax
composite item: ``state`` (arrays, written by orbax's StandardCheckpointHandler) and ``meta``
(JSON: the scheme spec, strategy, layout, dtype, a fingerprint of the global batch, progress).

Atomicity is orbax's (local paths use its AtomicRenameTemporaryPath): a save writes
``<name>.orbax-checkpoint-tmp/`` and renames it to ``<name>/`` only after every item in it is
written and finalized (finalize-by-rename), so ``<name>`` exists only as a complete checkpoint.
`check_finalized` checks that before reading a byte, and refuses a temporary directory by
name: a save that died half-way is never resumed from. A process killed in the middle of a
save (SIGKILL, even right before the final rename: tests/test_jax_hardening.py) leaves every
earlier checkpoint as it was, loadable, and the resume from it exact to the bit; a later save
of the same name removes the leftover temporary directory first (orbax does) and starts over.
(Durability across a power loss is not claimed: nothing is fsynced.)

Arrays are saved and restored as numpy (host) arrays, so restoring needs no particular device
count: a checkpoint taken between updates at world size R resumes at any other R'.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

CHECKPOINT_FORMAT = 2
"""Version of the layout below; bumped when a field changes meaning (2: ``scheme`` holds the
scheme spec's JSON; a partial window holds no d channels, they are recomputed from the labels)."""

#: The arrays a fingerprint reads: the token arrays always, the v2 row and token fields when
#: the batch has them (`jax_impl.batch`).
BATCH_KEYS = ("inputs", "targets", "segment_ids", "weights")
OPTIONAL_KEYS = ("group_ids", "document_ids", "row_weights", "sample_mask")


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from here; the message says what and why."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointMeta:
    """What a checkpoint is a checkpoint of, and how far the run got.

    `microbatches_done` > 0 marks a stop inside update ``updates_done + 1``: its first
    `microbatches_done` of `accum_steps` microbatches are accumulated on every rank but not yet
    reduced, so the checkpoint only makes sense at the same (world_size, accum_steps).
    """

    scheme: str
    strategy: str
    collective: str
    world_size: int
    accum_steps: int
    dtype: str
    batch_fingerprint: str
    updates_done: int
    microbatches_done: int = 0
    format: int = CHECKPOINT_FORMAT

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, record: Mapping[str, Any], where: str) -> CheckpointMeta:
        if record.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointError(
                f"{where}: checkpoint format {record.get('format')!r}, this code reads format "
                f"{CHECKPOINT_FORMAT}"
            )
        fields = set(cls.__dataclass_fields__)
        missing = sorted(fields - set(record))
        if missing:
            raise CheckpointError(f"{where}: checkpoint metadata lacks {missing}")
        return cls(**{k: record[k] for k in fields})


def batch_fingerprint(batch: Mapping[str, np.ndarray]) -> str:
    """sha256 of the global batch [N, T] (layout-independent: the rows in their global order).

    A resume on another batch would continue a different objective; the fingerprint makes
    that an error instead of a silently different run.
    """
    digest = hashlib.sha256()
    for key in (*BATCH_KEYS, *(k for k in OPTIONAL_KEYS if k in batch)):
        array = np.ascontiguousarray(batch[key])
        digest.update(f"{key}:{array.dtype.str}:{array.shape}".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()[:32]


def _checkpointer():
    import orbax.checkpoint as ocp

    return ocp.Checkpointer(ocp.CompositeCheckpointHandler())


def _host_tree(tree: Any) -> Any:
    """Every leaf as an ndarray (orbax's standard handler rejects numpy scalars)."""
    import jax

    return jax.tree.map(lambda x: np.asarray(x), tree)


def save_checkpoint(directory: str | Path, arrays: Mapping[str, Any], meta: CheckpointMeta) -> Path:
    """Write `arrays` (a tree of arrays) and `meta` atomically to `directory`; returns it.

    Refuses to overwrite: a run that stops twice at the same place is a caller bug. Returns
    only after orbax has finalized (renamed) the checkpoint.
    """
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    if directory.exists():
        raise CheckpointError(f"{directory}: a checkpoint already exists there; not overwriting")
    _checkpointer().save(
        directory,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(_host_tree(dict(arrays))),
            meta=ocp.args.JsonSave(meta.to_json()),
        ),
    )
    return directory


def unfinalized_siblings(directory: Path) -> list[Path]:
    """orbax temporary directories of `directory` (saves of that name that never finished)."""
    from orbax.checkpoint.path import step

    pattern = f"{directory.name}{step.TMP_DIR_SUFFIX}*"
    return sorted(directory.parent.glob(pattern)) if directory.parent.exists() else []


def check_finalized(directory: str | Path) -> Path:
    """`directory` if it is a finalized orbax checkpoint, else CheckpointError saying why."""
    from orbax.checkpoint.path import step

    directory = Path(directory).absolute()
    if step.TMP_DIR_SUFFIX in directory.name or (
        directory.exists() and step.is_path_temporary(directory)
    ):
        raise CheckpointError(
            f"{directory}: an unfinalized orbax checkpoint (a save that did not finish); "
            "refusing to restore it"
        )
    if not directory.exists():
        partial = unfinalized_siblings(directory)
        hint = (
            f"; only unfinalized save(s) {[p.name for p in partial]} exist, which a save "
            "interrupted before orbax's final rename leaves behind, and are never restored"
            if partial
            else ""
        )
        raise CheckpointError(f"{directory}: no checkpoint there{hint}")
    if not step.is_path_finalized(directory):
        raise CheckpointError(f"{directory}: not a finalized orbax checkpoint")
    return directory


def read_meta(directory: str | Path) -> CheckpointMeta:
    """The metadata of a finalized checkpoint (reads no arrays)."""
    import orbax.checkpoint as ocp

    directory = check_finalized(directory)
    try:
        restored = _checkpointer().restore(
            directory, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
        )
    except Exception as error:
        raise CheckpointError(f"{directory}: cannot read checkpoint metadata: {error}") from error
    return CheckpointMeta.from_json(restored.meta, str(directory))


def read_arrays(directory: str | Path, template: Mapping[str, Any]) -> dict[str, Any]:
    """The array tree of a finalized checkpoint, as numpy, checked against `template`.

    `template` is a tree of arrays (or anything with .shape and .dtype) of the structure the
    caller expects; a missing or extra entry, or a leaf of another shape or dtype, is a
    CheckpointError naming it.
    """
    import jax
    import orbax.checkpoint as ocp

    directory = check_finalized(directory)
    target = jax.tree.map(lambda x: np.zeros(np.shape(x), np.dtype(x.dtype)), dict(template))
    try:
        restored = _checkpointer().restore(
            directory, args=ocp.args.Composite(state=ocp.args.StandardRestore(target))
        )
    except Exception as error:
        raise CheckpointError(
            f"{directory}: the saved arrays do not match what this run expects "
            f"({type(error).__name__}: {error})"
        ) from error
    state = restored.state
    expected = jax.tree_util.tree_leaves_with_path(target)
    got = jax.tree_util.tree_leaves_with_path(state)
    if [k for k, _ in expected] != [k for k, _ in got]:
        raise CheckpointError(
            f"{directory}: saved entries {[jax.tree_util.keystr(k) for k, _ in got]}, expected "
            f"{[jax.tree_util.keystr(k) for k, _ in expected]}"
        )
    for (key, want), (_, have) in zip(expected, got, strict=True):
        if np.shape(have) != want.shape or np.asarray(have).dtype != want.dtype:
            raise CheckpointError(
                f"{directory}: {jax.tree_util.keystr(key)} is {np.asarray(have).dtype}"
                f"{list(np.shape(have))}, expected {want.dtype}{list(want.shape)}"
            )
    return state


def describe(directory: str | Path) -> str:
    """One line about a checkpoint, for logs and error messages."""
    meta = read_meta(directory)
    where = f"after update {meta.updates_done}"
    if meta.microbatches_done:
        where += f" + {meta.microbatches_done}/{meta.accum_steps} microbatches"
    return json.dumps({"where": where, **meta.to_json()})
