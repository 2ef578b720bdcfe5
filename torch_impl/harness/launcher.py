"""Run a function on R real processes with a gloo process group; every wait is bounded.

``launch(fn, world_size, args)`` starts R rank processes (see "Where ranks come from" below),
joins them into a gloo process group through a ``file://`` rendezvous in a fresh temporary
directory (no port to race for), calls ``fn(rank, world_size, *args)`` on each and returns the
R results in rank order. It never hangs, and nothing it starts outlives it:

* every rank leads a process group of its own, so the launcher stops a rank by signalling its
  group: whatever the rank's code started (a data loader's workers, a ``subprocess``) goes with
  it, unless it left the group itself (``setsid``, ``start_new_session=True``). A rank may
  start children;
* the job, the results and each rank's report travel through files in a fresh temporary
  directory (the rank side: `torch_impl.harness.rank_worker`): starting a process never
  blocks on a pipe its child may not live to read, and a rank killed at any moment cannot
  leave a lock held that its peers need;
* the process group has a timeout, so a collective whose peer is gone fails on its own;
* the caller polls the reports against one deadline for the whole launch and, between polls,
  checks every process: a rank that raised reports its traceback, a rank that died without
  reporting (segfault, ``os._exit``, OOM kill, SIGKILL) is seen by its exit status, named with
  the signal that killed it;
* on the first failure ``RankFailedError`` names the rank; past the deadline
  ``LaunchTimeoutError`` names the ranks that had not reported. On every way out of `launch`
  (a result, an error, the deadline, KeyboardInterrupt) its process groups get SIGTERM, then
  SIGKILL after ``stop_grace_s`` (2 s), and are gone before it returns or raises.

Where ranks come from (`start_method`, decided at every launch): forked from the project's
zygote (`crosscheck.launch.zygote`) started with torch and DDP's dependencies imported once
(`FORK_SERVER_PRELOAD`), where the platform has what the zygote uses and
``GRADWEIGHT_NO_FORK_SERVERS`` is unset, "" or "0"; otherwise fresh interpreters that import torch
themselves. Same results, same messages, only slower. Every rank is a worker process of
`crosscheck.launch.worker_processes.start_worker` (``python -m torch_impl.harness.rank_main``,
its output in the launch's directory and copied to this process's stdout and stderr when the
launch ends), its group in the one registry of `crosscheck.launch.processes`, as JAX's workers
are. A rank finds the caller's ``sys.path`` (and a function defined in the caller's main script)
through the job file.

`crosscheck.launch.processes.terminate_all` stops every launch in flight from any thread (the
CLI calls it on Ctrl-C or SIGTERM), and the zygote; each launch then raises
`LaunchStoppedError`. `finish_rank` (re-exported from the rank side) ends the rank it is
called in at once, as if `fn` had returned: for a rank whose main thread is stuck in a
collective that a failed peer will never join.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from crosscheck.launch import processes
from crosscheck.launch.processes import GroupLeader, describe_status
from crosscheck.launch.worker_processes import process_env, start_worker
from crosscheck.launch.zygote import Zygote, ZygoteError, shared_zygote, unavailable
from torch_impl.harness import in_place, rank_worker
from torch_impl.harness.rank_worker import finish_rank as finish_rank  # re-exported

#: What the zygote of the ranks imports before it forks any: torch, and what DDP's constructor
#: and FSDP2 import on first use (torch._dynamo, about 2.5 s of CPU in every rank otherwise;
#: FSDP2 pulls in DTensor), and the rank's own module. A fixed list: importing a caller's module
#: there could hang or fail every launch; the module of `fn` is imported by each rank.
FORK_SERVER_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "torch.distributed.fsdp",
    "torch_impl",
    "torch_impl.harness.rank_worker",
)
#: What each rank runs (``python -m``).
RANK_MODULE = "torch_impl.harness.rank_main"
ZYGOTE, FRESH = "zygote", "fresh"
#: After every rank's group was signalled, how long it may take to be gone.
_KILL_WAIT_S = 2.0
#: After a rank reported a peer's failure (a closed connection, a timed-out collective), how
#: long to wait for the rank that caused it to be seen dead or to report its own error.
_EXIT_GRACE_S = 2.0
#: After every rank reported, how long each may take to leave (destroy its process group)
#: before its group is signalled like any other.
_EXIT_WAIT_S = 5.0
_POLL_S = 0.05
#: Where `launch` puts the ranks when its caller does not say: ``crosscheck run --device``
#: sets it for every launch of the run (the harness's runners need no parameter for it).
#: Spelled out here, not imported: torch_impl does not import crosscheck.
DEVICE_ENV = "GRADWEIGHT_TORCH_DEVICE"


class RankFailedError(RuntimeError):
    """A rank raised or died; `rank` is which, `details` its traceback or exit status.

    `exitcode` is the exit status of a rank that died without reporting (negative: the signal
    that killed it), None for a rank that raised.
    """

    def __init__(self, rank: int, details: str, exitcode: int | None = None) -> None:
        super().__init__(f"rank {rank} failed:\n{details}")
        self.rank = rank
        self.details = details
        self.exitcode = exitcode


class LaunchTimeoutError(TimeoutError):
    """Some ranks did not report within the launch's time limit."""

    def __init__(self, ranks: Sequence[int], timeout_s: float) -> None:
        names = ", ".join(str(r) for r in ranks)
        super().__init__(f"rank(s) {names} did not finish within {timeout_s:g} s")
        self.ranks = list(ranks)


class LaunchStoppedError(RuntimeError):
    """`terminate_all` stopped the launch's ranks (the CLI was interrupted, say)."""


# --- The launch -----------------------------------------------------------------------------


def launch(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    *,
    timeout_s: float = 120.0,
    collective_timeout_s: float = 60.0,
    stop_grace_s: float = 2.0,
    device: str | None = None,
) -> list[Any]:
    """``[fn(0, R, *args), ..., fn(R-1, R, *args)]``, each computed in its own process.

    `fn` must be a module-level function and `args` picklable. Raises RankFailedError naming the
    first rank that raised or died (promptly: within `_EXIT_GRACE_S` of the report, or of the
    death being seen), LaunchTimeoutError after `timeout_s` seconds in all, LaunchStoppedError
    when `terminate_all` stopped it. Whatever the way out, every process group it started got
    SIGTERM, then SIGKILL after `stop_grace_s`, and is gone: the call takes at most about
    ``timeout_s + stop_grace_s + 2`` s (a process in uninterruptible sleep aside).

    In a process that joined a launcher's job (`torch_impl.harness.in_place`, ``crosscheck run``
    under torchrun) no process starts: a launch of the job's world size runs in place.

    `device` is where the ranks compute: ``"cpu"`` (gloo) or ``"cuda"`` (rank r on GPU r,
    NCCL; `rank_worker.worker`); None reads `DEVICE_ENV` (``crosscheck run --device`` sets
    it), ``"cpu"`` when unset.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if in_place.active():  # this process is one rank of a launcher's job: nothing to start
        return in_place.run(fn, world_size, tuple(args), RankFailedError)
    device = device or os.environ.get(DEVICE_ENV) or "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if not dist.is_available() or not dist.is_gloo_available():
        raise RuntimeError("torch.distributed with the gloo backend is required and missing")
    if device == "cuda" and not dist.is_nccl_available():
        raise RuntimeError("device 'cuda' needs torch.distributed's NCCL backend, missing here")
    # The deadline counts from here: starting ranks (the zygote's first import of torch, or
    # every fresh rank's) is part of the launch's time.
    deadline = time.monotonic() + timeout_s
    zygote = getattr(_preloaded, "zygote", None)
    if zygote is None or not zygote.alive:
        zygote = rank_zygote()
    generation = processes.generation()
    workdir = tempfile.mkdtemp(prefix="gradweight-launch-")
    # The job goes through a file: a rank that dies while starting can block nobody.
    rank_worker.write_job(workdir, fn, tuple(args))
    init_method = f"file://{os.path.join(workdir, 'rendezvous')}"
    env, cwd = rank_env(), os.getcwd()
    leaders: list[GroupLeader] = []
    try:
        for rank in range(world_size):
            command = [sys.executable, "-m", RANK_MODULE, workdir, str(rank), str(world_size)]
            command += [init_method, repr(float(collective_timeout_s)), device]
            out, err = _output_files(workdir, rank)
            leaders.append(
                start_worker(command, stdout=out, stderr=err, env=env, cwd=cwd, zygote=zygote)
            )
        _collect(leaders, workdir, deadline, timeout_s, generation)
        values = []
        for rank in range(world_size):
            with open(os.path.join(workdir, rank_worker.result_file(rank)), "rb") as f:
                values.append(pickle.load(f))
        # Give the ranks a moment to leave their process group cleanly before the signals
        # (within the deadline: the results are in hand, the bound holds).
        exit_by = min(time.monotonic() + _EXIT_WAIT_S, deadline)
        while any(leader.poll() is None for leader in leaders) and time.monotonic() < exit_by:
            time.sleep(_POLL_S)
        return values
    finally:
        processes.stop_groups(leaders, grace_s=stop_grace_s, wait_s=_KILL_WAIT_S)
        _forward_output(workdir, len(leaders))
        shutil.rmtree(workdir, ignore_errors=True)


def start_method(env: Mapping[str, str] | None = None) -> str:
    """How a launch started now starts its ranks: forked from the zygote (``"zygote"``), or
    as fresh interpreters (``"fresh"``) where `crosscheck.launch.zygote.unavailable` says why."""
    return FRESH if unavailable(env) else ZYGOTE


def rank_env() -> dict[str, str]:
    """A rank's environment: this process's, as every worker gets it
    (`crosscheck.launch.worker_processes.process_env`: one OpenMP thread unless set, this
    repository first on ``PYTHONPATH``)."""
    return process_env()


def rank_zygote() -> Zygote | None:
    """This process's zygote of torch ranks (`FORK_SERVER_PRELOAD`), started on first use; None
    where none may run (`start_method` is then ``"fresh"``)."""
    if start_method() == FRESH:
        return None
    return shared_zygote(FORK_SERVER_PRELOAD, rank_env())


#: The zygote `preloading` set up for the launches of this thread, if any.
_preloaded = threading.local()


@contextlib.contextmanager
def preloading(modules: Sequence[str], *, timeout_s: float) -> Iterator[Zygote | None]:
    """Within the block, this thread's launches fork their ranks from a zygote that imported
    `modules` too (a user's step and model modules), forked from `rank_zygote` with the
    caller's directory and ``sys.path``: every rank then finds them imported, where each
    would import them itself (a step that imports transformers' models: 1.4 s of CPU per
    rank). The zygote lives for the block only, so a module edited between two blocks is
    imported afresh. Where it cannot start (no zygote here, a module that fails to import or
    starts a thread, more than `timeout_s` to import), the launches fork from `rank_zygote`
    as usual and each rank imports the modules, reporting what goes wrong itself. Yields the
    zygote, or None."""
    base = rank_zygote()
    forked = None
    if base is not None and modules:
        log = Path(tempfile.gettempdir()) / f"gradweight-zygote-preload-{os.getpid()}.log"
        with contextlib.suppress(ZygoteError):
            forked = Zygote.forked(
                base,
                list(dict.fromkeys(modules)),
                rank_env(),
                log,
                sys_path=[os.getcwd(), *sys.path],
                ready_timeout_s=timeout_s,
            )
    previous = getattr(_preloaded, "zygote", None)
    _preloaded.zygote = forked or previous
    try:
        yield forked
    finally:
        _preloaded.zygote = previous
        if forked is not None:
            forked.close()


def _output_files(workdir: str, rank: int) -> tuple[Path, Path]:
    return Path(workdir, f"rank{rank}.out"), Path(workdir, f"rank{rank}.err")


def _forward_output(workdir: str, world_size: int) -> None:
    """What each rank printed, onto this process's stdout and stderr, rank by rank: a rank's
    output lands in a file while it runs (a worker never writes to a pipe it may block on)."""
    for rank in range(world_size):
        streams = (sys.stdout, sys.stderr)
        for path, stream in zip(_output_files(workdir, rank), streams, strict=True):
            try:
                text = path.read_text(errors="replace")
            except OSError:
                continue
            if text:
                stream.write(text)
                stream.flush()


def _read_reports(workdir: str, reports: dict[int, rank_worker.Report], world_size: int) -> None:
    """Add the reports written since the last call to `reports` (rank -> report)."""
    for rank in range(world_size):
        if rank in reports:
            continue
        path = os.path.join(workdir, rank_worker.report_file(rank))
        if os.path.exists(path):
            with open(path, "rb") as f:
                reports[rank] = pickle.load(f)


def _dead_silent(
    leaders: Sequence[GroupLeader], reports: dict[int, rank_worker.Report], workdir: str
) -> int | None:
    """The first rank that exited without a report (checked after its exit: no race)."""
    for rank, leader in enumerate(leaders):
        if rank in reports or leader.poll() is None:
            continue
        _read_reports(workdir, reports, len(leaders))  # written before it exited, if at all
        if rank not in reports:
            return rank
    return None


def _collect(
    ranks: Sequence[GroupLeader],
    workdir: str,
    deadline: float,
    timeout_s: float,
    generation: int,
) -> None:
    """Wait until every rank reported success; raise for the first failure or the deadline."""
    reports: dict[int, rank_worker.Report] = {}
    while True:
        _read_reports(workdir, reports, len(ranks))
        if len(reports) == len(ranks) and all(report.ok for report in reports.values()):
            return
        if processes.generation() != generation:  # stopped: whatever failed, failed so
            raise LaunchStoppedError("the launch was stopped by terminate_all()")
        if any(not report.ok for report in reports.values()):
            raise _root_cause(ranks, workdir, reports)
        dead = _dead_silent(ranks, reports, workdir)
        if dead is not None:
            exitcode = ranks[dead].poll()
            raise RankFailedError(
                dead, f"process {describe_status(exitcode)} without reporting a result", exitcode
            )
        now = time.monotonic()
        if now >= deadline:
            raise LaunchTimeoutError([r for r in range(len(ranks)) if r not in reports], timeout_s)
        time.sleep(min(_POLL_S, deadline - now))


def _root_cause(
    ranks: Sequence[GroupLeader], workdir: str, reports: dict[int, rank_worker.Report]
) -> RankFailedError:
    """The failure to report once some rank reported one: a rank that died first is the cause.

    A rank killed outright (segfault, SIGKILL) reports nothing, and its peers then fail in
    their next collective with a connection error that would otherwise be blamed on them; a
    rank that reports a peer's absence is blamed only when no other cause shows up within
    `_EXIT_GRACE_S`.
    """
    deadline = time.monotonic() + _EXIT_GRACE_S
    while True:
        failed = sorted(
            (report.written_at, rank) for rank, report in reports.items() if not report.ok
        )
        first = failed[0][1]
        dead = _dead_silent(ranks, reports, workdir)
        if dead is not None:
            exitcode = ranks[dead].poll()
            return RankFailedError(
                dead,
                f"process {describe_status(exitcode)} without reporting a result; "
                f"rank {first} then failed with:\n{reports[first].details}",
                exitcode,
            )
        causes = [rank for _, rank in failed if not _peer_failure(reports[rank].details)]
        if causes:
            return RankFailedError(causes[0], reports[causes[0]].details)
        if time.monotonic() >= deadline:
            # A peer timed out or vanished but no rank died: one that is still running
            # (hung, or slower than the collective timeout) is the likelier cause.
            details = reports[first].details
            running = [r for r, p in enumerate(ranks) if r not in reports and p.poll() is None]
            if running:
                details += f"\n(rank(s) {', '.join(map(str, running))} still running at the time)"
            return RankFailedError(first, details)
        time.sleep(_POLL_S)
        _read_reports(workdir, reports, len(ranks))


def _peer_failure(details: str) -> bool:
    """Whether a traceback looks like the consequence of another rank going away."""
    markers = ("Connection closed by peer", "Connection reset", "Broken pipe", "Timed out")
    return any(marker.lower() in details.lower() for marker in markers)
