"""The process groups a launcher started, and stopping them: nothing a launch started outlives it.

Every worker is the leader of a process group of its own (a new session:
``start_new_session=True``, or ``setsid`` in a child forked by `jax_impl.harness.zygote`), and what
a worker starts (a user's step may start subprocesses) stays in that group. Killing the group
kills them all. This module keeps a registry of the groups that `jax_impl.harness.launch` and
`jax_impl.harness.zygote` started and that may still be alive (workers and zygotes):

- `stop_groups` stops given groups: `jax_impl.harness.launch.run_workers` kills its own
  (SIGKILL) on every exit path, a zygote's client stops the zygote when it closes it.
- `terminate_all` stops every registered group (SIGTERM, then SIGKILL after a grace): for a
  signal handler or an interrupted caller (`crosscheck.launch.processes` calls it through
  `jax_impl.harness.launch`, which exports it).

A killed group is waited for until no live process is left in it (zombies count as gone: on
Linux the process table is read from /proc; elsewhere ``killpg(pgid, 0)``), for a bounded time;
a SIGKILL that has not landed by then is left to the OS.

Like `jax_impl.harness.launch`, this module must load without the jax_impl package (importing
that imports JAX; see `crosscheck.launch.workers.jax_launch`): the standard library only.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Protocol

#: `terminate_all`: how long to wait for the groups after the SIGKILL that follows the grace.
TERMINATE_KILL_WAIT_S = 2.0
#: How often a wait for killed groups looks again.
_GONE_POLL_S = 0.01


class GroupLeader(Protocol):
    """What the registry needs of a group leader: `subprocess.Popen` or `ZygoteChild`."""

    pid: int

    def poll(self) -> int | None: ...


# Re-entrant: terminate_all may run in a signal handler that interrupted this very thread
# while it held the lock to register a group.
_registry_lock = threading.RLock()
#: pgid (= the leader's pid) -> (leader, whether it is a server that forks workers), for every
#: group that may still hold a live process.
_registry: dict[int, tuple[GroupLeader, bool]] = {}


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


def _live_groups() -> set[int] | None:
    """The pgid of every live process on the machine, or None where /proc cannot tell.

    A zombie counts as gone: its exit status is all that is left of it (here, PID 1 may not
    reap orphans at all, so a killed worker's children can stay zombies for ever).
    """
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    groups = set()
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
        if len(fields) > 2 and fields[0] not in (b"Z", b"X"):
            groups.add(int(fields[2]))
    return groups


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
    """
    leaders = list(leaders)
    alive = _alive(leaders)
    first = signal.SIGTERM if grace_s > 0 else signal.SIGKILL
    signalled = sum(_signal_group(leader, first) for leader in alive)
    if grace_s > 0 and alive:
        for leader in _wait_gone(alive, grace_s):
            _signal_group(leader, signal.SIGKILL)
    left = _wait_gone(alive, wait_s) if alive else []
    for leader in leaders:
        if leader not in left:
            forget_group(leader)
    return signalled


def terminate_all(grace_s: float = 2.0) -> int:
    """Stop every process group this module registered; returns how many groups it signalled.

    Each group is a worker, with everything it started, or a zygote. Workers first: SIGTERM to
    each group, up to `grace_s` for them to exit, SIGKILL to what is left, then up to
    `TERMINATE_KILL_WAIT_S` until they are gone (reaping the ones that are ours); then the
    zygotes the same way (a zygote exits on SIGTERM at once). At most ``grace_s + 2 s`` for
    each of the two rounds; a worker that exits on SIGTERM makes its round last milliseconds.
    Idempotent, safe to call from the main thread while other threads wait on these processes
    (their `run_workers` then sees the workers die and raises), and never raises.
    """
    signalled = 0
    try:
        with _registry_lock:
            entries = list(_registry.values())
        for servers in (False, True):
            leaders = [leader for leader, server in entries if server is servers]
            signalled += stop_groups(leaders, grace_s=grace_s, wait_s=TERMINATE_KILL_WAIT_S)
    except Exception:  # a signal handler's last resort must not fail the way out
        pass
    return signalled
