"""A zygote: one process imports a framework once, then forks a worker for every ``python -m``
command. The one fork server of the project: JAX workers and torch ranks alike come from one.

Importing jax, optax and orbax costs a worker process about 1.3 s of CPU before it does
anything, importing torch with what DDP and FSDP2 load on first use about 2.5 s; a harness
run starts dozens of workers. The zygote (``python -m crosscheck.launch.zygote_server
MODULE...``) imports the given modules once and stays single-threaded; for each request it
forks a child that takes the request's environment, working directory and output files and
runs the module as ``__main__`` with the request's arguments. Differences from a fresh
``python -m MODULE``: the modules the zygote imported are already imported; ``sys.argv[0]`` is
the module's name; ``sys.path`` and whatever a module reads from the environment at import
time come from the zygote's environment (so it is started with the workers'); and the child
ends with ``os._exit`` after flushing its output, so atexit handlers do not run (the workers
shut down what they start themselves).

That is sound for JAX because importing jax creates no backend: XLA_FLAGS (the fake device
count, compile flags) and ``jax.config`` updates made by the worker take effect in the child;
and for torch because importing it starts no thread with one OpenMP thread
(``OMP_NUM_THREADS=1`` in the zygote's environment) and creates no process group. Forking is
unsafe in a process that runs threads, so the zygote refuses to serve if an import started one
(OpenBLAS does unless OPENBLAS_NUM_THREADS=1).

Protocol: the client writes one JSON request per line to the zygote's stdin (an id, module,
args, env, cwd, stdout, stderr and status paths); the zygote answers one JSON line with the
same id and the child's pid, or an error. When a child exits, the zygote writes its exit code
to the request's status file (atomically) before reaping it, so the pid cannot be reused
while the client may still signal it. A closed stdin stops the zygote.

This module is the client side (`Zygote`; `shared_zygote` keeps one per preload list and
process, which `crosscheck.launch.worker_processes.start_worker` asks for workers); the zygote
process itself is `crosscheck.launch.zygote_server`.

Process groups: the zygote is started in a session of its own, and every child it forks leads
a process group of its own (``setsid`` in the child, ``setpgid`` in the zygote too, so the group
exists before the client learns the pid): a launch kills a worker's group, with whatever the
worker started, and the zygote's group is registered with `crosscheck.launch.processes` as a
server, so that its `terminate_all` stops the zygote too, after its workers.

Where it runs: only where the platform has what it uses (`unavailable` says why not): ``fork``,
``os.waitid`` with ``P_ALL``, ``WNOHANG``, ``WEXITED`` and ``WNOWAIT`` (macOS has no
``os.waitid``), ``setsid``, ``setpgid`` and ``killpg``; and not when the environment variable
``GRADWEIGHT_NO_FORK_SERVERS`` is set to anything but "" or "0". Where it does not run, no
zygote starts (`ZygoteError`; `shared_zygote` returns None) and the launches start plain
processes instead: slower, not different.

The standard library only, like `crosscheck.launch.processes`.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from crosscheck.launch import processes

#: Seconds the client waits for the zygote to answer a request (a fork takes milliseconds).
REPLY_TIMEOUT_S = 30.0
#: The zygote process's module (``python -m``).
SERVER_MODULE = "crosscheck.launch.zygote_server"
#: Set to anything but "" or "0", no fork server is used: plain processes instead.
NO_FORK_SERVERS_ENV = "GRADWEIGHT_NO_FORK_SERVERS"
#: What the zygote needs of `os`: fork, the non-reaping wait of `_reap`, and process groups.
_REQUIRED_OS = (
    "fork",
    "waitid",
    "P_ALL",
    "WNOHANG",
    "WEXITED",
    "WNOWAIT",
    "CLD_EXITED",
    "setsid",
    "setpgid",
    "killpg",
)
#: How often the zygote looks for exited children while it waits for requests.
REAP_INTERVAL_S = 0.02


class ZygoteError(RuntimeError):
    """The zygote could not start, refused to serve, or did not answer in time."""


def platform_unsupported() -> str:
    """Why this platform cannot run the zygote ('' when it can): the `os` names it lacks."""
    missing = [name for name in _REQUIRED_OS if not hasattr(os, name)]
    if missing:
        return f"this platform lacks {', '.join('os.' + name for name in missing)}"
    return ""


def unavailable(env: Mapping[str, str] | None = None) -> str:
    """Why no zygote may be used here ('' when one may): the switch, or the platform."""
    switch = (os.environ if env is None else env).get(NO_FORK_SERVERS_ENV, "")
    if switch not in ("", "0"):
        return f"fork servers are turned off ({NO_FORK_SERVERS_ENV}={switch})"
    return platform_unsupported()


class ZygoteChild:
    """A worker forked by the zygote, with the parts of ``subprocess.Popen`` a launcher uses.

    It is the zygote's child, not ours: its exit code comes from the status file the zygote
    writes when it reaps it.
    """

    def __init__(self, pid: int, status_path: Path, zygote: Zygote) -> None:
        self.pid = pid
        self._status_path = status_path
        self._zygote = zygote
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._read_status()
        if self.returncode is None and not self._zygote.alive:
            # The zygote may have written the status just before it exited: read once more.
            self.returncode = self._read_status()
            if self.returncode is None and not processes.pid_alive(self.pid):
                self.returncode = 255  # reaped by init after the zygote died: status unknown
        return self.returncode

    def _read_status(self) -> int | None:
        try:
            return int(self._status_path.read_text())
        except (FileNotFoundError, ValueError):
            return None

    def kill(self) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(REAP_INTERVAL_S)
        return self.returncode  # type: ignore[return-value]


class Zygote:
    """The client side: start the zygote, ask it for workers, stop it. Thread-safe.

    Started as a process of its own (`Zygote(preload, env, log)`), it talks over that process's
    stdin and stdout; forked from another zygote (`forked`), over a Unix socket."""

    def __init__(
        self,
        preload: Sequence[str],
        env: Mapping[str, str],
        log_path: str | Path,
        *,
        _parent: Zygote | None = None,
        _sys_path: Sequence[str] = (),
        _ready_timeout_s: float = REPLY_TIMEOUT_S,
    ) -> None:
        why_not = unavailable()
        if why_not:
            raise ZygoteError(f"no zygote: {why_not}")
        self._lock = threading.Lock()
        self._log_path = Path(log_path)
        self._reply_buffer = b""
        self._next_id = 0
        self._channel: socket.socket | None = None
        self._folder: str | None = None
        if _parent is None:
            with self._log_path.open("ab") as log:  # the child keeps its own copy of the fd
                self._process: processes.GroupLeader = subprocess.Popen(
                    [sys.executable, "-m", SERVER_MODULE, *preload],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    env=dict(env),
                    start_new_session=True,  # a group of its own, like every worker
                )
            self._send_fd = self._process.stdin.fileno()  # type: ignore[attr-defined]
            self._reply_fd = self._process.stdout.fileno()  # type: ignore[attr-defined]
        else:
            try:
                self._process = self._fork_from(_parent, preload, env, _sys_path, _ready_timeout_s)
            except BaseException:
                shutil.rmtree(self._folder or "", ignore_errors=True)
                raise
        processes.register_group(self._process, server=True)
        try:
            ready = self._read_reply(_ready_timeout_s)
        except BaseException as error:
            self._process.kill()  # it may still be importing: not worth a graceful wait
            self.close()  # its log, when empty, and its folder go with it
            if not isinstance(error, Exception):
                raise  # an interrupt (Ctrl-C while it imports): the command ends as asked
            raise ZygoteError(f"the zygote did not start: {error}") from error
        if ready.get("ready") is not True:
            self.close()
            raise ZygoteError(f"the zygote refused to serve: {ready.get('error', ready)}")

    @classmethod
    def forked(
        cls,
        parent: Zygote,
        preload: Sequence[str],
        env: Mapping[str, str],
        log_path: str | Path,
        *,
        sys_path: Sequence[str] = (),
        ready_timeout_s: float = REPLY_TIMEOUT_S,
    ) -> Zygote:
        """A zygote forked from `parent` that imports `preload` too, with `sys_path` in front of
        the parent's: what the parent imported costs it nothing, so a caller's own modules (a
        user's step, which imports transformers, say) are imported once for all the workers
        of a run instead of once by each. Closed by the caller when the run ends (a module of
        the caller's may change between runs); ZygoteError when it cannot start (the module
        cannot be imported, starts a thread, or takes longer than `ready_timeout_s`)."""
        return cls(
            preload,
            env,
            log_path,
            _parent=parent,
            _sys_path=sys_path,
            _ready_timeout_s=ready_timeout_s,
        )

    def _fork_from(
        self,
        parent: Zygote,
        preload: Sequence[str],
        env: Mapping[str, str],
        sys_path: Sequence[str],
        timeout_s: float,
    ) -> processes.GroupLeader:
        """Ask `parent` for a zygote process that connects back to a socket of this client's."""
        self._folder = tempfile.mkdtemp(prefix="gradweight-zygote-")
        address = os.path.join(self._folder, "channel")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(address)
            listener.listen(1)
            args = ["--connect", address, "--path", json.dumps(list(sys_path)), *preload]
            child = parent.spawn(
                SERVER_MODULE,
                args,
                env=env,
                cwd=None,
                stdout=Path(self._folder, "out"),
                stderr=Path(self._folder, "err"),
            )
            listener.settimeout(timeout_s)
            try:
                self._channel, _ = listener.accept()
            except OSError as error:  # it died or hung before it connected
                processes.stop_groups([child], wait_s=5.0)  # with whatever it started
                raise ZygoteError(f"the forked zygote did not connect: {error}") from error
        finally:
            listener.close()
        self._channel.settimeout(None)
        self._send_fd = self._reply_fd = self._channel.fileno()
        return child

    @property
    def alive(self) -> bool:
        return self._process.poll() is None

    @property
    def pid(self) -> int:
        """The zygote's pid (also its process group's id)."""
        return self._process.pid

    def spawn(
        self,
        module: str,
        args: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: str | Path | None,
        stdout: Path,
        stderr: Path,
    ) -> ZygoteChild:
        """Fork a child running ``python -m module *args`` with this environment and output."""
        status = stderr.with_name(stderr.name + ".exitcode")
        status.unlink(missing_ok=True)
        request = {
            "id": None,
            "module": module,
            "args": list(args),
            "env": dict(env),
            "cwd": None if cwd is None else str(cwd),
            "stdout": str(stdout),
            "stderr": str(stderr),
            "status": str(status),
        }
        with self._lock:
            if not self.alive:
                raise ZygoteError(f"the zygote exited with {self._process.poll()}")
            self._next_id += 1
            request["id"] = self._next_id
            try:
                self._send(json.dumps(request).encode() + b"\n")
                reply = self._read_reply(REPLY_TIMEOUT_S)
            except (OSError, ValueError, ZygoteError) as error:
                # A reply that never came may still come later and be taken for the next
                # request's: a zygote that lost step is stopped, not reused.
                self._process.kill()
                raise ZygoteError(f"the zygote failed to start {module}: {error}") from error
            if reply.get("id") != request["id"]:
                self._process.kill()
                raise ZygoteError(
                    f"the zygote answered request {reply.get('id')}, not {request['id']}"
                )
        if "pid" not in reply:
            raise ZygoteError(f"the zygote could not start {module}: {reply.get('error', reply)}")
        return ZygoteChild(int(reply["pid"]), status, self)

    def _send(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self._send_fd, view) :]

    def _read_reply(self, timeout_s: float) -> dict:
        """One JSON line from the zygote, within `timeout_s`."""
        fd = self._reply_fd
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._reply_buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ZygoteError(f"no answer from the zygote within {timeout_s:g} s")
            readable, _, _ = select.select([fd], [], [], left)
            if readable:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise ZygoteError(f"the zygote closed its output; see {self._log_path}")
                self._reply_buffer += chunk
        line, self._reply_buffer = self._reply_buffer.split(b"\n", 1)
        return json.loads(line)

    def close(self) -> None:
        """Stop the zygote, within 15 s. Its running children are not its to stop: each is
        killed, with its process group, by the launch that asked for it."""
        with contextlib.suppress(OSError):
            if self._channel is not None:
                self._channel.close()  # end of its requests: it exits
            else:
                self._process.stdin.close()  # type: ignore[attr-defined]
        try:
            self._process.wait(timeout=5.0)  # type: ignore[attr-defined]
        except subprocess.TimeoutExpired:
            self._process.kill()  # type: ignore[attr-defined]
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(timeout=5.0)  # type: ignore[attr-defined]
        processes.stop_groups([self._process], wait_s=5.0)  # forgets it once it is gone
        if self._folder is not None:
            with contextlib.suppress(OSError):  # what it said, kept where the caller looks
                said = Path(self._folder, "err").read_bytes()
                if said:
                    with self._log_path.open("ab") as log:
                        log.write(said)
            shutil.rmtree(self._folder, ignore_errors=True)
        with contextlib.suppress(OSError):
            if self._log_path.stat().st_size == 0:  # nothing went wrong: leave nothing behind
                self._log_path.unlink()


#: How many zygotes one process may start for one preload list: one, and a replacement when
#: it was stopped (by `crosscheck.launch.processes.terminate_all` after an interrupt, or a
#: crash); not one per launch.
MAX_ZYGOTE_STARTS = 5
_shared_lock = threading.Lock()
#: preload list -> (the zygote or None, how many were started).
_shared: dict[tuple[str, ...], tuple[Zygote | None, int]] = {}


def shared_zygote(preload: Sequence[str], env: Mapping[str, str]) -> Zygote | None:
    """This process's zygote for `preload`, started on first use with `env`; None where none
    may run.

    None, and the caller starts plain processes (slower, not different), when `unavailable`
    says so (checked on every call), or when a zygote refused to serve or failed to start. A
    zygote that has exited since (stopped on an interrupt) is replaced, up to
    `MAX_ZYGOTE_STARTS` starts per preload list and process. The zygote keeps `env` of its
    start for what modules read at import; each worker gets the environment of its request.
    """
    if unavailable():
        return None
    key = tuple(preload)
    with _shared_lock:
        zygote, starts = _shared.get(key, (None, 0))
        if zygote is not None and zygote.alive:
            return zygote
        if starts >= MAX_ZYGOTE_STARTS:
            return None
        name = key[0].split(".")[0] if key else "none"
        log = Path(tempfile.gettempdir()) / f"gradweight-zygote-{name}-{os.getpid()}.log"
        try:
            zygote = Zygote(key, env, log)
        except Exception:  # any failure to start means: no zygote, plain processes
            _shared[key] = (None, MAX_ZYGOTE_STARTS)  # one that failed to start would again
            return None
        _shared[key] = (zygote, starts + 1)
        processes.close_at_exit(zygote.close)
        return zygote
