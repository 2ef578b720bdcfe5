"""How a rank process is started: forked from the launcher's own fork server, or spawned.

`new_process` makes a rank process, not started yet, for one of two start methods (chosen at
every launch by `torch_impl.harness.rank_processes.start_method`):

* ``"forkserver"``: forked from `SERVER`, a fork server of this package's own that imported
  torch and DDP's dependencies once (`FORK_SERVER_PRELOAD`): a rank starts in a fraction of a
  second;
* ``"spawn"``: a fresh interpreter (multiprocessing's spawn context) that imports torch
  itself: seconds of CPU per rank. Its command line calls ``os.setsid()`` first thing, so it
  leads a process group of its own as a forked rank does.

Both are multiprocessing's own Popen classes of Python 3.11 with one change each: the fork
comes from `SERVER`, and the spawned child starts a session first.
"""

from __future__ import annotations

import io
import multiprocessing.forkserver as mp_forkserver
import multiprocessing.popen_forkserver as mp_popen_forkserver
import multiprocessing.popen_spawn_posix as mp_popen_spawn_posix
import multiprocessing.process as mp_process
import multiprocessing.resource_tracker as mp_resource_tracker
import os
from collections.abc import Callable
from multiprocessing import context as mp_context
from multiprocessing import reduction as mp_reduction
from multiprocessing import spawn as mp_spawn
from multiprocessing import util as mp_util
from typing import Any

FORKSERVER, SPAWN = "forkserver", "spawn"


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
SERVER = mp_forkserver.ForkServer()
SERVER.set_forkserver_preload(list(FORK_SERVER_PRELOAD))


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
    """multiprocessing's forkserver Popen (Python 3.11), asking `SERVER` for the fork."""

    def _launch(self, process_obj: Any) -> None:
        buf = _pickled(self, process_obj)
        self.sentinel, w = SERVER.connect_to_new_process(self._fds)
        # As multiprocessing does: a duplicate of the data pipe's write end is the parent's
        # sentinel for the child.
        parent_w = os.dup(w)
        self.finalizer = mp_util.Finalize(self, mp_util.close_fds, (parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = mp_forkserver.read_signed(self.sentinel)


class _RankProcess(mp_process.BaseProcess):
    """A process forked from `SERVER`."""

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
