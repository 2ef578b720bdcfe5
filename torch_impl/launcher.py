"""Run a function on R real processes with a gloo process group; every wait is bounded.

``launch(fn, world_size, args)`` starts R processes (``torch.multiprocessing``, forked from a
fork server that imported torch once, see `_rank_context`), joins them into a gloo process
group through a ``file://`` rendezvous in a fresh temporary directory (no port to race for),
calls ``fn(rank, world_size, *args)`` on each and returns the R results in rank order. It
never hangs:

* the job and the results travel through files in a fresh temporary directory, so starting
  a process never blocks on a pipe its child may not live to read;
* the process group has a timeout, so a collective whose peer is gone fails on its own;
* the caller polls for results against one deadline for the whole launch and, between polls,
  checks every process: a rank that raised reports its traceback, a rank that died without
  reporting (segfault, ``os._exit``, OOM kill) is seen by its exit code;
* on the first failure every other rank is terminated (then killed) and ``RankFailedError`` names
  the rank; past the deadline ``LaunchTimeoutError`` names the ranks that had not reported.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: After a rank exits without a result, how long its result may still be in flight.
_EXIT_GRACE_S = 2.0
_JOB_FILE = "job.pkl"
_POLL_S = 0.2


class RankFailedError(RuntimeError):
    """A rank raised or died; `rank` is which, `details` its traceback or exit code."""

    def __init__(self, rank: int, details: str) -> None:
        super().__init__(f"rank {rank} failed:\n{details}")
        self.rank = rank
        self.details = details


class LaunchTimeoutError(TimeoutError):
    """Some ranks did not report within the launch's time limit."""

    def __init__(self, ranks: Sequence[int], timeout_s: float) -> None:
        names = ", ".join(str(r) for r in ranks)
        super().__init__(f"rank(s) {names} did not finish within {timeout_s:g} s")
        self.ranks = list(ranks)


def _worker(
    rank: int,
    world_size: int,
    init_method: str,
    collective_timeout_s: float,
    workdir: str,
    results: Any,
) -> None:
    # Several ranks share few cores: one intra-op thread each avoids oversubscription.
    torch.set_num_threads(1)
    try:
        with open(os.path.join(workdir, _JOB_FILE), "rb") as f:
            fn, args = pickle.load(f)
        dist.init_process_group(
            "gloo",
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=collective_timeout_s),
        )
        value = fn(rank, world_size, *args)
        _write_atomic(os.path.join(workdir, _result_file(rank)), value)
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    else:
        results.put((rank, True, None))
    finally:
        # Flush the report before leaving the process group: once this rank's sockets close,
        # its peers fail too, and their reports must not overtake the root cause's.
        results.close()
        results.join_thread()
        if dist.is_initialized():
            dist.destroy_process_group()


#: What the fork server imports before it forks any rank: torch, and what DDP's constructor and
#: FSDP2 import on first use (torch._dynamo, about 2.5 s of CPU in every rank otherwise; FSDP2
#: pulls in DTensor), and this package. A fixed list: importing a caller's module there could
#: hang or fail every launch; the module of `fn` is imported by each rank, as under spawn.
FORK_SERVER_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "torch.distributed.fsdp",
    "torch_impl",
)


def _rank_context() -> Any:
    """Where rank processes come from: forked from a fork server that imported torch once.

    A spawned rank re-imports torch and DDP's dependencies (about 4 s of CPU each); the fork
    server imports them once per parent process and forks every rank from that clean,
    single-threaded process. Forking the caller itself would be unsafe: it may run threads
    (the harness does), and a fork copies their locks but not the threads. The server starts
    with the first launch and keeps that moment's environment: a variable set in
    ``os.environ`` after the first launch does not reach later ranks.
    """
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(FORK_SERVER_PRELOAD))
    return context


def _result_file(rank: int) -> str:
    return f"result-{rank}.pkl"


def _write_atomic(path: str, value: Any) -> None:
    with open(path + ".tmp", "wb") as f:
        pickle.dump(value, f, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(path + ".tmp", path)


def launch(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    *,
    timeout_s: float = 120.0,
    collective_timeout_s: float = 60.0,
) -> list[Any]:
    """``[fn(0, R, *args), ..., fn(R-1, R, *args)]``, each computed in its own process.

    `fn` must be a module-level function and `args` picklable. Raises RankFailedError naming the
    first rank that raised or died, or LaunchTimeoutError after `timeout_s` seconds in all.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not dist.is_available() or not dist.is_gloo_available():
        raise RuntimeError("torch.distributed with the gloo backend is required and missing")
    context = _rank_context()
    results = context.Queue()
    workdir = tempfile.mkdtemp(prefix="gradweight-launch-")
    # The job goes through a file, not the start pipe: Process.start() writes its arguments
    # into a pipe and blocks until the child reads them, so a child that dies while starting
    # (e.g. a main module without the __main__ guard) would hang the caller on a large job.
    _write_atomic(os.path.join(workdir, _JOB_FILE), (fn, tuple(args)))
    init_method = f"file://{os.path.join(workdir, 'rendezvous')}"
    processes = [
        context.Process(
            target=_worker,
            args=(rank, world_size, init_method, collective_timeout_s, workdir, results),
            name=f"gradweight-rank-{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    succeeded = False
    try:
        for process in processes:
            process.start()
        _collect(processes, results, timeout_s)
        values = []
        for rank in range(world_size):
            with open(os.path.join(workdir, _result_file(rank)), "rb") as f:
                values.append(pickle.load(f))
        succeeded = True
        return values
    finally:
        _stop(processes, graceful=succeeded)
        shutil.rmtree(workdir, ignore_errors=True)


def _collect(processes: list, results: Any, timeout_s: float) -> None:
    """Wait until every rank reported success; raise for the first failure or the deadline."""
    deadline = time.monotonic() + timeout_s
    done: set[int] = set()
    exited_at: dict[int, float] = {}
    while len(done) < len(processes):
        now = time.monotonic()
        if now >= deadline:
            raise LaunchTimeoutError([r for r in range(len(processes)) if r not in done], timeout_s)
        try:
            rank, ok, details = results.get(timeout=min(_POLL_S, deadline - now))
        except queue.Empty:
            _check_exits(processes, done, exited_at)
            continue
        if not ok:
            raise _root_cause(processes, rank, details)
        done.add(rank)


def _check_exits(processes: list, done: set[int], exited_at: dict[int, float]) -> None:
    """Fail for a rank that exited without a report once its report cannot be in flight."""
    now = time.monotonic()
    for rank, process in enumerate(processes):
        if rank in done or process.is_alive():
            continue
        if now - exited_at.setdefault(rank, now) > _EXIT_GRACE_S:
            raise RankFailedError(
                rank, f"process exited with code {process.exitcode} without reporting a result"
            )


def _root_cause(processes: list, rank: int, details: str) -> RankFailedError:
    """The failure to report when `rank` raised: a rank that died first is the cause.

    A rank killed outright (segfault, os._exit) reports nothing, and its peers then fail in
    their next collective with a connection error that would otherwise be blamed on them.
    """
    deadline = time.monotonic() + _EXIT_GRACE_S
    while True:
        for other, process in enumerate(processes):
            if other != rank and process.exitcode not in (None, 0):
                return RankFailedError(
                    other,
                    f"process exited with code {process.exitcode} without reporting a result; "
                    f"rank {rank} then failed with:\n{details}",
                )
        if not _peer_failure(details):
            return RankFailedError(rank, details)
        if time.monotonic() >= deadline:
            # A peer timed out or vanished but no rank died: one that is still running
            # (hung, or slower than the collective timeout) is the likelier cause.
            running = [r for r, p in enumerate(processes) if r != rank and p.is_alive()]
            if running:
                details += f"\n(rank(s) {', '.join(map(str, running))} still running at the time)"
            return RankFailedError(rank, details)
        time.sleep(_POLL_S)


def _peer_failure(details: str) -> bool:
    """Whether a traceback looks like the consequence of another rank going away."""
    markers = ("Connection closed by peer", "Connection reset", "Broken pipe", "Timed out")
    return any(marker.lower() in details.lower() for marker in markers)


def _stop(processes: list, *, graceful: bool, join_s: float = 10.0) -> None:
    """Join every process (within `join_s` when `graceful`); terminate, then kill, the rest."""
    deadline = time.monotonic() + (join_s if graceful else 0.0)
    for process in processes:
        if process.pid is not None:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.pid is not None and process.is_alive():
            process.terminate()
    for process in processes:
        if process.pid is not None:
            process.join(timeout=2.0)
            if process.is_alive():
                process.kill()
                process.join(timeout=1.0)
