"""Where the launcher's rank processes come from, and how every one of them is stopped.

This module starts the processes `torch_impl.harness.launcher.launch` runs its ranks in, keeps a
registry of their process groups while a launch may still need them, and ends them: a group at
a time (`stop`), or everything in flight at once (`terminate_all`, with the servers the launches
started). How a process is made is `torch_impl.harness.rank_start`'s (`new_process`), how a
group is killed `torch_impl.harness.process_groups`'. `start_method` picks, at every launch,
one of two ways to start a rank:

* ``"forkserver"``: forked from the package's own fork server (`_SERVER`, made in
  `torch_impl.harness.rank_start`), which imported torch and DDP's dependencies once
  (`FORK_SERVER_PRELOAD`); a rank starts in a fraction of a second.
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
import multiprocessing
import multiprocessing.process as mp_process
import multiprocessing.resource_tracker as mp_resource_tracker
import os
import signal
import threading
from collections.abc import Iterable, Mapping, Sequence
from multiprocessing import util as mp_util

from torch_impl.harness.process_groups import (
    KILL_WAIT_S,
    Group,
    all_stats,
    group_of,
    kill_groups,
    members,
    wait_reaped,
)

# How ranks start; FORK_SERVER_PRELOAD and new_process are re-exported for the launcher.
from torch_impl.harness.rank_start import FORK_SERVER_PRELOAD as FORK_SERVER_PRELOAD
from torch_impl.harness.rank_start import FORKSERVER, SPAWN
from torch_impl.harness.rank_start import SERVER as _SERVER
from torch_impl.harness.rank_start import new_process as new_process

#: Set to anything but "" or "0", no fork server is used: spawned ranks instead.
NO_FORK_SERVERS_ENV = "GRADWEIGHT_NO_FORK_SERVERS"
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


# --- Who owns which process -----------------------------------------------------------------


_registry_lock = threading.Lock()
#: Groups of launches in flight (pid -> group), for terminate_all.
_registry: dict[int, Group] = {}
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
        # The tracker first: its ensure_running blocks SIGINT around its own spawn and then
        # unblocks it, whatever the caller's mask was.
        mp_resource_tracker.ensure_running()
        if method == FORKSERVER:
            # SIGINT blocked while the fork server is spawned: a blocked signal stays blocked
            # across fork and exec, so a Ctrl-C on the terminal cannot interrupt its seconds
            # of importing torch (multiprocessing's server ignores SIGINT only once its
            # imports are done; before, it printed a KeyboardInterrupt traceback). The
            # caller's own Ctrl-C is not lost: it arrives once the mask is restored.
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                _SERVER.ensure_running()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        after = mp_resource_tracker._resource_tracker._pid
        if after is not None and after != before:
            _tracker_pid = after
        if not _atexit_registered:
            # Registered after multiprocessing's own exit handler, so it runs first (atexit is
            # last in, first out): that handler joins non-daemonic children without a limit.
            atexit.register(terminate_all)
            _atexit_registered = True


def start(process: mp_process.BaseProcess) -> Group:
    """Start a process of `new_process` and register its group until `stop`."""
    process.start()
    group = group_of(process.pid)
    with _registry_lock:
        _registry[group.pid] = group
    return group


def stop(
    groups: Sequence[Group], processes: Iterable[mp_process.BaseProcess], grace_s: float
) -> None:
    """Kill `groups` (SIGTERM, SIGKILL after `grace_s`), forget them, and reap `processes`.

    A live process missing from `groups` (interrupted between its start and `start`'s
    registration) has its group killed too.
    """
    processes = [p for p in processes if p.pid is not None]
    known = {group.pid for group in groups}
    unknown = [group_of(p.pid) for p in processes if p.pid not in known and p.is_alive()]
    groups = [*groups, *unknown]
    kill_groups(groups, grace_s)
    with _registry_lock:
        for group in groups:
            _registry.pop(group.pid, None)
    for process in processes:
        # Reads the exit status (sent by the fork server, or waitpid for a spawned rank).
        process.join(timeout=KILL_WAIT_S)


def _server_children() -> list[Group]:
    """The live children of `_SERVER` (Linux): ranks, including one that was forked while its
    launch was interrupted before it learned the pid (so it is in no registry)."""
    server = _SERVER._forkserver_pid
    if server is None or not os.path.isdir("/proc"):
        return []
    return [
        Group(pid, started)
        for pid, (state, parent, _, started) in all_stats().items()
        if parent == server and state != "Z"
    ]


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
        wait_reaped(pid, grace_s)
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
    wait_reaped(pid, grace_s)
    return 1


def terminate_all(grace_s: float = 2.0) -> int:
    """Stop every rank of every launch in flight, then the servers the launches started.

    Each rank's process group (the rank and whatever it started) gets SIGTERM, then SIGKILL
    after `grace_s`, and so does any other child of the fork server (a rank forked while its
    launch was being interrupted); then the fork server, and multiprocessing's resource tracker
    if a launch started it. Returns how many processes it found running and stopped (a rank's
    processes are counted before its launch learns of the stop, since the launch then stops
    them too, and either may come first). A process that honours SIGTERM is gone at once (the
    test measures well under a second for ranks, their children and both servers); in the
    worst case, each of the four stages waits `grace_s` and then up to 2 s for its SIGKILL.
    Idempotent, callable from any thread while launches wait on those processes (they raise
    LaunchStoppedError), never raises; a later launch starts afresh.
    """
    global _generation
    signalled = 0
    with contextlib.suppress(Exception):
        if _registry_lock.acquire(timeout=_LOCK_WAIT_S):
            try:
                groups = list(_registry.values())
                # Counted before the launches learn of the stop: from then on a launch stops
                # its own ranks too, and whichever comes first must not change the count.
                found = sum(len(m) for m in members(groups).values())
                _generation += 1
            finally:
                _registry_lock.release()
        else:  # held by the thread this interrupted: read without it
            groups = list(_registry.values())
            found = sum(len(m) for m in members(groups).values())
        kill_groups(groups, grace_s)
        signalled += found
    with contextlib.suppress(Exception):
        # Before the server goes: its orphans could no longer be told from anyone else's.
        signalled += kill_groups(_server_children(), grace_s)
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
