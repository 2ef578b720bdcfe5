"""Worker processes: start one, run a set of them with every wait bounded, and leave none behind.

The one way the project starts a process that does work (a JAX worker, a ``jax.distributed``
process, a torch rank): `start_worker` runs ``python -m MODULE ARGS`` forked from a zygote
(`crosscheck.launch.zygote`) where one is given and alive, else as a fresh interpreter, always
as the leader of a process group of its own, with its output in files, and registers the group
with `crosscheck.launch.processes` (whose `terminate_all` stops it on an interrupt).
`run_workers` runs a set of workers to their end.

A multi-process collective hangs when one peer dies: the others wait for a message that never
comes. So `run_workers` polls all processes, and as soon as one exits with an error, or the
deadline passes, it kills the rest and raises with each process's exit status (a signal by
name) and the tail of its stderr. Output goes to files, never to pipes, so a chatty worker
cannot block on a full pipe buffer either; what a worker leaves for its launcher to read is
written with `write_atomically`, so that it is never read half-written. `run_workers` kills
its own groups (SIGKILL) in a ``finally``, on every exit path: all workers done, one failed,
the deadline, an exception or KeyboardInterrupt in the caller. So nothing a launch started
outlives it, not even a child of a worker that exited 0; a killed group is waited for at most
`KILL_WAIT_S`. (The torch launcher, `torch_impl.harness.launcher`, starts its ranks with
`start_worker` and waits for them itself: it reads each rank's report as it comes.)

Port reservation. `reserve_port` holds a port for a jax.distributed coordinator from before
the workers start until the launch ends, so that concurrent launches never pick the same one
(see its docstring).

The standard library only, like `crosscheck.launch.processes`: worker processes import it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from crosscheck.launch.processes import GroupLeader, describe_status, register_group, stop_groups
from crosscheck.launch.zygote import Zygote, ZygoteError

#: The repository, first on a worker's PYTHONPATH (`process_env`).
_ROOT = Path(__file__).resolve().parents[2]
POLL_INTERVAL_S = 0.05
#: How long `run_workers` waits for the groups it killed to be gone.
KILL_WAIT_S = 10.0


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


# ---- files a worker leaves -------------------------------------------------------------------


def write_atomically(path: str | Path, data: bytes) -> None:
    """Write `data` to `path` under a temporary name, then rename it into place: a reader (a
    launcher, at any moment, even after a kill) sees the whole file or no file."""
    # A name of this process and thread: two threads of one process (a torch rank's watcher
    # and its main thread) never write the same temporary file.
    tmp = Path(f"{path}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


# ---- running workers -------------------------------------------------------------------------


def process_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """What every worker's environment holds, whatever the framework: `base` (this process's
    environment when None), one OpenMP thread unless set (several workers share few cores, and
    a zygote must import its framework without starting a thread), and this repository first
    on ``PYTHONPATH`` (a fresh interpreter imports the harness from it)."""
    env = dict(os.environ if base is None else base)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def start_worker(
    command: Sequence[str],
    *,
    stdout: Path,
    stderr: Path,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    zygote: Zygote | None = None,
) -> GroupLeader:
    """Start `command` as the leader of a process group of its own, its output in `stdout` and
    `stderr`, and register the group (`crosscheck.launch.processes.register_group`).

    A command of the form ``[sys.executable, "-m", MODULE, *ARGS]`` is forked from `zygote`
    where one is given and alive (a zygote that fails to fork is a slower start, not an
    error); anything else, or without a zygote, is a fresh process. The caller stops the group
    (`crosscheck.launch.processes.stop_groups`) when it is done with the worker.
    """
    environment = dict(os.environ if env is None else env)
    child: GroupLeader | None = None
    if zygote is not None and zygote.alive and list(command[:2]) == [sys.executable, "-m"]:
        with contextlib.suppress(ZygoteError):
            child = zygote.spawn(
                command[2], command[3:], env=environment, cwd=cwd, stdout=stdout, stderr=stderr
            )
    if child is None:
        with stdout.open("wb") as out, stderr.open("wb") as err:
            child = subprocess.Popen(
                list(command),
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                env=environment,
                cwd=cwd,
                start_new_session=True,  # its own group: killing it kills its children
            )
    register_group(child)
    return child


def _describe(
    processes: Sequence[GroupLeader], codes: Sequence[int | None], paths: Sequence[Path]
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
    independent: bool = False,
) -> list[WorkerResult]:
    """Run every command as its own process group; return when all exited with status 0.

    Raises LaunchError, after killing the survivors, when any worker exits non-zero (within
    `POLL_INTERVAL_S` of its death) or when `timeout_s` passes first. `independent` workers
    (no collective between them: one's death cannot hang another) are not stopped when one
    fails: the others run on to their end or the deadline, and the LaunchError comes then,
    `timed_out` when some were still running at the deadline. Returns or raises at most
    ``timeout_s + POLL_INTERVAL_S + kill_wait_s`` after the call (a SIGKILL lands in
    milliseconds; `kill_wait_s` bounds a process the kernel is slow to take down). On every
    exit path each worker's process group, with whatever the worker started, is killed before
    this returns. Each worker starts through `start_worker`, forked from `zygote` where it
    can be; the rest is the same.
    """
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    processes: list[GroupLeader] = []
    forked: list[bool] = []
    paths: list[tuple[Path, Path]] = []
    deadline = time.monotonic() + timeout_s
    stopped = False
    try:
        for index, command in enumerate(commands):
            out_path, err_path = log_dir / f"worker{index}.out", log_dir / f"worker{index}.err"
            paths.append((out_path, err_path))
            child = start_worker(
                command, stdout=out_path, stderr=err_path, env=env, cwd=cwd, zygote=zygote
            )
            processes.append(child)
            forked.append(not isinstance(child, subprocess.Popen))
        while True:
            codes = [p.poll() for p in processes]
            failed = {i: rc for i, rc in enumerate(codes) if rc not in (None, 0)}
            running = [i for i, rc in enumerate(codes) if rc is None]
            if failed and independent and running and time.monotonic() <= deadline:
                time.sleep(POLL_INTERVAL_S)  # the others are not waiting on the failed one
                continue
            if failed:
                what = "; ".join(
                    f"worker {i} (pid {processes[i].pid}) {describe_status(rc)}"
                    for i, rc in failed.items()
                )
                why = f"worker(s) {sorted(failed)} failed: {what}; the others were stopped"
            elif all(rc == 0 for rc in codes):
                break
            elif time.monotonic() > deadline:
                why = f"worker(s) {running} still running after {timeout_s:.0f} s; all stopped"
            else:
                time.sleep(POLL_INTERVAL_S)
                continue
            stop_groups(processes, wait_s=kill_wait_s)
            stopped = True
            details = _describe(processes, codes, [err for _, err in paths])
            late = bool(running) and time.monotonic() > deadline
            raise LaunchError(f"{why}\n{details}", failed=failed, timed_out=not failed or late)
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
