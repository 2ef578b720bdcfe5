"""Time and peers on a rank of `torch_impl.harness.user_step.run_user_steps`, and where its step is.

This module is what ends a rank that must not go on: the deadline the ranks agree on, the
watchdog that dumps a rank's stack and ends it when the deadline passes in a job, and the
watcher that ends a rank still in the step after a peer failed; with the files through which
the ranks and the harness learn of it, and the reading of a stack as the user's own frames.

Time: the ranks agree on one deadline, ``min(hard_deadline, ready + budget_s)``
(`agree_deadline`), and every job, with the wait for the peers' outcomes after it
(`wait_for_peers`), must end by then, or the watchdog (`watchdog`) dumps the rank's stack to
``job{i}-rank{r}.watchdog`` and ends it.

A failed job ends the launch: one rank may have raised while another waits in a collective it
will never complete, and a gloo collective cannot be woken before the group's timeout (not
even by destroying the group while a DDP reducer holds it). So each rank runs a watcher
thread (`PeerWatcher`): when a peer's outcome for the current job is an error and this rank has
written none ``PEER_GRACE_S`` later, the watcher writes this rank's outcome ("stopped", with
where the step was) and ends the rank through ``launcher.finish_rank``.
"""

from __future__ import annotations

import faulthandler
import functools
import os
import pickle
import re
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from torch_impl.harness.rank_worker import finish_rank, write_atomic, write_pickle

if TYPE_CHECKING:
    from torch_impl.harness.user_step import RankOutcome

#: How long after a peer's failure a rank still in the job may take to write its own outcome
#: (a step that fails alike on every rank then reports every rank's own error) before the
#: watcher stops it.
PEER_GRACE_S = 0.5
#: After the deadline, how long a rank waits for its peers' outcomes before it gives up (its
#: watchdog ends it at the deadline; this only bounds a wait the watchdog did not cover).
_PEER_WAIT_GRACE_S = 5.0
_POLL_S = 0.01
_WATCH_POLL_S = 0.05
_WATCHDOG_HEADER = "# gradweight watchdog:"


def outcome_path(status_dir: str, index: int, rank: int) -> str:
    return os.path.join(status_dir, f"job{index}-rank{rank}.pkl")


def watchdog_path(status_dir: str, index: int, rank: int) -> str:
    return os.path.join(status_dir, f"job{index}-rank{rank}.watchdog")


def failed_path(status_dir: str, index: int, rank: int) -> str:
    return os.path.join(status_dir, f"job{index}-rank{rank}.failed")


def ready_path(status_dir: str) -> str:
    return os.path.join(status_dir, "ready.txt")


@dataclass(frozen=True, slots=True)
class WatchdogDump:
    """What the watchdog left when the deadline passed in a job: when, and where the step was."""

    #: ``time.monotonic()`` when the job started on this rank, and the deadline it had.
    started: float
    deadline: float
    #: The user's frames (innermost last), or a line saying there was none.
    frames: str


def read_watchdog(status_dir: str, index: int, rank: int) -> WatchdogDump | None:
    """The watchdog's dump of job `index` on `rank`, or None when it did not fire there."""
    try:
        with open(watchdog_path(status_dir, index, rank)) as f:
            text = f.read()
    except OSError:
        return None
    header, _, dump = text.partition("\n")
    # faulthandler's dump_traceback_later starts with "Timeout (h:mm:ss)!".
    if not header.startswith(_WATCHDOG_HEADER) or not dump.startswith("Timeout ("):
        return None
    times = dict(field.split("=", 1) for field in header.removeprefix(_WATCHDOG_HEADER).split())
    return WatchdogDump(
        float(times["started"]), float(times["deadline"]), describe_watchdog_dump(dump)
    )


@functools.cache
def _internal_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    # torch_impl as a whole: the reference's frames (update, schemes) are not the user's either.
    package = os.path.dirname(os.path.dirname(__file__))
    dirs = {os.path.dirname(torch.__file__), package}
    dirs |= {paths["stdlib"], paths["platstdlib"]}
    return tuple(os.path.join(os.path.abspath(d), "") for d in dirs)


def is_user_file(filename: str) -> bool:
    """Whether a frame is the user's code, not torch, the standard library or this harness."""
    if filename.startswith("<"):
        return False
    return not os.path.abspath(filename).startswith(_internal_dirs())


def frame_line(filename: str, lineno: int | str, name: str) -> str:
    relative = os.path.relpath(filename)  # short under the working directory, else absolute
    return (
        f'  File "{filename if relative.startswith("..") else relative}", line {lineno}, in {name}'
    )


_DUMP_FRAME = re.compile(r'File "(?P<file>.+)", line (?P<line>\d+) in (?P<name>.+)')


_DUMP_THREAD = re.compile(r"^(?:Current thread|Thread) 0x", re.MULTILINE)


def describe_watchdog_dump(dump: str) -> str:
    """The user's frames in a faulthandler dump, thread by thread, innermost last.

    faulthandler writes each thread's frames innermost first; they are turned around to read
    like every other traceback here.
    """
    frames = []
    for thread in _DUMP_THREAD.split(dump):
        frames += reversed(
            [
                frame_line(m["file"], m["line"], m["name"])
                for m in _DUMP_FRAME.finditer(thread)
                if is_user_file(m["file"])
            ]
        )
    return "\n".join(frames) if frames else "  (no frame of the user's code on the stack)"


@contextmanager
def watchdog(path: str, deadline: float) -> Iterator[None]:
    """End this process at `deadline` (monotonic), dumping every thread's stack to `path` first.

    faulthandler's timer is a C thread that needs no GIL, so it fires in a ``time.sleep``, a
    busy Python loop or a blocked native call alike; ending the rank lets the launcher see
    it exit and stop the launch, where an exception could not interrupt the step. The file
    starts with a header line (when the job started, and the deadline) for the harness.
    """
    with open(path, "w") as dump:
        started = time.monotonic()
        dump.write(f"{_WATCHDOG_HEADER} started={started!r} deadline={deadline!r}\n")
        dump.flush()  # before faulthandler writes to the same descriptor
        faulthandler.dump_traceback_later(max(deadline - started, 1e-3), exit=True, file=dump)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()


def main_thread_frames() -> str:
    """Where the main thread is, as the user's frames (innermost last), or a line saying so."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    lines = []
    for summary in traceback.extract_stack(frame) if frame is not None else []:
        if is_user_file(summary.filename):
            lines.append(frame_line(summary.filename, summary.lineno or "?", summary.name))
            if summary.line:
                lines.append(f"    {summary.line}")
    return "\n".join(lines) if lines else "  (no frame of the user's code on the stack)"


class PeerWatcher:
    """Ends this rank when a peer failed the job this rank is still running (see module doc).

    `begin` marks a job as running here, `publish` writes this rank's outcome (and ends the
    watch for it); the watcher thread, under the same lock, writes a STOPPED outcome instead
    when a peer's ``.failed`` marker for that job has been there `PEER_GRACE_S`, and ends the
    process. One daemon thread per rank, polling every 50 ms while a job runs.
    """

    def __init__(
        self,
        status_dir: str,
        rank: int,
        world_size: int,
        stopped: Callable[[str], RankOutcome],
    ) -> None:
        self.status_dir = status_dir
        self.rank = rank
        #: This rank's STOPPED outcome, from the message saying why and where.
        self.stopped = stopped
        self.peers = [r for r in range(world_size) if r != rank]
        self.lock = threading.Lock()
        self.index: int | None = None
        if self.peers:
            threading.Thread(
                target=self._watch, name="gradweight-peer-watcher", daemon=True
            ).start()

    def begin(self, index: int) -> None:
        with self.lock:
            self.index = index

    def publish(self, index: int, outcome: RankOutcome) -> None:
        with self.lock:
            self._write(index, outcome)
            self.index = None

    def _write(self, index: int, outcome: RankOutcome) -> None:
        write_pickle(outcome_path(self.status_dir, index, self.rank), outcome)
        if outcome.error:  # after the outcome: a peer that sees the marker can read it
            with open(failed_path(self.status_dir, index, self.rank), "w") as f:
                f.write(outcome.kind)

    def _failed_peers(self, index: int) -> list[int]:
        return [r for r in self.peers if os.path.exists(failed_path(self.status_dir, index, r))]

    def _watch(self) -> None:
        first_seen: tuple[int, float] | None = None  # (job, when a peer's failure was seen)
        while True:
            time.sleep(_WATCH_POLL_S)
            index = self.index
            failed = [] if index is None else self._failed_peers(index)
            if index is None or not failed:
                first_seen = None
                continue
            if first_seen is None or first_seen[0] != index:
                first_seen = (index, time.monotonic())
            if time.monotonic() - first_seen[1] < PEER_GRACE_S:
                continue
            with self.lock:
                if self.index != index:  # this rank's own outcome landed meanwhile
                    continue
                error = (
                    f"was stopped while still in the step, after rank {failed[0]} failed; "
                    f"it was at:\n{main_thread_frames()}"
                )
                self._write(index, self.stopped(error))
                # Ends the process holding the lock; the launch counts this rank as done.
                finish_rank(index + 1)


def wait_for_peers(
    status_dir: str, label: str, index: int, world_size: int, deadline: float
) -> list[RankOutcome]:
    """Every rank's outcome of job `index` (`label` names it), once all are written."""
    paths = [outcome_path(status_dir, index, r) for r in range(world_size)]
    while True:
        missing = [r for r, p in enumerate(paths) if not os.path.exists(p)]
        if not missing:
            break
        if time.monotonic() > deadline + _PEER_WAIT_GRACE_S:
            raise TimeoutError(
                f"{label}: rank(s) {', '.join(map(str, missing))} reported nothing by the deadline"
            )
        time.sleep(_POLL_S)
    outcomes = []
    for path in paths:
        with open(path, "rb") as f:
            outcomes.append(pickle.load(f))
    return outcomes


def agree_deadline(status_dir: str, rank: int, hard_deadline: float, budget_s: float) -> float:
    """One deadline on every rank: the latest rank's ready time plus the budget, capped.

    Agreed through a MAX all-reduce so that every rank's watchdog fires at the same moment:
    a rank whose watchdog fired first would bring the launch down before the others dumped
    where they were.
    """
    ready = torch.tensor([time.monotonic()], dtype=torch.float64)
    dist.all_reduce(ready, op=dist.ReduceOp.MAX)
    start = float(ready.item())
    if rank == 0:
        write_atomic(ready_path(status_dir), repr(start).encode())
    return min(hard_deadline, start + budget_s)
