"""CPU seconds of a command: this process and every process it started, forked ones included.

Wall time on a shared machine says how busy the other users were; CPU time says what the
command cost. ``getrusage(RUSAGE_CHILDREN)`` counts a child only once it was reaped, together
with every descendant that child reaped in turn. The workers of a run are not our children:
torch ranks are forked (and reaped) by the ranks' zygote, JAX workers by the JAX one;
both servers are our children and stay alive, unreaped, until the process exits. So
`cpu_seconds` adds, for every child still alive or not yet reaped, its own CPU and what it
reaped (``utime + stime + cutime + cstime`` of ``/proc/PID/stat``). It stops nothing: a later
launch in the same process still finds its servers.

Where ``/proc`` does not exist (macOS), only this process and its reaped children count: the
figure is then a lower bound.
"""

from __future__ import annotations

import contextlib
import os
import resource
from pathlib import Path

_PROC = Path("/proc")
#: Fields of ``/proc/PID/stat`` after the command name's closing parenthesis (0-based there):
#: the parent's pid, then user and system time of the process and of its reaped children.
_PPID, _UTIME, _STIME, _CUTIME, _CSTIME = 1, 11, 12, 13, 14


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and every process it started: its reaped
    children (with the descendants each of them reaped) and its unreaped ones (with theirs)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime + unreaped_children_cpu()


def unreaped_children_cpu(pid: int | None = None) -> float:
    """CPU seconds of the children of `pid` (default: this process) that it has not reaped,
    each with the descendants it reaped; 0.0 where ``/proc`` does not exist.

    A child that exits between the listing and the read, or a file that cannot be parsed,
    is left out rather than raising: the figure is a report, never a reason to fail."""
    if not _PROC.is_dir():
        return 0.0
    parent = os.getpid() if pid is None else pid
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            text = (entry / "stat").read_text()
            # The command name may hold spaces and parentheses: split after its last ')'.
            fields = text[text.rindex(")") + 2 :].split()
            if int(fields[_PPID]) == parent:
                total += sum(int(fields[i]) for i in (_UTIME, _STIME, _CUTIME, _CSTIME))
    return total / ticks
