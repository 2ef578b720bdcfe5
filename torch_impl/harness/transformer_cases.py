"""The transformer's update cases on one process group: every case of a world size, one launch.

A `TransformerCase` names a global batch (with contract v2's row fields when a spec needs
them), a scheme spec (a catalogue name or a dict, ``torch_impl.spec``), a strategy and M.
Every rank runs one update of it with the project's own reference steps
(``torch_impl.update.accumulate_precount`` / ``accumulate_postnorm``) on a DDP-wrapped
``TinyTransformer``, trained through
``per_token_losses``; rank 0 returns the reduced gradient, and every rank how far its own
gradient is from rank 0's (all ranks must hold the same update).

Two wrappers are built once and reused: a plain DDP one (precount) and one with the postnorm
comm hook; each case copies the initial weights into the same tensors, so the buckets and the
hook stay valid.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from crosscheck.fixtures.transformer_weights import TRANSFORMER_CONFIG, initial_weights
from torch_impl.batch import context_microbatches, rank_microbatches
from torch_impl.comm_hooks import PostnormState, sum_and_carry_hook
from torch_impl.transformer import (
    TinyTransformer,
    context_parallel_token_losses,
    load_weights,
    microbatch_token_losses,
    named_grads,
)
from torch_impl.update import accumulate_postnorm, accumulate_precount


@dataclass(frozen=True, kw_only=True, slots=True)
class TransformerCase:
    """One update of the transformer on a global batch, from the committed initial weights."""

    label: str
    #: Global [N, T] arrays (inputs, targets, segment_ids, weights) and any [N] row fields.
    batch: Mapping[str, np.ndarray]
    #: A scheme spec's catalogue name (``token_mean``, ``group_token_mean``) or its dict.
    scheme: str | Mapping[str, Any]
    strategy: Literal["precount", "postnorm"]
    accum_steps: int
    #: Context parallel: every row split over this many context ranks in `context_order`,
    #: the world then R x C processes with DDP over all of them (1: none).
    context_size: int = 1
    context_order: str = "contiguous"

    def __post_init__(self) -> None:
        if self.strategy not in ("precount", "postnorm"):
            raise ValueError(
                f"case {self.label!r}: strategy must be precount or postnorm, got {self.strategy!r}"
            )


@dataclass(frozen=True, slots=True)
class TransformerOutput:
    """One rank's result of one case."""

    label: str
    rank: int
    #: The reduced float64 gradient, keyed like the weights file (rank 0 only; None elsewhere).
    grads: dict[str, np.ndarray] | None
    #: max |g_this_rank - g_rank0| over every parameter entry (0.0 on rank 0).
    max_diff_from_rank0: float


def _flat(grads: Mapping[str, np.ndarray]) -> torch.Tensor:
    return torch.cat([torch.from_numpy(grads[k]).flatten() for k in sorted(grads)])


def _run_case(
    case: TransformerCase,
    model: DistributedDataParallel,
    hook_state: PostnormState | None,
    weights: Mapping[str, np.ndarray],
    rank: int,
    world_size: int,
) -> TransformerOutput:
    model.zero_grad(set_to_none=True)
    load_weights(model, weights)
    C = case.context_size
    if C == 1:
        microbatches = rank_microbatches(case.batch, rank, world_size, case.accum_steps)
        losses = microbatch_token_losses
    else:
        R = world_size // C
        microbatches = context_microbatches(
            case.batch, rank, R, C, case.accum_steps, case.context_order
        )
        losses = context_parallel_token_losses(context_groups(R, C), case.context_order)
    common = dict(vocab_size=TRANSFORMER_CONFIG.vocab, per_token_losses=losses)
    # DDP's default all-reduce averages the buckets (divides their sum by R): precount's
    # reduce factor s is R. Were it not, every gradient would be off by R and the check fail.
    s = float(world_size)
    if case.strategy == "precount":
        accumulate_precount(model, microbatches, case.scheme, reduce_factor=s, **common)
    else:
        accumulate_postnorm(model, microbatches, case.scheme, hook_state=hook_state, **common)
    grads = named_grads(model)
    model.zero_grad(set_to_none=True)
    # Every rank must hold rank 0's update: rank 0's flat gradient is broadcast and each rank
    # reports its own largest difference (one collective, instead of every rank's full copy
    # travelling back through the launcher's pickles).
    flat = _flat(grads)
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    diff = float((flat - reference).abs().max())
    return TransformerOutput(case.label, rank, grads if rank == 0 else None, diff)


@functools.cache
def context_groups(data_parallel: int, context_size: int) -> dict[int, dist.ProcessGroup]:
    """Data rank r -> the group of its C context ranks r C + c. Every process creates every
    group, in the same order (``dist.new_group`` requires it); cached for the process's life
    (a launch starts fresh processes: one default process group each)."""
    return {
        r: dist.new_group([r * context_size + c for c in range(context_size)])
        for r in range(data_parallel)
    }


def run_transformer_cases(
    rank: int, world_size: int, cases: Sequence[TransformerCase]
) -> list[TransformerOutput]:
    """Run every case in order on this rank (a launcher target: the same cases on every rank,
    since each one runs collectives)."""
    if not dist.is_initialized():
        raise RuntimeError(f"rank {rank}: run_transformer_cases needs an initialized process group")
    weights = initial_weights()
    plain = DistributedDataParallel(TinyTransformer(weights=weights))
    hooked = DistributedDataParallel(TinyTransformer(weights=weights))
    hook_state = PostnormState(rank=rank, world_size=world_size)
    hooked.register_comm_hook(hook_state, sum_and_carry_hook)
    out = []
    for case in cases:
        if case.strategy == "precount":
            out.append(_run_case(case, plain, None, weights, rank, world_size))
        else:
            out.append(_run_case(case, hooked, hook_state, weights, rank, world_size))
    return out
