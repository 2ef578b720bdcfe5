"""Resuming from a checkpoint: read one rank's state for a layout, and put it into a fresh model.

Between updates, params and optimizer state are replicated on every rank, so a run may resume
at another world size (and accumulation steps, keeping the global batch): new rank r reads
saved rank r mod R. Inside an update, each rank's partial gradient covers its own rows of the
update, so only the saved layout, strategy, scheme and dtype can continue it; anything else is
refused with a message that says what differs. Reading never needs a process group.
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torch_impl.checkpoint import CheckpointError, Manifest, read_manifest, short_name
from torch_impl.partial import PartialAccumulation


@dataclass(frozen=True, slots=True)
class RankState:
    """What one rank reads from a checkpoint to resume."""

    manifest: Manifest
    #: The saved rank whose file this is (r mod R for a resume at another world size).
    source_rank: int
    params: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    #: Mid-accumulation only: the local accumulated gradient (absent where .grad was None).
    grads: dict[str, torch.Tensor]
    partial: PartialAccumulation | None


def _check_resume_layout(
    manifest: Manifest, directory: Path, world_size: int, accum_steps: int, expect: dict[str, str]
) -> None:
    if not manifest.mid_accumulation:
        return
    asked = {"world_size": world_size, "accum_steps": accum_steps, **expect}
    saved = {key: getattr(manifest, key) for key in asked}
    differ = {key: (saved[key], asked[key]) for key in asked if saved[key] != asked[key]}
    if differ:
        details = ", ".join(
            f"{key} saved {old!r}, asked {new!r}" for key, (old, new) in differ.items()
        )
        raise CheckpointError(
            f"{directory} stopped inside an update ({manifest.where()}) and can only be "
            f"continued by the same layout, strategy, scheme and dtype ({details}): each rank's "
            "partial gradient covers its own rows of the update. To change the layout, resume "
            "from a checkpoint taken between updates."
        )


def _partial_from(record: Mapping[str, Any]) -> PartialAccumulation:
    return PartialAccumulation(
        strategy=record["strategy"],
        microbatches_done=int(record["microbatches_done"]),
        local_denominator=float(record["local_denominator"]),
        local_loss_sum=float(record["local_loss_sum"]),
        local_valid_tokens=int(record["local_valid_tokens"]),
        rank_counts=tuple((float(d), float(n)) for d, n in record["rank_counts"]),
    )


def load_checkpoint(
    directory: str | os.PathLike,
    *,
    rank: int,
    world_size: int,
    accum_steps: int,
    strategy: str,
    scheme: str,
    dtype: str,
) -> RankState:
    """Rank `rank`'s state for a resume at (`world_size`, `accum_steps`); reads files only.

    A mid-accumulation checkpoint must be resumed with its own layout, strategy, scheme and
    dtype; a between-updates one at any layout. Every rank file must be present, and the one
    read must match its checksum.
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    _check_resume_layout(
        manifest, directory, world_size, accum_steps,
        {"strategy": strategy, "scheme": scheme, "dtype": dtype},
    )  # fmt: skip
    if len(manifest.ranks) != manifest.world_size:
        raise CheckpointError(
            f"{directory}: the manifest lists {len(manifest.ranks)} rank files for "
            f"world_size={manifest.world_size}"
        )
    missing = [e["file"] for e in manifest.ranks if not (directory / e["file"]).is_file()]
    if missing:
        raise CheckpointError(
            f"{directory} ({manifest.where()}) is missing rank file(s) {', '.join(missing)}"
        )
    source = rank % manifest.world_size
    entry = manifest.ranks[source]
    payload = (directory / entry["file"]).read_bytes()
    digest = hashlib.sha256(payload).hexdigest()
    if digest != entry["sha256"] or len(payload) != entry["bytes"]:
        raise CheckpointError(
            f"{directory / entry['file']} is truncated or altered: {len(payload)} bytes with "
            f"sha256 {digest[:12]}..., the manifest recorded {entry['bytes']} bytes with "
            f"sha256 {entry['sha256'][:12]}..."
        )
    state = torch.load(io.BytesIO(payload), weights_only=True)
    if (state["rank"], state["world_size"]) != (source, manifest.world_size):
        raise CheckpointError(
            f"{directory / entry['file']} holds rank {state['rank']} of {state['world_size']}, "
            f"the manifest says rank {source} of {manifest.world_size}"
        )
    return RankState(
        manifest=manifest,
        source_rank=source,
        params=state["params"],
        optimizer=state["optimizer"],
        grads=state["grads"],
        partial=None if state["partial"] is None else _partial_from(state["partial"]),
    )


def restore(
    state: RankState, model: nn.Module, optimizer: torch.optim.Optimizer
) -> PartialAccumulation | None:
    """Copy params, optimizer state and (mid-accumulation) ``.grad`` into a fresh model.

    Returns the partial sums to pass as ``resume=`` to the update that continues, or None
    when the checkpoint was taken between updates. The optimizer's hyperparameters come from
    the checkpoint (``Optimizer.load_state_dict``).
    """
    params = {short_name(name): p for name, p in model.named_parameters()}
    shapes = {name: list(p.shape) for name, p in params.items()}
    if shapes != state.manifest.params:
        raise CheckpointError(
            f"the checkpoint holds params {state.manifest.params}, the model has {shapes}"
        )
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(state.params[name])  # in place: DDP's buckets and hooks stay valid
            saved = state.grads.get(name)
            param.grad = None if saved is None else saved.to(param.dtype).clone()
    optimizer.load_state_dict(state.optimizer)
    return state.partial
