"""Start real worker processes, wait for them with every wait bounded, and leave none behind.

A multi-process collective hangs when one peer dies: the others wait for a message that never
comes. So the launcher polls all processes, and as soon as one exits with an error, or the
deadline passes, it kills the rest and raises with each process's exit status (a signal by
name) and the tail of its stderr. Output goes to files, never to pipes, so a chatty worker
cannot block on a full pipe buffer either.

Process groups. Every worker is the leader of a process group of its own (a new session:
``start_new_session=True``, or ``setsid`` in a child forked by `jax_impl.harness.zygote`), and what
a worker starts (a user's step may start subprocesses) stays in that group. Killing the group
kills them all. This module keeps a registry of the groups it and `jax_impl.harness.zygote` started
that may still be alive (workers and zygotes):

- `run_workers` kills its own groups (SIGKILL) in a ``finally``, on every exit path: all
  workers done, one failed, the deadline, an exception or KeyboardInterrupt in the caller.
  So nothing a launch started outlives it, not even a child of a worker that exited 0.
- `terminate_all` stops every registered group (SIGTERM, then SIGKILL after a grace): for a
  signal handler or an interrupted caller (`crosscheck.launch.processes` calls it).

A killed group is waited for until no live process is left in it (zombies count as gone: on
Linux the process table is read from /proc; elsewhere ``killpg(pgid, 0)``), at most
`KILL_WAIT_S`; a SIGKILL that has not landed by then is left to the OS.

Port reservation. `reserve_port` holds a port for a jax.distributed coordinator from before
the workers start until the launch ends, so that concurrent launches never pick the same one
(see its docstring).

This module must load without the jax_impl package (importing that imports JAX):
`crosscheck.bugs.jax_bugs._launch` loads this file alone, as ``jax_impl.harness.launch``, into
processes that must not import JAX. So: the standard library only.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # not at run time: this module must load without the jax_impl package
    from jax_impl.harness.zygote import Zygote

POLL_INTERVAL_S = 0.05
#: XLA flags for worker processes that compile many tiny programs, where compiling is most of
#: the run: LLVM code generation at -O0, XLA:CPU's classic elemental emitters instead of the
#: MLIR fusion emitters (0.4 s -> 0.2 s per harness program), and one LLVM module per program
#: (splitting a module this small for parallel code generation costs more CPU than it saves:
#: about 15% of the compile time). None changes XLA's HLO passes or floating-point semantics
#: (no fast-math): results match the oracle to the harness tolerances, which the tests check.
SMALL_PROGRAM_XLA_FLAGS = (
    "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
    "--xla_cpu_parallel_codegen_split_count=1"
)
#: How long `run_workers` waits for the groups it killed to be gone.
KILL_WAIT_S = 10.0
#: `terminate_all`: how long to wait for the groups after the SIGKILL that follows the grace.
TERMINATE_KILL_WAIT_S = 2.0
#: How often a wait for killed groups looks again.
_GONE_POLL_S = 0.01


class LaunchError(RuntimeError):
    """A worker failed or the deadline passed; the message holds every worker's status.

    `failed` maps each failed worker's index to its exit status (negative: killed by that
    signal); `timed_out` says the deadline passed with workers still running.
    """

    def __init__(
        self, message: str, *, failed: Mapping[int, int] | None = None, timed_out: bool = False
    ) -> None:
        super().__init__(message)
        self.failed = dict(failed or {})
        self.timed_out = timed_out


@dataclass(frozen=True, slots=True)
class WorkerResult:
    """One finished worker: its index, exit status, where its output went, and whether it was
    forked by a zygote (else started as a fresh process)."""

    index: int
    returncode: int
    stdout_path: Path
    stderr_path: Path
    forked: bool = False

    def stderr_tail(self, num_chars: int = 3000) -> str:
        text = self.stderr_path.read_text(errors="replace")
        return text[-num_chars:]


class _Leader(Protocol):
    """What the registry needs of a group leader: `subprocess.Popen` or `ZygoteChild`."""

    pid: int

    def poll(self) -> int | None: ...


# ---- the registry of process groups ----------------------------------------------------------

# Re-entrant: terminate_all may run in a signal handler that interrupted this very thread
# while it held the lock to register a group.
_registry_lock = threading.RLock()
#: pgid (= the leader's pid) -> (leader, whether it is a server that forks workers), for every
#: group that may still hold a live process.
_registry: dict[int, tuple[_Leader, bool]] = {}


def register_group(leader: _Leader, *, server: bool = False) -> None:
    """Remember `leader`'s process group until it is known to be gone (see `terminate_all`).

    A `server` (a zygote) forks workers: `terminate_all` stops it after the workers, so that it
    can still reap them and report how they ended.
    """
    with _registry_lock:
        _registry[leader.pid] = (leader, server)


def forget_group(leader: _Leader) -> None:
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


def _alive(leaders: Iterable[_Leader]) -> list[_Leader]:
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


def _signal_group(leader: _Leader, signum: int) -> bool:
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


def _wait_gone(leaders: Sequence[_Leader], timeout_s: float) -> list[_Leader]:
    """Wait until no group of `leaders` holds a live process, at most `timeout_s`; returns
    the leaders of the groups still alive then."""
    deadline = time.monotonic() + timeout_s
    alive = _alive(leaders)
    while alive and time.monotonic() < deadline:
        time.sleep(_GONE_POLL_S)
        alive = _alive(alive)
    return alive


def stop_groups(leaders: Iterable[_Leader], *, grace_s: float = 0.0, wait_s: float) -> int:
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


# ---- coordinator ports -----------------------------------------------------------------------


class PortReservation:
    """A TCP port on 127.0.0.1 held for a jax.distributed coordinator until `close`.

    Where the socket option exists (Linux), the port is held by a bound, never listening
    socket with SO_REUSEPORT: the coordinator's gRPC server binds the same port with
    SO_REUSEPORT too (same user), so it can take the port over while we hold it, and a bound
    socket never receives connections. Everyone else is kept out: the kernel never hands a
    port in use to a ``bind(0)`` (with or without SO_REUSEPORT), and an explicit bind
    without SO_REUSEPORT fails. So two launches at once never share a coordinator port. (A
    process of the same user that binds this very port with SO_REUSEPORT could still share
    it: nothing can stop that short of keeping the port, which the coordinator must take.)
    Elsewhere the port was merely free a moment ago (`held` is False) and a launch that loses
    the race must retry (`jax_impl.harness.multiprocess.launch_multiprocess` does).
    """

    def __init__(self) -> None:
        self.held = sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")
        self._socket: socket.socket | None = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            if self.held:
                self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            self._socket.bind(("127.0.0.1", 0))
            self.port = int(self._socket.getsockname()[1])
        except BaseException:
            self._socket.close()
            raise
        if not self.held:
            self.close()

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    def __enter__(self) -> PortReservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def reserve_port() -> PortReservation:
    """A coordinator port, held until the reservation is closed (see `PortReservation`)."""
    return PortReservation()


# ---- running workers -------------------------------------------------------------------------


def describe_status(returncode: int | None) -> str:
    """An exit status in words: "exited with 3", "was killed by SIGKILL (signal 9)"."""
    if returncode is None:
        return "was still running (killed)"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "an unknown signal"
        return f"was killed by {name} (signal {-returncode})"
    return f"exited with {returncode}"


def _describe(
    processes: Sequence[_Leader], codes: Sequence[int | None], paths: Sequence[Path]
) -> str:
    """One status paragraph per worker (as it was before the kill) with its stderr tail."""
    lines = []
    for index, (process, code, path) in enumerate(zip(processes, codes, paths, strict=True)):
        state = "still running (killed)" if code is None else describe_status(code)
        tail = path.read_text(errors="replace")[-2000:] if path.exists() else ""
        lines.append(f"--- worker {index} (pid {process.pid}) {state}; stderr tail:\n{tail}")
    return "\n".join(lines)


def run_workers(
    commands: Sequence[Sequence[str]],
    *,
    timeout_s: float,
    log_dir: str | Path,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    zygote: Zygote | None = None,
    kill_wait_s: float = KILL_WAIT_S,
) -> list[WorkerResult]:
    """Run every command as its own process group; return when all exited with status 0.

    Raises LaunchError, after killing the survivors, when any worker exits non-zero (within
    `POLL_INTERVAL_S` of its death) or when `timeout_s` passes first. Returns or raises at most
    ``timeout_s + POLL_INTERVAL_S + kill_wait_s`` after the call (a SIGKILL lands in
    milliseconds; `kill_wait_s` bounds a process the kernel is slow to take down). On every
    exit path each worker's process group, with whatever the worker started, is killed before
    this returns. With a `zygote`, commands of the form ``[sys.executable, "-m", MODULE,
    *ARGS]`` are forked from it (`jax_impl.harness.zygote`) instead of started afresh; the rest is
    the same.
    """
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    processes: list[_Leader] = []
    forked: list[bool] = []
    paths: list[tuple[Path, Path]] = []
    deadline = time.monotonic() + timeout_s
    stopped = False
    try:
        for index, command in enumerate(commands):
            out_path, err_path = log_dir / f"worker{index}.out", log_dir / f"worker{index}.err"
            paths.append((out_path, err_path))
            child: _Leader | None = None
            if zygote is not None and zygote.alive and list(command[:2]) == [sys.executable, "-m"]:
                with contextlib.suppress(zygote.Error):  # a failed zygote is a slower start
                    child = zygote.spawn(
                        command[2],
                        command[3:],
                        env=dict(os.environ if env is None else env),
                        cwd=cwd,
                        stdout=out_path,
                        stderr=err_path,
                    )
            if child is None:
                with out_path.open("wb") as out, err_path.open("wb") as err:
                    child = subprocess.Popen(
                        list(command),
                        stdout=out,
                        stderr=err,
                        stdin=subprocess.DEVNULL,
                        env=dict(os.environ if env is None else env),
                        cwd=cwd,
                        start_new_session=True,  # its own group: killing it kills its children
                    )
            register_group(child)
            processes.append(child)
            forked.append(not isinstance(child, subprocess.Popen))
        while True:
            codes = [p.poll() for p in processes]
            failed = {i: rc for i, rc in enumerate(codes) if rc not in (None, 0)}
            if failed:
                what = "; ".join(
                    f"worker {i} (pid {processes[i].pid}) {describe_status(rc)}"
                    for i, rc in failed.items()
                )
                stop_groups(processes, wait_s=kill_wait_s)
                stopped = True
                details = _describe(processes, codes, [err for _, err in paths])
                raise LaunchError(
                    f"worker(s) {sorted(failed)} failed: {what}; the others were stopped\n"
                    f"{details}",
                    failed=failed,
                )
            if all(rc == 0 for rc in codes):
                break
            if time.monotonic() > deadline:
                running = [i for i, rc in enumerate(codes) if rc is None]
                stop_groups(processes, wait_s=kill_wait_s)
                stopped = True
                details = _describe(processes, codes, [err for _, err in paths])
                raise LaunchError(
                    f"worker(s) {running} still running after {timeout_s:.0f} s; all stopped\n"
                    f"{details}",
                    timed_out=True,
                )
            time.sleep(POLL_INTERVAL_S)
    finally:
        # Every exit path, the normal one too: a worker that exited 0 may have left children.
        # (Not twice: a second wait for a group the kernel is slow to take down would double
        # the bound.)
        if not stopped:
            stop_groups(processes, wait_s=kill_wait_s)
    return [
        WorkerResult(i, p.poll() or 0, out_path, err_path, forked[i])
        for i, (p, (out_path, err_path)) in enumerate(zip(processes, paths, strict=True))
    ]
