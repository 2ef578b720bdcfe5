"""Launches that run in this very process, one rank of a job an existing launcher started.

Under ``torchrun`` every process already is a rank: `join` puts this process into the
launcher's process group (``env://``: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``) and from then on ``torch_impl.harness.launcher.launch`` does not start
processes: a launch of the job's world size calls ``fn(rank, world_size, *args)`` here
(`run`), and the ranks exchange what each returned, or the traceback it raised, over a gloo
group of their own, so that every rank returns the same list of R results or raises the same
`RankFailedError`-like error naming the first rank that failed. A launch of another world size
cannot run in the job and raises. Launches run one at a time (a lock): the ranks' collectives
must come in the same order on every rank, and the caller must issue the same launches in the
same order on every rank (``crosscheck run`` under torchrun runs one launch per world size,
and only the job's).

Bounds: the process group's collective timeout (`join`'s `collective_timeout_s`) ends a
collective that a peer never joins, so a rank that raised leaves the others waiting at most
that long before the exchange.
"""

from __future__ import annotations

import datetime
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class _Job:
    rank: int
    world_size: int
    exchange: Any


_job: _Job | None = None
_lock = threading.Lock()


def active() -> bool:
    """Whether this process joined a launcher's job (launches then run in place)."""
    return _job is not None


def join(device: str, local_rank: int, collective_timeout_s: float) -> tuple[int, int]:
    """Join the launcher's process group on `device` ("cpu": gloo; "cuda": GPU `local_rank`,
    NCCL); (rank, world size)."""
    global _job
    if _job is not None:
        return _job.rank, _job.world_size
    if device == "cuda":
        # As the harness's own ranks: the GPU of this rank, and the default device, so that
        # the models and batches built by the launch's target land there.
        torch.cuda.set_device(local_rank)
        torch.set_default_device(f"cuda:{local_rank}")
    timeout = datetime.timedelta(seconds=collective_timeout_s)
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo", init_method="env://", timeout=timeout
    )
    # Results are pickled objects: a gloo group of their own, whatever the backend.
    exchange = dist.new_group(backend="gloo", timeout=timeout)
    _job = _Job(dist.get_rank(), dist.get_world_size(), exchange)
    return _job.rank, _job.world_size


def agree(value: Any) -> Any:
    """Rank 0's `value`, on every rank of the joined job."""
    if _job is None:
        raise RuntimeError("agree() needs a joined launcher job (join)")
    chosen = [value]
    dist.broadcast_object_list(chosen, src=0, group=_job.exchange)
    return chosen[0]


def leave() -> None:
    """Leave the launcher's process group (a no-op when not joined)."""
    global _job
    if _job is not None and dist.is_initialized():
        dist.destroy_process_group()
    _job = None


def run(
    fn: Callable[..., Any], world_size: int, args: tuple, failed: Callable[[int, str], Exception]
) -> list[Any]:
    """``[fn(0, R, *args), ..., fn(R-1, R, *args)]``, this rank computing its own entry.

    Raises ``failed(rank, traceback)`` for the first rank whose `fn` raised (the same on every
    rank), and RuntimeError for a `world_size` other than the job's.
    """
    job = _job
    if job is None:
        raise RuntimeError("run() needs a joined launcher job (join)")
    if world_size != job.world_size:
        raise RuntimeError(
            f"the launcher started {job.world_size} ranks: a launch of {world_size} ranks "
            "cannot run in its job"
        )
    with _lock:
        try:
            outcome: tuple[bool, Any] = (True, fn(job.rank, job.world_size, *args))
        except Exception:
            outcome = (False, traceback.format_exc())
        outcomes: list[Any] = [None] * job.world_size
        dist.all_gather_object(outcomes, outcome, group=job.exchange)
    for rank, (ok, value) in enumerate(outcomes):
        if not ok:
            raise failed(rank, value)
    return [value for _, value in outcomes]
