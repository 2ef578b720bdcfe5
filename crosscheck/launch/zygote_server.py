"""The zygote process: import a framework once, then fork a worker for every request on stdin.

``python -m crosscheck.launch.zygote_server MODULE...`` imports the given modules, checks that
it is still single-threaded (fork is unsafe otherwise), says it is ready, and for each JSON
request line forks a child that becomes ``python -m MODULE ARGS`` with the request's
environment, working directory and output files. The protocol, and what differs from a fresh
process, are described with the client, `crosscheck.launch.zygote`.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import runpy
import select
import socket
import sys
import threading
import traceback
import warnings
from collections.abc import Sequence

from crosscheck.launch.worker_processes import write_atomically
from crosscheck.launch.zygote import REAP_INTERVAL_S, platform_unsupported


def _write(line: dict) -> None:
    os.write(1, json.dumps(line).encode() + b"\n")


def _thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _child(request: dict) -> None:
    """In the forked child: become ``python -m module args`` and exit with its status."""
    code = 1
    try:
        # A group of our own, so that killing it kills what the worker starts too. The zygote
        # makes us a group leader as well (setpgid), which fails setsid: then the group it
        # made is ours, and a session of our own is only a nicety.
        with contextlib.suppress(OSError):
            os.setsid()
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        try:
            out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except FileNotFoundError:
            if os.path.isdir(os.path.dirname(request["stdout"]) or "."):
                raise
            # Its log folder is gone: the client stopped waiting (an interrupt removed it
            # between the request and the fork), and nobody will read a traceback here.
            os._exit(code)
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.environ.clear()
        os.environ.update(request["env"])
        if request["cwd"]:
            os.chdir(request["cwd"])
        sys.argv = [request["module"], *request["args"]]
        # The zygote imported the module on purpose (its preload); runpy warns that it runs a
        # second copy as __main__, which a worker's ``if __name__ == "__main__"`` block expects
        # (it calls into the imported module).
        warnings.filterwarnings(
            "ignore",
            message=".*found in sys.modules after import of package",
            category=RuntimeWarning,
        )
        try:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exit_:
            if exit_.code is None or isinstance(exit_.code, int):
                code = exit_.code or 0
            else:
                print(exit_.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _reap(children: dict[int, str]) -> None:
    """Write the exit code of every child that has exited to its status file, then reap it.

    ``waitid(WNOWAIT)`` leaves the exited child a zombie while its status is written, so its
    pid is not free for reuse until the client can see that it exited.
    """
    while children:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if info is None or info.si_pid == 0:
            return
        code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        path = children.pop(info.si_pid, None)
        if path is not None:
            with contextlib.suppress(OSError):  # its log directory is gone: nobody waits
                write_atomically(path, str(code).encode())
        os.waitpid(info.si_pid, 0)


def serve(preload: Sequence[str]) -> int:
    """Import `preload`, then fork a child per request on stdin until stdin closes."""
    why_not = platform_unsupported()
    if why_not:  # the client checks too; a zygote started anyway must not fail its first job
        _write({"ready": False, "error": why_not})
        return 3
    try:
        for module in preload:
            importlib.import_module(module)
    except BaseException as error:  # a module that cannot be imported: no zygote, plain workers
        _write({"ready": False, "error": f"importing {module}: {type(error).__name__}: {error}"})
        return 3
    threads = _thread_count()
    if threads != 1:
        _write({"ready": False, "error": f"{threads} threads after the imports; fork is unsafe"})
        return 3
    # What the imports left alive lives as long as every child: out of the collector's sight
    # (Python's advice for fork without exec), a child's full collections skip it instead of
    # walking it, and do not write to its pages (copy-on-write). Tracing JAX programs makes
    # many objects: the in-process JAX workers took about 5% less CPU (docs/performance.md).
    gc.collect()
    gc.freeze()
    _write({"ready": True})
    children: dict[int, str] = {}
    buffer = b""
    while True:
        readable, _, _ = select.select([0], [], [], REAP_INTERVAL_S)
        _reap(children)
        if not readable:
            continue
        chunk = os.read(0, 65536)
        if not chunk:
            break
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            request: dict = {}
            try:
                request = json.loads(line)
                pid = os.fork()
            except Exception as error:
                _write({"id": request.get("id"), "error": f"{type(error).__name__}: {error}"})
                continue
            if pid == 0:
                _child(request)
            # The child's group exists before the client learns its pid (the child's own
            # setsid may not have run yet): a kill of the group can never miss it.
            with contextlib.suppress(OSError):
                os.setpgid(pid, pid)
            children[pid] = request["status"]
            _write({"id": request["id"], "pid": pid})
    # stdin closed: the client is gone or done. Children already running finish on their own.
    return 0


def main(argv: Sequence[str]) -> int:
    """``[--connect SOCKET] [--path JSON] MODULE...``: serve after importing the modules.

    A zygote started by its client as a process of its own talks over its stdin and stdout.
    One forked from another zygote (`crosscheck.launch.zygote.Zygote.forked`) has its stdio
    in files, so it talks over the Unix socket `--connect` names instead (the client listens
    there), and imports with the client's ``sys.path`` (`--path`, a JSON list) in front of
    its own: the modules it preloads are the client's (a user's step module).
    """
    args = list(argv)
    connect = path = None
    while args and args[0] in ("--connect", "--path"):
        flag, value, args = args[0], args[1], args[2:]
        if flag == "--connect":
            connect = value
        else:
            path = value
    if path is not None:
        wanted = [entry for entry in json.loads(path) if entry not in sys.path]
        sys.path[:0] = wanted
    if connect is not None:
        channel = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        channel.connect(connect)
        fd = channel.detach()
        os.dup2(fd, 0)
        os.dup2(fd, 1)
        os.close(fd)
    return serve(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
