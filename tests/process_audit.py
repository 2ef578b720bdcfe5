"""After the whole suite, no process it started may be alive: the suite checks this itself.

Every process the tests start inherits one environment variable, `SESSION_MARKER`, set by
tests/conftest.py before anything starts (ranks, workers, fork servers, zygotes, and whatever a
user's step starts, even when reparented to init). At the end of the session:

1. the long-lived servers a launch keeps for the life of its caller (the zygotes of torch ranks
   and of JAX workers) are expected; any *other* marked
   process is a leak: a rank, a worker or a child of a step that outlived the call that
   started it;
2. then `crosscheck.launch.processes.terminate_all` stops the servers, and nothing marked may
   remain after a short grace.

Either finding fails the session, listing every process with its command line.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

#: The variable every process of the session inherits.
SESSION_MARKER = "GRADWEIGHT_TEST_SESSION"
#: Servers that live as long as the process that started them, by a part of their command line.
SERVERS = ("crosscheck.launch.zygote_server",)
#: After `terminate_all`, how long the servers and their children may take to exit: it sends
#: SIGTERM, waits 2 s, then SIGKILL.
GRACE_S = 5.0


@dataclass(frozen=True, slots=True)
class Found:
    pid: int
    command: str

    def describe(self) -> str:
        return f"pid {self.pid}: {self.command[:200]}"


def marked_processes(marker: str) -> list[Found]:
    """Every live process (this one excepted) whose environment holds `SESSION_MARKER=marker`."""
    needle = f"{SESSION_MARKER}={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            if needle not in environ.split(b"\0"):
                continue
            status = (entry / "stat").read_text()
            if status.rsplit(")", 1)[-1].split()[0] == "Z":
                continue  # a zombie is gone; only its exit status waits to be read
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # exited while we looked
            continue
        found.append(Found(int(entry.name), command.strip()))
    return found


def leaks(marker: str) -> list[str]:
    """What is wrong at the end of a session: leaked processes, then survivors of the stop."""
    problems = [
        f"still running after its call returned: {p.describe()}"
        for p in marked_processes(marker)
        if not any(server in p.command for server in SERVERS)
    ]
    from crosscheck.launch.processes import terminate_all

    terminate_all()
    deadline = time.monotonic() + GRACE_S
    left = marked_processes(marker)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = marked_processes(marker)
    problems += [f"alive {GRACE_S:g} s after the launchers stopped: {p.describe()}" for p in left]
    for p in left:  # do not leave them to the next session either
        with contextlib.suppress(OSError):
            os.kill(p.pid, signal.SIGKILL)
    return problems
