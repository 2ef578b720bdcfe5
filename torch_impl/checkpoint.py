"""Atomic per-rank training checkpoints: where a run stopped, written so a crash never half-saves.

A checkpoint is a directory::

    <dir>/manifest.json    where the run stood, its layout, and every rank file's sha256
    <dir>/rank-00000.pt    ``torch.save`` of one rank's state (loads with weights_only=True)
    <dir>/rank-00001.pt    ...

Each rank file holds the params, the optimizer state (AdamW's moments and step), and, for a
stop inside an update's accumulation window, the rank's local unreduced ``.grad`` and its
``PartialAccumulation`` sums (``torch_impl.partial``).

Atomic: every rank writes into a staging directory ``.<name>.incomplete`` beside ``<dir>``; once
every rank's file is written and fsynced, rank 0 writes the manifest and renames the staging
directory to ``<dir>`` in one ``rename(2)``. A save that dies at any point leaves only the
staging directory, which nothing loads (``latest_checkpoint`` skips it, ``load_checkpoint``
names it), and the next save of that name clears it (tests/test_torch_hardening.py SIGKILLs a
rank halfway through its file: the previous checkpoint stays the latest and resumes exactly).
The manifest's checksums catch a rank file that was truncated or altered after the save.

Loading for a resume, possibly at another world size, is ``torch_impl.resume``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torch_impl.partial import PartialAccumulation

#: 2: a rank's share of D rides on its last microbatch (a partial window's local sum of d is
#: 0; format 1 held the microbatches' own d, which a format-2 resume would count twice), and
#: ``scheme`` is the spec's JSON form, so that two specs under one name are told apart.
FORMAT_VERSION = 2
MANIFEST = "manifest.json"
_STAGING_SUFFIX = ".incomplete"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved, or cannot be loaded for the requested resume."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Manifest:
    """Where a saved run stood and how it was laid out (``manifest.json``)."""

    updates_done: int
    #: 0: saved between updates; j > 0: inside update `updates_done` + 1, after j microbatches.
    microbatches_done: int
    world_size: int
    accum_steps: int
    strategy: str
    #: The scheme spec's JSON form (``SchemeSpec.to_dict``, keys sorted), its name included.
    scheme: str
    dtype: str
    #: Parameter name -> shape.
    params: dict[str, list[int]]
    #: Per rank: {"file", "sha256", "bytes"}.
    ranks: list[dict[str, Any]]
    format: int = FORMAT_VERSION

    @property
    def mid_accumulation(self) -> bool:
        return self.microbatches_done > 0

    def where(self) -> str:
        at = f"after update {self.updates_done}"
        if self.mid_accumulation:
            at += f" + {self.microbatches_done} of {self.accum_steps} microbatches"
        return f"{at} at world_size={self.world_size}, accum_steps={self.accum_steps}"


def short_name(name: str) -> str:
    """A parameter's own name: DDP prefixes "module.", the checkpoint keys without it."""
    return name.rsplit(".", 1)[-1]


def _rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def staging_path(directory: str | os.PathLike) -> Path:
    """Where a save of `directory` writes until it commits."""
    path = Path(directory)
    return path.with_name(f".{path.name}{_STAGING_SUFFIX}")


def _group_info(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1  # a single process without a process group


def _agree(value: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's `value`, on every rank (no collective without a process group).

    Every step of a save reports through this, so a rank that fails makes every rank raise
    the same error instead of leaving the others waiting in a collective.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    values: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return values


def _raise_failures(reports: list[Any], what: str) -> None:
    failures = [(rank, report) for rank, report in enumerate(reports) if isinstance(report, str)]
    if failures:
        lines = "; ".join(f"rank {rank}: {message}" for rank, message in failures)
        raise CheckpointError(f"{what} failed: {lines}")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_rank_file(path: Path, state: dict[str, Any]) -> dict[str, Any]:
    """Write one rank's state durably; its name, sha256 and size for the manifest."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    with open(path, "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    return {"file": path.name, "sha256": hashlib.sha256(payload).hexdigest(), "bytes": len(payload)}


def _write_manifest(staging: Path, manifest: Manifest) -> None:
    with open(staging / MANIFEST, "w") as f:
        json.dump(dataclasses.asdict(manifest), f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(staging)


def _commit(staging: Path, directory: Path) -> None:
    """The one step that makes the checkpoint exist: rename(2) is atomic within a filesystem.

    It also refuses to replace a non-empty directory, so an existing checkpoint is never
    overwritten.
    """
    os.rename(staging, directory)
    _fsync_dir(directory.parent)


def _partial_record(partial: PartialAccumulation) -> dict[str, Any]:
    # Python floats (float64) and ints, whatever the params' dtype: the partial d, loss sum and
    # counts are saved exactly (torch.save pickles them bit for bit), so a resumed postnorm
    # update carries the same D as the uninterrupted one, bf16 params included.
    return {
        "strategy": partial.strategy,
        "microbatches_done": partial.microbatches_done,
        "local_denominator": partial.local_denominator,
        "local_loss_sum": partial.local_loss_sum,
        "local_valid_tokens": partial.local_valid_tokens,
        "rank_counts": [list(pair) for pair in partial.rank_counts],
    }


def save_checkpoint(
    directory: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    updates_done: int,
    accum_steps: int,
    strategy: str,
    scheme: str,
    partial: PartialAccumulation | None = None,
    group: dist.ProcessGroup | None = None,
) -> Path:
    """Save every rank's state to `directory`, atomically; every rank calls it (collective).

    `partial` is given for a stop inside update `updates_done` + 1; then each rank's current
    ``.grad`` is saved with it. Returns the committed directory on every rank.
    """
    if partial is not None and (partial.strategy != strategy or partial.microbatches_done < 1):
        raise ValueError(
            f"a partial {partial.strategy} accumulation {partial.microbatches_done} microbatches "
            f"in cannot be saved as a {strategy} stop inside an update"
        )
    directory = Path(directory)
    staging = staging_path(directory)
    rank, world_size = _group_info(group)
    params = {short_name(name): p for name, p in model.named_parameters()}
    dtypes = {str(p.dtype).removeprefix("torch.") for p in params.values()}

    report: str | None = None
    if rank == 0:
        try:
            if directory.exists():
                raise CheckpointError(f"{directory} already exists; a checkpoint is never replaced")
            shutil.rmtree(staging, ignore_errors=True)  # what a crashed save left behind
            staging.mkdir(parents=True)
        except Exception as error:
            report = f"{type(error).__name__}: {error}"
    _raise_failures(_agree(report, group), f"preparing {staging}")

    state = {
        "format": FORMAT_VERSION,
        "rank": rank,
        "world_size": world_size,
        "params": {name: p.detach().clone() for name, p in params.items()},
        "optimizer": optimizer.state_dict(),
        "grads": {},
        "partial": None,
    }
    if partial is not None:
        state["grads"] = {
            name: p.grad.detach().clone() for name, p in params.items() if p.grad is not None
        }
        state["partial"] = _partial_record(partial)
    try:
        entry: dict[str, Any] | str = _write_rank_file(staging / _rank_file(rank), state)
    except Exception as error:
        entry = f"{type(error).__name__}: {error}"
    entries = _agree(entry, group)
    _raise_failures(entries, f"writing the rank files of {directory}")

    report = None
    if rank == 0:
        manifest = Manifest(
            updates_done=updates_done,
            microbatches_done=0 if partial is None else partial.microbatches_done,
            world_size=world_size,
            accum_steps=accum_steps,
            strategy=strategy,
            scheme=scheme,
            dtype=",".join(sorted(dtypes)),
            params={name: list(p.shape) for name, p in params.items()},
            ranks=entries,
        )
        try:
            _write_manifest(staging, manifest)
            _commit(staging, directory)
        except Exception as error:
            report = f"{type(error).__name__}: {error}"
    _raise_failures(_agree(report, group), f"committing {directory}")
    return directory


def read_manifest(directory: str | os.PathLike) -> Manifest:
    """The manifest of a committed checkpoint; CheckpointError says why there is none."""
    directory = Path(directory)
    if directory.name.startswith(".") and directory.name.endswith(_STAGING_SUFFIX):
        # With the manifest written but the rename not done, it would otherwise read as whole.
        raise CheckpointError(f"{directory} is the staging directory of an unfinished save")
    if not directory.is_dir():
        hint = ""
        if staging_path(directory).exists():
            hint = (
                f" ({staging_path(directory).name} exists: a save that did not finish, "
                "which is never loaded)"
            )
        raise CheckpointError(f"no checkpoint at {directory}{hint}")
    path = directory / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{directory} has no {MANIFEST}: not a committed checkpoint")
    try:
        record = json.loads(path.read_text())
        manifest = Manifest(**record)
    except (ValueError, TypeError) as error:
        raise CheckpointError(f"{path} is not a checkpoint manifest: {error}") from None
    if manifest.format != FORMAT_VERSION:
        raise CheckpointError(
            f"{directory} has checkpoint format {manifest.format}; this reader knows "
            f"{FORMAT_VERSION}"
        )
    return manifest


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The committed checkpoint under `root` that is furthest into training, or None.

    Staging directories of unfinished saves, and anything without a readable manifest, are
    skipped.
    """
    best: tuple[tuple[int, int], Path] | None = None
    root = Path(root)
    if not root.is_dir():
        return None
    for child in root.iterdir():
        if child.name.startswith(".") or not child.is_dir():
            continue
        try:
            manifest = read_manifest(child)
        except CheckpointError:
            continue
        position = (manifest.updates_done, manifest.microbatches_done)
        if best is None or position > best[0]:
            best = (position, child)
    return None if best is None else best[1]
