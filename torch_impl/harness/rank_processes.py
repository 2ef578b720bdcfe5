"""Where the launcher's rank processes come from, and how every one of them is stopped.

This module starts the processes `torch_impl.harness.launcher.launch` runs its ranks in, keeps a
registry of their process groups while a launch may still need them, and ends them: a group at
a time (`stop`), or everything in flight at once (`terminate_all`, with the servers the launches
started). `start_method` picks, at every launch, one of two ways to start a rank:

* ``"forkserver"``: forked from this module's own fork server (`_SERVER`), which imported torch
  and DDP's dependencies once (`FORK_SERVER_PRELOAD`); a rank starts in a fraction of a second.
  Used where the platform has what it needs (``os.fork`` and multiprocessing's forkserver start
  method, see `platform_unsupported`) unless the environment variable
  ``GRADWEIGHT_NO_FORK_SERVERS`` is set to anything but "" or "0" (the project's switch for
  every fork server, read at every launch; the JAX zygote honours it too).
* ``"spawn"``: otherwise, each rank is a fresh interpreter (multiprocessing's spawn context) that
  imports torch itself: seconds of CPU per rank, in every launch. Slower, not different: the
  same target, process groups, registry, messages and results.

Every rank leads a process group of its own (a forked rank calls ``os.setsid()`` first thing, a
spawned one before its first import), so killing the group also kills whatever the rank
started, unless it left the group itself.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import multiprocessing
import multiprocessing.forkserver as mp_forkserver
import multiprocessing.popen_forkserver as mp_popen_forkserver
import multiprocessing.popen_spawn_posix as mp_popen_spawn_posix
import multiprocessing.process as mp_process
import multiprocessing.resource_tracker as mp_resource_tracker
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing import context as mp_context
from multiprocessing import reduction as mp_reduction
from multiprocessing import spawn as mp_spawn
from multiprocessing import util as mp_util
from typing import Any

#: Set to anything but "" or "0", no fork server is used: spawned ranks instead.
NO_FORK_SERVERS_ENV = "GRADWEIGHT_NO_FORK_SERVERS"
FORKSERVER, SPAWN = "forkserver", "spawn"
#: After SIGKILL, how long a group may take to vanish (the kernel tears processes down).
KILL_WAIT_S = 2.0
_POLL_S = 0.05
_LOCK_WAIT_S = 1.0


def platform_unsupported() -> str:
    """Why this platform cannot run the fork server ('' when it can)."""
    if not hasattr(os, "fork"):
        return "this platform lacks os.fork"
    if FORKSERVER not in multiprocessing.get_all_start_methods():
        return "this platform lacks multiprocessing's forkserver start method"
    return ""


def unavailable(env: Mapping[str, str] | None = None) -> str:
    """Why no fork server may be used here ('' when one may): the switch, or the platform."""
    switch = (os.environ if env is None else env).get(NO_FORK_SERVERS_ENV, "")
    if switch not in ("", "0"):
        return f"fork servers are turned off ({NO_FORK_SERVERS_ENV}={switch})"
    return platform_unsupported()


def start_method(env: Mapping[str, str] | None = None) -> str:
    """How a launch started now starts its ranks: ``"forkserver"``, or ``"spawn"``."""
    return SPAWN if unavailable(env) else FORKSERVER


# --- The fork server ------------------------------------------------------------------------

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

#: This module's own fork server, not multiprocessing's global one: its preload list is set
#: without touching the caller's multiprocessing state, and `terminate_all` stops only a server
#: that a launch started. The server imports torch once per parent process and forks every
#: rank from that clean, single-threaded process. Forking the caller itself would be unsafe: it
#: may run threads (the harness does), and a fork copies their locks but not the threads. The
#: server starts with the first launch that uses it and keeps that moment's environment: a
#: variable set in ``os.environ`` after it started does not reach later ranks.
_SERVER = mp_forkserver.ForkServer()
_SERVER.set_forkserver_preload(list(FORK_SERVER_PRELOAD))


def _pickled(popen: Any, process_obj: Any) -> io.BytesIO:
    """What a child of multiprocessing reads first: the preparation data, then the process."""
    buf = io.BytesIO()
    mp_context.set_spawning_popen(popen)
    try:
        mp_reduction.dump(mp_spawn.get_preparation_data(process_obj._name), buf)
        mp_reduction.dump(process_obj, buf)
    finally:
        mp_context.set_spawning_popen(None)
    return buf


class _RankPopen(mp_popen_forkserver.Popen):
    """multiprocessing's forkserver Popen (Python 3.11), asking `_SERVER` for the fork."""

    def _launch(self, process_obj: Any) -> None:
        buf = _pickled(self, process_obj)
        self.sentinel, w = _SERVER.connect_to_new_process(self._fds)
        # As multiprocessing does: a duplicate of the data pipe's write end is the parent's
        # sentinel for the child.
        parent_w = os.dup(w)
        self.finalizer = mp_util.Finalize(self, mp_util.close_fds, (parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = mp_forkserver.read_signed(self.sentinel)


class _RankProcess(mp_process.BaseProcess):
    """A process forked from `_SERVER`."""

    _start_method = FORKSERVER

    @staticmethod
    def _Popen(process_obj: Any) -> _RankPopen:  # noqa: N802 (multiprocessing's name)
        return _RankPopen(process_obj)


# --- The spawn fallback ---------------------------------------------------------------------


def _in_new_session(command: list[str]) -> list[str]:
    """multiprocessing's spawn command line, with ``os.setsid()`` as the child's first statement.

    Before it, a spawned rank would stay in the caller's process group for the seconds its
    imports take, and a Ctrl-C in the terminal would print its KeyboardInterrupt traceback.
    """
    if "-c" in command:  # not a frozen executable: the program follows -c
        at = command.index("-c") + 1
        command[at] = f"import os; os.setsid(); {command[at]}"
    return command


class _SpawnPopen(mp_popen_spawn_posix.Popen):
    """multiprocessing's spawn Popen (Python 3.11), its child leading a session of its own."""

    def _launch(self, process_obj: Any) -> None:
        tracker_fd = mp_resource_tracker.getfd()
        self._fds.append(tracker_fd)
        buf = _pickled(self, process_obj)
        parent_r, child_w = os.pipe()
        child_r, parent_w = os.pipe()
        self.finalizer = mp_util.Finalize(self, mp_util.close_fds, (parent_r, parent_w))
        try:
            command = mp_spawn.get_command_line(tracker_fd=tracker_fd, pipe_handle=child_r)
            self._fds.extend([child_r, child_w])
            executable = mp_spawn.get_executable()
            self.pid = mp_util.spawnv_passfds(executable, _in_new_session(command), self._fds)
            self.sentinel = parent_r
            with open(parent_w, "wb", closefd=False) as f:
                f.write(buf.getbuffer())
        finally:
            os.close(child_r)
            os.close(child_w)


class _SpawnedRankProcess(mp_context.SpawnProcess):
    """A process of multiprocessing's spawn context, started by `_SpawnPopen`."""

    @staticmethod
    def _Popen(process_obj: Any) -> _SpawnPopen:  # noqa: N802 (multiprocessing's name)
        return _SpawnPopen(process_obj)


def new_process(
    method: str, target: Callable[..., Any], args: tuple, name: str
) -> mp_process.BaseProcess:
    """A rank process, not started yet, that `method` (see `start_method`) will start.

    Not daemonic: a daemonic process may not start children, and `stop` ends ranks itself.
    """
    kind = _RankProcess if method == FORKSERVER else _SpawnedRankProcess
    return kind(target=target, args=args, name=name, daemon=False)


# --- Who owns which process -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Group:
    """A rank's process group: its leader's pid, and when that process started (Linux)."""

    pid: int
    #: /proc/<pid>/stat's start time, or None where there is no /proc: tells the rank from a
    #: later process that reused its pid.
    started: int | None


_registry_lock = threading.Lock()
#: Groups of launches in flight (pid -> group), for terminate_all.
_registry: dict[int, _Group] = {}
#: Bumped by terminate_all: a launch that sees it change was stopped, not failed.
_generation = 0
_servers_lock = threading.Lock()
#: The resource tracker a launch caused to be started (pid), which terminate_all stops.
_tracker_pid: int | None = None
_atexit_registered = False


def generation() -> int:
    """A number `terminate_all` changes: a launch that sees it change was stopped."""
    return _generation


def ensure_running(method: str) -> None:
    """Start what `method` needs unless running: `_SERVER` (which starts the resource tracker)
    for the fork server; the resource tracker, which spawned ranks are handed, for spawn."""
    global _tracker_pid, _atexit_registered
    with _servers_lock:
        before = mp_resource_tracker._resource_tracker._pid
        if method == FORKSERVER:
            _SERVER.ensure_running()
        else:
            mp_resource_tracker.ensure_running()
        after = mp_resource_tracker._resource_tracker._pid
        if after is not None and after != before:
            _tracker_pid = after
        if not _atexit_registered:
            # Registered after multiprocessing's own exit handler, so it runs first (atexit is
            # last in, first out): that handler joins non-daemonic children without a limit.
            atexit.register(terminate_all)
            _atexit_registered = True


def start(process: mp_process.BaseProcess) -> _Group:
    """Start a process of `new_process` and register its group until `stop`."""
    process.start()
    group = _group_of(process.pid)
    with _registry_lock:
        _registry[group.pid] = group
    return group


def stop(
    groups: Sequence[_Group], processes: Iterable[mp_process.BaseProcess], grace_s: float
) -> None:
    """Kill `groups` (SIGTERM, SIGKILL after `grace_s`), forget them, and reap `processes`.

    A live process missing from `groups` (interrupted between its start and `start`'s
    registration) has its group killed too.
    """
    processes = [p for p in processes if p.pid is not None]
    known = {group.pid for group in groups}
    unknown = [_group_of(p.pid) for p in processes if p.pid not in known and p.is_alive()]
    groups = [*groups, *unknown]
    _kill_groups(groups, grace_s)
    with _registry_lock:
        for group in groups:
            _registry.pop(group.pid, None)
    for process in processes:
        # Reads the exit status (sent by the fork server, or waitpid for a spawned rank).
        process.join(timeout=KILL_WAIT_S)


def _stat(pid: int) -> tuple[str, int, int, int] | None:
    """(state, parent, process group, start time) of a live process from /proc, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
        fields = text.rsplit(")", 1)[1].split()  # after the command, which may hold anything
        return fields[0], int(fields[1]), int(fields[2]), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _all_stats() -> dict[int, tuple[str, int, int, int]]:
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(int(entry))) is not None:
            stats[int(entry)] = stat
    return stats


def _group_of(pid: int) -> _Group:
    stat = _stat(pid) if os.path.isdir("/proc") else None
    return _Group(pid, None if stat is None else stat[3])


def _members(groups: Iterable[_Group]) -> dict[_Group, list[int]]:
    """The live (not zombie) processes of each group, by one scan of /proc.

    A rank that has not yet called setsid() is still in its parent's group: it counts as a
    member by its own pid. Where there is no /proc, a group is alive while signal 0 reaches it,
    and its members are unknown (its leader's pid stands for them).
    """
    groups = list(groups)
    if not os.path.isdir("/proc"):
        alive = {}
        for group in groups:
            alive[group] = []
            for probe in (os.killpg, os.kill):  # the group, or the rank before its setsid
                with contextlib.suppress(OSError):
                    probe(group.pid, 0)
                    alive[group] = [group.pid]
        return alive
    stats = _all_stats()
    members: dict[_Group, list[int]] = {}
    for group in groups:
        leader = stats.get(group.pid)
        if leader is not None and group.started is not None and leader[3] != group.started:
            # The pid was reused: the kernel never reuses a pid that is still some process's
            # group id, so the rank's group is empty, and this group is someone else's.
            members[group] = []
            continue
        found = [
            p for p, (state, _, pgid, _) in stats.items() if pgid == group.pid and state != "Z"
        ]
        if leader is not None and leader[0] != "Z" and group.pid not in found:
            found.append(group.pid)
        members[group] = found
    return members


def _signal(group: _Group, members: list[int], signum: int) -> None:
    with contextlib.suppress(OSError):
        os.killpg(group.pid, signum)
    if group.pid in members:  # still in its parent's group (before its setsid)
        with contextlib.suppress(OSError):
            os.kill(group.pid, signum)


def _kill_groups(groups: Iterable[_Group], grace_s: float) -> int:
    """SIGTERM every live group, SIGKILL what is left after `grace_s`; how many processes.

    Returns once every process is gone, or `KILL_WAIT_S` after the SIGKILL. Interrupted
    (KeyboardInterrupt), it still sends the SIGKILL before it re-raises.
    """
    live = {g: m for g, m in _members(groups).items() if m}
    signalled = sum(len(m) for m in live.values())
    for group, members in live.items():
        _signal(group, members, signal.SIGTERM)
    try:
        deadline = time.monotonic() + grace_s
        while live and time.monotonic() < deadline:
            time.sleep(_POLL_S)
            live = {g: m for g, m in _members(live).items() if m}
    finally:
        for group, members in live.items():
            _signal(group, members, signal.SIGKILL)
    deadline = time.monotonic() + KILL_WAIT_S
    while live and time.monotonic() < deadline:
        time.sleep(_POLL_S)
        live = {g: m for g, m in _members(live).items() if m}
    return signalled


def _server_children() -> list[_Group]:
    """The live children of `_SERVER` (Linux): ranks, including one that was forked while its
    launch was interrupted before it learned the pid (so it is in no registry)."""
    server = _SERVER._forkserver_pid
    if server is None or not os.path.isdir("/proc"):
        return []
    return [
        _Group(pid, started)
        for pid, (state, parent, _, started) in _all_stats().items()
        if parent == server and state != "Z"
    ]


def _wait_reaped(pid: int, grace_s: float) -> None:
    """Reap our child `pid`, SIGKILLing it after `grace_s`."""
    deadline = time.monotonic() + grace_s
    try:
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() >= deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return
            time.sleep(_POLL_S)
    except ChildProcessError:  # reaped already
        pass


def _stop_fork_server(grace_s: float) -> int:
    """Stop `_SERVER` (SIGTERM, SIGKILL after `grace_s`) so that a later launch starts anew."""
    if not _SERVER._lock.acquire(timeout=_LOCK_WAIT_S):
        return 0
    try:
        pid = _SERVER._forkserver_pid
        if pid is None:
            return 0
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)  # it ignores SIGINT, not SIGTERM
        _wait_reaped(pid, grace_s)
        # What ForkServer._stop_unlocked resets, without its unbounded waitpid.
        with contextlib.suppress(OSError):
            os.close(_SERVER._forkserver_alive_fd)
        address = _SERVER._forkserver_address
        if address and not mp_util.is_abstract_socket_namespace(address):
            with contextlib.suppress(OSError):
                os.unlink(address)
        _SERVER._forkserver_pid = None
        _SERVER._forkserver_alive_fd = None
        _SERVER._forkserver_address = None
        return 1
    finally:
        _SERVER._lock.release()


def _stop_resource_tracker(grace_s: float) -> int:
    """Stop multiprocessing's resource tracker if a launch started it; 1 if it did."""
    global _tracker_pid
    tracker = mp_resource_tracker._resource_tracker
    if _tracker_pid is None or not tracker._lock.acquire(timeout=_LOCK_WAIT_S):
        return 0
    try:
        pid, fd = tracker._pid, tracker._fd
        if pid != _tracker_pid or fd is None:
            return 0
        # It ignores SIGTERM and exits at EOF on its pipe, once every holder (this process,
        # the fork server, the ranks: all gone now) closed it; SIGKILL after the grace.
        os.close(fd)
        tracker._fd = None
        tracker._pid = None
        _tracker_pid = None
    finally:
        tracker._lock.release()
    _wait_reaped(pid, grace_s)
    return 1


def terminate_all(grace_s: float = 2.0) -> int:
    """Stop every rank of every launch in flight, then the servers the launches started.

    Each rank's process group (the rank and whatever it started) gets SIGTERM, then SIGKILL
    after `grace_s`, and so does any other child of the fork server (a rank forked while its
    launch was being interrupted); then the fork server, and multiprocessing's resource tracker
    if a launch started it. Returns how many processes it signalled. A process that honours
    SIGTERM is gone at once (the test measures well under a second for ranks, their children
    and both servers); in the worst case, each of the four stages waits `grace_s` and then up
    to 2 s for its SIGKILL. Idempotent, callable from any thread while launches wait on those
    processes (they raise LaunchStoppedError), never raises; a later launch starts afresh.
    """
    global _generation
    signalled = 0
    with contextlib.suppress(Exception):
        if _registry_lock.acquire(timeout=_LOCK_WAIT_S):
            try:
                _generation += 1
                groups = list(_registry.values())
            finally:
                _registry_lock.release()
        else:  # held by the thread this interrupted: read without it
            groups = list(_registry.values())
        signalled += _kill_groups(groups, grace_s)
    with contextlib.suppress(Exception):
        # Before the server goes: its orphans could no longer be told from anyone else's.
        signalled += _kill_groups(_server_children(), grace_s)
    with contextlib.suppress(Exception):
        signalled += _stop_fork_server(grace_s)
    with contextlib.suppress(Exception):
        signalled += _stop_resource_tracker(grace_s)
    return signalled


def describe_exit(exitcode: int | None) -> str:
    """``exited with code 3`` or ``was killed by SIGKILL (signal 9)``."""
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = "an unknown signal"
        return f"was killed by {name} (signal {-exitcode})"
    return f"exited with code {exitcode}"
