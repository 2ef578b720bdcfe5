"""CPU seconds of a command: this process and every process it started, fork servers included.

Wall time on a shared machine says how busy the other users were; CPU time says what the
command cost. ``getrusage(RUSAGE_CHILDREN)`` counts a child only once it was reaped, together
with every descendant that child reaped in turn. The workers of a run are not our children:
torch ranks are forked (and reaped) by the launcher's fork server, JAX workers by the zygote;
both servers are our children and stay alive, unreaped, until they are stopped. So
`command_cpu_seconds` first stops them (`crosscheck.launch.processes.terminate_all`: SIGTERM,
reaped; nothing else is running at the end of a command) and then reads both counters. A later
launch in the same process starts fresh servers, as after an interrupt.
"""

from __future__ import annotations

import resource

from crosscheck.launch.processes import terminate_all

#: How long the servers get between SIGTERM and SIGKILL: both exit on SIGTERM at once, and
#: a server killed by SIGKILL is counted the same (its reaped children were added to it).
SERVER_GRACE_S = 1.0


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and of every child reaped so far (with the
    descendants each of them reaped)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def command_cpu_seconds() -> float:
    """`cpu_seconds` once the fork servers this process started are stopped and reaped, so
    that the workers they forked are counted: for the end of a command, when no launch is in
    flight (one still running would be stopped)."""
    terminate_all(grace_s=SERVER_GRACE_S)
    return cpu_seconds()
