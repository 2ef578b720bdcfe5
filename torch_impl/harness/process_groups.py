"""Process groups: who is in one (one scan of /proc), and killing them within a bound.

Every rank of `torch_impl.harness.launcher.launch` leads a process group of its own, so what
the rank starts goes with it. A group is known by its leader's pid and, on Linux, the
leader's start time (`Group`), which tells the rank from a later process that reused its
pid. `kill_groups` sends SIGTERM, then SIGKILL after a grace period, and returns once every
member is gone or `KILL_WAIT_S` later; where there is no /proc, a group is alive while
signal 0 reaches it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass

#: After SIGKILL, how long a group may take to vanish (the kernel tears processes down).
KILL_WAIT_S = 2.0
POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class Group:
    """A rank's process group: its leader's pid, and when that process started (Linux)."""

    pid: int
    #: /proc/<pid>/stat's start time, or None where there is no /proc: tells the rank from a
    #: later process that reused its pid.
    started: int | None


def proc_stat(pid: int) -> tuple[str, int, int, int] | None:
    """(state, parent, process group, start time) of a live process from /proc, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
        fields = text.rsplit(")", 1)[1].split()  # after the command, which may hold anything
        return fields[0], int(fields[1]), int(fields[2]), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def all_stats() -> dict[int, tuple[str, int, int, int]]:
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := proc_stat(int(entry))) is not None:
            stats[int(entry)] = stat
    return stats


def group_of(pid: int) -> Group:
    stat = proc_stat(pid) if os.path.isdir("/proc") else None
    return Group(pid, None if stat is None else stat[3])


def members(groups: Iterable[Group]) -> dict[Group, list[int]]:
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
    stats = all_stats()
    found_by_group: dict[Group, list[int]] = {}
    for group in groups:
        leader = stats.get(group.pid)
        if leader is not None and group.started is not None and leader[3] != group.started:
            # The pid was reused: the kernel never reuses a pid that is still some process's
            # group id, so the rank's group is empty, and this group is someone else's.
            found_by_group[group] = []
            continue
        found = [
            p for p, (state, _, pgid, _) in stats.items() if pgid == group.pid and state != "Z"
        ]
        if leader is not None and leader[0] != "Z" and group.pid not in found:
            found.append(group.pid)
        found_by_group[group] = found
    return found_by_group


def _signal(group: Group, pids: list[int], signum: int) -> None:
    with contextlib.suppress(OSError):
        os.killpg(group.pid, signum)
    if group.pid in pids:  # still in its parent's group (before its setsid)
        with contextlib.suppress(OSError):
            os.kill(group.pid, signum)


def kill_groups(groups: Iterable[Group], grace_s: float) -> int:
    """SIGTERM every live group, SIGKILL what is left after `grace_s`; how many processes.

    Returns once every process is gone, or `KILL_WAIT_S` after the SIGKILL. Interrupted
    (KeyboardInterrupt), it still sends the SIGKILL before it re-raises.
    """
    live = {g: m for g, m in members(groups).items() if m}
    signalled = sum(len(m) for m in live.values())
    for group, pids in live.items():
        _signal(group, pids, signal.SIGTERM)
    try:
        deadline = time.monotonic() + grace_s
        while live and time.monotonic() < deadline:
            time.sleep(POLL_S)
            live = {g: m for g, m in members(live).items() if m}
    finally:
        for group, pids in live.items():
            _signal(group, pids, signal.SIGKILL)
    deadline = time.monotonic() + KILL_WAIT_S
    while live and time.monotonic() < deadline:
        time.sleep(POLL_S)
        live = {g: m for g, m in members(live).items() if m}
    return signalled


def wait_reaped(pid: int, grace_s: float) -> None:
    """Reap our child `pid`, SIGKILLing it after `grace_s`."""
    deadline = time.monotonic() + grace_s
    try:
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() >= deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return
            time.sleep(POLL_S)
    except ChildProcessError:  # reaped already
        pass
