"""The guards of an update: every rank's batch agreed on first, NaN and inf caught where they start.

Before anything else, every update runs a pre-check (`precheck`): each rank validates its
microbatches, then one small all-reduce, waited on for at most ``PRECHECK_TIMEOUT_S``, tells
every rank whether every batch was valid and how many microbatches each rank holds. A bad
token is then reported on every rank (its rank, microbatch, row and position), and ranks
given different numbers of microbatches fail with ``RankMismatchError`` naming every rank's
count, instead of one rank stopping while the others wait in a collective for it.

Inside the loop (``torch_impl.update``), each microbatch's loss sum is checked before its
backward (a float the loop reads anyway) and the gradients after it (`non_finite_grad`: one
``isfinite`` reduction over the parameters): the first NaN or inf raises ``NonFiniteError``
naming the rank and microbatch where it appeared, and whether the params themselves hold one
(`params_hint`).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torch_impl.batch import BatchError, TokenBatch

#: How long the pre-check of an update waits for every rank to reach it. Ranks arrive within
#: moments of each other (the previous update ended in a collective); this bounds the wait for
#: one that failed or hangs instead of blocking for the process group's own timeout.
PRECHECK_TIMEOUT_S = 60.0
#: How long a rank with a valid batch waits before raising for another rank's bad batch.
PEER_REPORT_DELAY_S = 1.0


class RankMismatchError(ValueError):
    """The ranks hold different numbers of microbatches for one update (the message lists them)."""


class NonFiniteError(FloatingPointError):
    """A NaN or inf in a loss sum or gradient; the message names the rank and microbatch."""


def _validate(microbatches: Sequence[TokenBatch], vocab_size: int) -> None:
    for batch in microbatches:
        batch.validate(vocab_size)


def bounded_all_reduce(
    tensor: torch.Tensor, op: Any, group: dist.ProcessGroup | None, timeout_s: float, late: str
) -> None:
    """all_reduce `tensor` in place, waiting at most `timeout_s` for every rank; past it a
    TimeoutError says "rank r: `late`"."""
    work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise TimeoutError(f"rank {dist.get_rank(group)}: {late}") from exc


def precheck(
    microbatches: Sequence[TokenBatch],
    vocab_size: int,
    group: dist.ProcessGroup | None,
    timeout_s: float,
) -> None:
    """Validate this rank's microbatches, then agree on them with every rank, first thing.

    One all-reduce of R x 2 float64 (each rank's M and whether its batch is valid, in its own
    slot: the sum adds only zeros to each), waited on for at most `timeout_s`:

    * a bad batch raises its BatchError (rank, microbatch, row, position) on its own rank, and
      every other rank, ``PEER_REPORT_DELAY_S`` later, a BatchError quoting it: nobody waits in
      the next collective for a rank that stopped;
    * different numbers of microbatches raise RankMismatchError on every rank, naming every
      rank's count: otherwise one rank's synchronizing backward would meet another's
      (DDP: a silently wrong update; FSDP2: a deadlock in the extra forward's all-gather);
    * a rank that does not arrive (it failed before, hangs, or runs fewer updates) is a
      TimeoutError after `timeout_s`, not a wait for the process group's timeout.

    Without a process group only the validation runs.
    """
    error: BatchError | None = None
    try:
        _validate(microbatches, vocab_size)
    except BatchError as exc:
        error = exc
    if not (dist.is_available() and dist.is_initialized()):
        if error is not None:
            raise error
        return
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    status = torch.zeros(world_size, 2, dtype=torch.float64)
    status[rank, 0] = len(microbatches)
    status[rank, 1] = 0.0 if error is None else 1.0
    bounded_all_reduce(
        status,
        dist.ReduceOp.SUM,
        group,
        timeout_s,
        f"not every one of the {world_size} ranks reached the start of this update within "
        f"{timeout_s:g} s (a rank that failed, hangs, or runs fewer updates)",
    )
    counts = [int(count) for count in status[:, 0].tolist()]
    bad = [r for r, flag in enumerate(status[:, 1].tolist()) if flag]
    if bad:
        # Every rank now knows that some batch is bad, so all of them take part in this second
        # exchange (only on this failure path), and every rank can say what is wrong and where.
        messages: list[str | None] = [None] * world_size
        dist.all_gather_object(messages, None if error is None else str(error), group=group)
        if error is not None:
            raise error
        # Let the rank holding the bad batch report first: a launcher that names the first
        # rank to fail (torch_impl.harness.launcher) then names the root cause, not its echo here.
        time.sleep(PEER_REPORT_DELAY_S)
        raise BatchError(
            f"rank {rank}: stopping, rank(s) {', '.join(map(str, bad))} hold bad input; "
            f"rank {bad[0]} reports: {messages[bad[0]]}"
        )
    if len(set(counts)) > 1:
        listing = ", ".join(f"rank {r}: {count}" for r, count in enumerate(counts))
        raise RankMismatchError(
            f"rank {rank}: the ranks hold different numbers of microbatches for this update "
            f"({listing}); every rank must accumulate the same number, since each rank's last "
            "microbatch is the one whose backward all-reduces the gradient"
        )


def rank_of(microbatches: Sequence[TokenBatch], step: int) -> int:
    """This process's rank for messages: the process group's, else the batch's own record."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return microbatches[step].rank


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a sharded DTensor's local shard (no collective)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def non_finite_grad(model: nn.Module) -> str | None:
    """The name of the first parameter whose gradient holds a NaN or inf, or None.

    One ``isfinite`` pass over the gradients and one host sync per call: small next to the
    backward pass that produced them. Sharded gradients are checked shard by shard (local).
    """
    named = [
        (name, _local(p.grad))
        for name, p in model.named_parameters()
        if p.requires_grad and p.grad is not None
    ]
    if not named:
        return None
    finite = torch.stack([torch.isfinite(grad).all() for _, grad in named])
    if bool(finite.all()):
        return None
    return named[int(torch.nonzero(~finite)[0])][0].rsplit(".", 1)[-1]


def params_hint(model: nn.Module) -> str:
    """Whether the params themselves hold a NaN or inf (only computed on the failure path)."""
    bad = [
        name.rsplit(".", 1)[-1]
        for name, p in model.named_parameters()
        if not bool(torch.isfinite(_local(p.detach())).all())
    ]
    if bad:
        return f"the params hold NaN or inf in {', '.join(bad)}"
    return "the params are finite, so a logit or a loss overflowed (params too large?)"
