r"""The postnorm DDP communication hook: sum the gradient buckets and carry d in the same call.

DDP's default reduction *averages*: every bucket is all-reduced and divided by R. postnorm
wants the plain sum of every rank's unnormalized gradient,

.. math::

    \sum_r \nabla \Big(\sum_{t \in r} a_t l_t\Big), \qquad \text{then divide by } D = \sum d,

and D is only known once every rank's d has been summed. Instead of a second all-reduce for D,
the hook appends every rank's (d, loss sum, valid tokens) to bucket 0's buffer, in exactly
representable limbs, one slot per rank (``torch_impl.exact_carry``), and all-reduces the
enlarged buffer with SUM. The gradient part goes back to DDP unscaled; the carried part lands in
the hook's state, where the update reads D and divides the gradients by it.

Usage::

    state = PostnormState(rank=rank, world_size=world_size)
    ddp.register_comm_hook(state, sum_and_carry_hook)
    ...
    state.arm(d_local, loss_sum_local, valid_tokens_local)   # before the last backward
    loss_sum.backward()                                      # hook runs here
    per_rank = state.take()                                  # [(d, loss_sum, valid), ...]
"""

# No `from __future__ import annotations` here: DDP's register_comm_hook inspects the hook's
# annotations and rejects them as strings; they must be the real GradBucket and Future types.
from dataclasses import dataclass

import torch
import torch.distributed as dist

from torch_impl.exact_carry import decode_slots, encode_slots

#: The bucket that carries the extras. Every rank has a bucket 0, built from the same
#: parameters, so every rank appends to the same bucket and the buffers keep equal sizes.
CARRIER_BUCKET = 0


class PostnormHookError(RuntimeError):
    """The hook's state was used out of order (see the message)."""


@dataclass(slots=True)
class PostnormState:
    """What the hook carries in the next synchronizing backward, and what it received."""

    rank: int
    world_size: int
    process_group: dist.ProcessGroup | None = None
    #: This rank's values for the next reduction; None: carry nothing (e.g. the probe).
    pending: tuple[float, ...] | None = None
    #: Every rank's values after the reduction, until `take()` consumes them.
    received: list[tuple[float, ...]] | None = None

    def arm(self, *values: float) -> None:
        """Carry `values` in the next reduction (call on every rank, same number of values)."""
        self.pending = tuple(float(v) for v in values)
        self.received = None

    def take(self) -> list[tuple[float, ...]]:
        """Every rank's carried values from the last reduction; each reduction's are read once.

        Reading once is what keeps a count from going stale: a second update that forgot to
        arm fails here instead of silently reusing the first update's D (docs/bugs.md stale-count,
        torchtune#1917).
        """
        if self.received is None:
            raise PostnormHookError(
                f"rank {self.rank}: the postnorm hook carried nothing since the last take(); "
                "was arm() called, and did the last microbatch's backward run outside no_sync()?"
            )
        received, self.received = self.received, None
        return received


def sum_and_carry_hook(
    state: PostnormState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: all-reduce (SUM, no division) the bucket plus the carried values."""
    buffer = bucket.buffer()
    values = state.pending if bucket.index() == CARRIER_BUCKET else None
    if values is None:
        payload = buffer
    else:
        # Limbs of the bucket's own dtype (float64, float32 or bf16): d stays exact in any of
        # them, where d itself in a bf16 bucket would round past 256 (float32: past 2^24).
        extras = encode_slots(values, state.rank, state.world_size, buffer.dtype)
        # The slots are built on the CPU; a GPU bucket needs them beside it (NCCL).
        payload = torch.cat([buffer, extras.to(buffer.device)])
        state.pending = None  # consumed: the next update must arm again
    work = dist.all_reduce(payload, op=dist.ReduceOp.SUM, group=state.process_group, async_op=True)

    def unpack(future: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        reduced = future.value()[0]
        if values is None:
            return reduced
        size = buffer.numel()
        state.received = decode_slots(reduced[size:], len(values), state.world_size)
        return reduced[:size]

    return work.get_future().then(unpack)
