"""Every process a command starts, and stopping it: one registry of process groups, one
terminator, and Ctrl-C / SIGTERM as one line, not a traceback.

Every worker a launch starts (a JAX worker, a ``jax.distributed`` process, a torch rank; see
`crosscheck.launch.worker_processes.start_worker`) leads a process group of its own (a new
session: ``start_new_session=True``, or ``setsid`` in a child forked by a zygote,
`crosscheck.launch.zygote`), and what a worker starts (a data loader's workers, a user's
``subprocess``) stays in that group: killing the group kills them all. The group is registered
here until it is known to be gone, and so is every zygote, as a server:

- `stop_groups` stops given groups: a launch stops its own on every way out;
- `terminate_all` stops every registered group (SIGTERM, then SIGKILL after a grace): workers
  first, then any other child of a zygote (a worker forked while its launch was being
  interrupted, before the launch learned its pid), then the zygotes. The CLI calls it on
  Ctrl-C or SIGTERM (`handle_signals`), and each launch in flight then fails as stopped:
  `generation` changes.

A killed group is waited for until no live process is left in it (zombies count as gone: on
Linux the process table is read from /proc; elsewhere ``killpg(pgid, 0)``), for a bounded time;
a SIGKILL that has not landed by then is left to the OS.

`handle_signals` is what `crosscheck.cli.commands.main` runs a command in: SIGTERM becomes the
same KeyboardInterrupt as Ctrl-C (raised in the main thread), and on the way out of an interrupt
every started process is stopped and one line goes to stderr. `exit_bounded` then ends the
interpreter in bounded time even where a worker thread (`crosscheck.launch.schedule.run_jobs`
starts non-daemon ones, which the interpreter would wait for at exit) is still winding down.

The standard library only: the torch and JAX harnesses, their worker processes and the zygote
import this module, and none of them may pay for more.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import NoReturn, Protocol

#: How long `terminate_all` gives the process groups between SIGTERM and SIGKILL.
GRACE_S = 2.0
#: `terminate_all`: how long to wait for the groups after the SIGKILL that follows the grace.
TERMINATE_KILL_WAIT_S = 2.0
#: How long `exit_bounded` waits for worker threads before it ends the process regardless,
#: and how often it stops processes again meanwhile.
THREAD_WAIT_S = 1.5
ROUND_S = 0.25
#: The grace of `exit_bounded`'s last `terminate_all`: the interrupt's own call gave every
#: process it knew GRACE_S already; this one is for processes started since.
FINAL_GRACE_S = 0.25
#: How often a wait for killed groups looks again.
_GONE_POLL_S = 0.01


# ---- the registry ----------------------------------------------------------------------------


class GroupLeader(Protocol):
    """What the registry needs of a group leader: `subprocess.Popen`, or a zygote's child
    (`crosscheck.launch.zygote.ZygoteChild`)."""

    pid: int

    def poll(self) -> int | None: ...


# Re-entrant: terminate_all may run in a signal handler that interrupted this very thread
# while it held the lock to register a group.
_registry_lock = threading.RLock()
#: pgid (= the leader's pid) -> (leader, whether it is a server that forks workers), for every
#: group that may still hold a live process.
_registry: dict[int, tuple[GroupLeader, bool]] = {}
#: Bumped by terminate_all: a launch that sees it change was stopped, not failed.
_generation = 0


def register_group(leader: GroupLeader, *, server: bool = False) -> None:
    """Remember `leader`'s process group until it is known to be gone (see `terminate_all`).

    A `server` (a zygote) forks workers: `terminate_all` stops it after the workers, so that it
    can still reap them and report how they ended.
    """
    with _registry_lock:
        _registry[leader.pid] = (leader, server)


def forget_group(leader: GroupLeader) -> None:
    """Stop tracking `leader`'s group (its processes are gone)."""
    with _registry_lock:
        entry = _registry.get(leader.pid)
        if entry is not None and entry[0] is leader:
            del _registry[leader.pid]


def registered_groups() -> list[int]:
    """The pgids of every group still registered (for tests and diagnostics)."""
    with _registry_lock:
        return sorted(_registry)


def generation() -> int:
    """A number `terminate_all` changes: a launch that sees it change was stopped."""
    return _generation


def pid_alive(pid: int) -> bool:
    """Whether `pid` runs; a zombie does not (init may never reap an orphan of a zygote)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):  # no /proc (macOS), or it exited meanwhile
        return True


def _process_table() -> dict[int, tuple[bytes, int, int]] | None:
    """pid -> (state, parent, process group) of every process on the machine, or None where
    /proc cannot tell."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    table = {}
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # exited while we looked
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
        fields = stat.rsplit(b")", 1)[-1].split()
        if len(fields) > 2:
            table[int(name)] = (fields[0], int(fields[1]), int(fields[2]))
    return table


def _live_groups() -> set[int] | None:
    """The pgid of every live process on the machine, or None where /proc cannot tell.

    A zombie counts as gone: its exit status is all that is left of it (here, PID 1 may not
    reap orphans at all, so a killed worker's children can stay zombies for ever).
    """
    table = _process_table()
    if table is None:
        return None
    return {group for state, _, group in table.values() if state not in (b"Z", b"X")}


def _alive(leaders: Iterable[GroupLeader]) -> list[GroupLeader]:
    """The leaders whose group is not gone yet: the leader's exit status is not known (for a
    worker forked by a zygote, until the zygote has reaped it), or a live process is left in
    the group (what the leader started)."""
    leaders = list(leaders)
    running = {id(leader) for leader in leaders if leader.poll() is None}  # reaps ours
    table = _live_groups()
    alive = []
    for leader in leaders:
        if id(leader) in running:
            alive.append(leader)
        elif table is not None:
            if leader.pid in table:
                alive.append(leader)
        else:
            try:
                os.killpg(leader.pid, 0)
            except ProcessLookupError:
                continue
            except PermissionError:
                pass
            alive.append(leader)
    return alive


def _signal_group(leader: GroupLeader, signum: int) -> bool:
    """Send `signum` to `leader`'s group; True when it reached a process."""
    reached = False
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(leader.pid, signum)
        reached = True
    if leader.poll() is None:
        # Still running and not yet reaped, so the pid is still this leader's: reach it even
        # if it were not (yet) the leader of its group.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(leader.pid, signum)
            reached = True
    return reached


def _wait_gone(leaders: Sequence[GroupLeader], timeout_s: float) -> list[GroupLeader]:
    """Wait until no group of `leaders` holds a live process, at most `timeout_s`; returns
    the leaders of the groups still alive then."""
    deadline = time.monotonic() + timeout_s
    alive = _alive(leaders)
    while alive and time.monotonic() < deadline:
        time.sleep(_GONE_POLL_S)
        alive = _alive(alive)
    return alive


def stop_groups(leaders: Iterable[GroupLeader], *, grace_s: float = 0.0, wait_s: float) -> int:
    """Stop the process groups of `leaders`; returns how many groups it signalled.

    With `grace_s` > 0: SIGTERM, up to `grace_s` for the groups to exit, then SIGKILL to what
    is left; with 0: SIGKILL at once. Then waits up to `wait_s` for every group to be gone and
    forgets the ones that are. At most ``grace_s + wait_s`` (plus a /proc scan) in all.
    Interrupted (KeyboardInterrupt) during the grace, it still sends the SIGKILL first.
    """
    leaders = list(leaders)
    alive = _alive(leaders)
    first = signal.SIGTERM if grace_s > 0 else signal.SIGKILL
    signalled = sum(_signal_group(leader, first) for leader in alive)
    if grace_s > 0 and alive:
        left = alive
        try:
            left = _wait_gone(alive, grace_s)
        finally:
            for leader in left:
                _signal_group(leader, signal.SIGKILL)
    left = _wait_gone(alive, wait_s) if alive else []
    for leader in leaders:
        if leader not in left:
            forget_group(leader)
    return signalled


@dataclass(frozen=True, slots=True)
class _Orphan:
    """A child of a zygote that no launch registered: its pid stands for its group."""

    pid: int

    def poll(self) -> int | None:
        """None while the process runs; not ours to reap, so its exit status is unknown (-1)
        once it is gone or a zombie (what is left in its group `_alive` reads from /proc)."""
        return None if pid_alive(self.pid) else -1


def _unregistered_children(servers: Sequence[GroupLeader], known: set[int]) -> list[_Orphan]:
    """The live children of `servers` (Linux) that are not in `known` (the registered groups):
    a worker forked while its launch was being interrupted, before the launch learned its pid."""
    table = _process_table() or {}
    pids = {server.pid for server in servers}
    return [
        _Orphan(pid)
        for pid, (state, parent, _) in table.items()
        if parent in pids and pid not in known and state not in (b"Z", b"X")
    ]


def terminate_all(grace_s: float = GRACE_S) -> int:
    """Stop every process group this process registered; returns how many groups it
    signalled.

    Each group is a worker, with everything it started, or a zygote. Workers first: SIGTERM to
    each group, up to `grace_s` for them to exit, SIGKILL to what is left, then up to
    `TERMINATE_KILL_WAIT_S` until they are gone (reaping the ones that are ours); then any
    other child of a zygote the same way (before its zygote goes: an orphan could no longer be
    told from anyone else's process); then the zygotes (a zygote exits on SIGTERM at once). At
    most ``grace_s + 2 s`` for each round; a worker that exits on SIGTERM makes its round last
    milliseconds. Idempotent, safe to call from any thread while other threads wait on these
    processes (their launches see `generation` change, or the workers die, and raise), never
    raises, and imports nothing: a command that never launched anything has nothing to stop.
    """
    global _generation
    signalled = 0
    try:
        with _registry_lock:
            entries = list(_registry.values())
            _generation += 1
        workers = [leader for leader, server in entries if not server]
        servers = [leader for leader, server in entries if server]
        signalled += stop_groups(workers, grace_s=grace_s, wait_s=TERMINATE_KILL_WAIT_S)
        # A zygote forked from another is registered (a server), not an orphan of its parent.
        orphans = _unregistered_children(servers, {leader.pid for leader, _ in entries})
        signalled += stop_groups(orphans, grace_s=grace_s, wait_s=TERMINATE_KILL_WAIT_S)
        signalled += stop_groups(servers, grace_s=grace_s, wait_s=TERMINATE_KILL_WAIT_S)
    except Exception:  # a signal handler's last resort must not fail the way out
        pass
    return signalled


def describe_status(returncode: int | None) -> str:
    """An exit status in words: "exited with code 3", "was killed by SIGKILL (signal 9)"."""
    if returncode is None:
        return "was still running (killed)"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "an unknown signal"
        return f"was killed by {name} (signal {-returncode})"
    return f"exited with code {returncode}"


# ---- signals ---------------------------------------------------------------------------------


@dataclass
class Interruption:
    """What `handle_signals` saw: the signal that interrupted the command ('' when none)."""

    signal_name: str = ""
    #: Processes still running at the interrupt, stopped by `terminate_all`.
    stopped: int = 0

    @property
    def interrupted(self) -> bool:
        return bool(self.signal_name)

    def message(self, prog: str = "crosscheck") -> str:
        """The one line printed on stderr."""
        if self.stopped:
            plural = "es" if self.stopped != 1 else ""
            what = f"stopped {self.stopped} process{plural} it had started"
        else:
            what = "no process it started is left running"
        return f"{prog}: interrupted by {self.signal_name}; {what}"


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    # Python delivers signals to the main thread: raising here unwinds the command exactly as
    # Ctrl-C does, through every launcher's `finally`.
    raise KeyboardInterrupt(signal.Signals(signum).name)


def interrupt_on_sigterm() -> None:
    """From now on SIGTERM raises KeyboardInterrupt("SIGTERM") in the main thread, as Ctrl-C
    does (main thread only; `handle_signals` does this for the length of a command)."""
    signal.signal(signal.SIGTERM, _raise_interrupt)


@contextlib.contextmanager
def handle_signals(prog: str = "crosscheck") -> Iterator[Interruption]:
    """Run a command with SIGTERM handled like Ctrl-C; an interrupt ends the `with` quietly.

    Inside the block, SIGTERM raises KeyboardInterrupt in the main thread. A KeyboardInterrupt
    out of the block is not re-raised: every process the launchers started is stopped
    (`terminate_all`), one line goes to stderr, and the yielded `Interruption` says what
    happened, so that the caller returns `crosscheck.exit_codes.INTERRUPTED`. Further SIGINT
    and SIGTERM are ignored while processes are being stopped (a second Ctrl-C must not leave
    them half-stopped); the previous handlers are restored on the way out. Outside the main
    thread signals cannot be handled: there only the interrupt is caught.
    """
    interruption = Interruption()
    main_thread = threading.current_thread() is threading.main_thread()
    previous: dict[signal.Signals, object] = {}
    if main_thread:
        previous[signal.SIGTERM] = signal.getsignal(signal.SIGTERM)
        previous[signal.SIGINT] = signal.getsignal(signal.SIGINT)
        signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        yield interruption
    except KeyboardInterrupt as error:
        name = str(error.args[0]) if error.args and str(error.args[0]).startswith("SIG") else ""
        interruption.signal_name = name or "SIGINT"
        if main_thread:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        interruption.stopped = terminate_all()
        print(interruption.message(prog), file=sys.stderr, flush=True)
    finally:
        for signum, handler in previous.items():
            # A handler installed from C reads as None and cannot be set back: default then.
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)  # type: ignore[arg-type]


#: What `close_at_exit` was given, for `exit_bounded` to run where it ends with ``os._exit``.
_closers: list[Callable[[], None]] = []


def close_at_exit(close: Callable[[], None]) -> None:
    """Run `close` (a zygote's: it removes its empty log and its folder) when this process
    exits: at interpreter exit, and also before `exit_bounded`'s ``os._exit``, which skips
    atexit. `close` must be idempotent and bounded in time."""
    _closers.append(close)
    atexit.register(close)


def exit_bounded(code: int, wait_s: float = THREAD_WAIT_S) -> NoReturn:
    """Exit with `code` in bounded time, whatever worker threads still do.

    For the command-line process only (never from a library call): the interpreter waits for
    every non-daemon thread at exit, and a harness thread may still be waiting on a process
    that was just killed, or be starting one (a launch that was under way at the interrupt).
    For up to `wait_s` the threads are given time to end (and to remove their temporary
    folders) while processes are stopped again every `ROUND_S`, with a short grace: each
    round stops what a thread started since the last. Then one last round, and if a thread
    is still alive the process ends at once (``os._exit``).
    """
    deadline = time.monotonic() + wait_s
    current = threading.current_thread()

    def running() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t is not current and not t.daemon]

    while (threads := running()) and time.monotonic() < deadline:
        threads[0].join(min(ROUND_S, max(0.0, deadline - time.monotonic())))
        terminate_all(grace_s=FINAL_GRACE_S)
    terminate_all(grace_s=FINAL_GRACE_S)
    if any(t.is_alive() for t in running()):
        for close in reversed(_closers):  # what atexit would have run: files left behind
            with contextlib.suppress(Exception):
                close()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)
    sys.exit(code)


def usable_cores() -> list[int]:
    """The CPU cores this process may run on, in order (a cgroup or taskset may give fewer than
    the machine's); where the platform cannot say (no ``sched_getaffinity``), the first
    ``os.cpu_count()``. Never empty."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))
