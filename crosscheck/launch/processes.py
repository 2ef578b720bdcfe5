"""Stopping every process a command started, and Ctrl-C / SIGTERM as one line, not a traceback.

The launchers own their processes (`torch_impl.harness.launcher`, `jax_impl.harness.launch`): each
keeps a registry of the process groups it started and exposes ``terminate_all(grace_s) -> int``
(SIGTERM to every group, SIGKILL after `grace_s`, reap; returns how many processes it
signalled). `terminate_all` here calls them, but only for launcher modules this process has
already imported: a command that never launched anything has nothing to stop, and importing a
launcher here could import torch or JAX.

`handle_signals` is what `crosscheck.cli.commands.main` runs a command in: SIGTERM becomes the same
KeyboardInterrupt as Ctrl-C (raised in the main thread), and on the way out of an interrupt
every started process is stopped and one line goes to stderr. `exit_bounded` then ends the
interpreter in bounded time even where a worker thread (`crosscheck.launch.schedule.run_jobs` starts
non-daemon ones, which the interpreter would wait for at exit) is still winding down.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, ModuleType
from typing import NoReturn

#: The launcher modules, by the names they are imported under. `jax_impl.harness.launch` may also
#: be loaded from its file alone (`crosscheck.launch.workers.jax_launch`), so modules are
#: matched by file too (see `_launchers`).
LAUNCHER_MODULES: tuple[str, ...] = ("torch_impl.harness.launcher", "jax_impl.harness.launch")
_ROOT = Path(__file__).resolve().parents[2]
LAUNCHER_FILES: tuple[Path, ...] = (
    _ROOT / "torch_impl" / "harness" / "launcher.py",
    _ROOT / "jax_impl" / "harness" / "launch.py",
)
#: How long a launcher gives its process groups between SIGTERM and SIGKILL.
GRACE_S = 2.0
#: How long `exit_bounded` waits for worker threads before it ends the process regardless,
#: and how often it stops processes again meanwhile.
THREAD_WAIT_S = 1.5
ROUND_S = 0.25
#: The grace of `exit_bounded`'s last `terminate_all`: the interrupt's own call gave every
#: process it knew GRACE_S already; this one is for processes started since.
FINAL_GRACE_S = 0.25


def _launchers() -> list[ModuleType]:
    """Every launcher module this process has imported, each once."""
    found: dict[int, ModuleType] = {}
    for name in LAUNCHER_MODULES:
        module = sys.modules.get(name)
        if module is not None:
            found[id(module)] = module
    # A copy of the dict: another thread may import a module while this one iterates.
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if not file or id(module) in found:
            continue
        with contextlib.suppress(OSError, ValueError):
            if Path(file).resolve() in LAUNCHER_FILES:
                found[id(module)] = module
    return list(found.values())


def terminate_all(grace_s: float = GRACE_S) -> int:
    """Stop every process the launchers of this process started; how many were signalled.

    Never raises and never imports torch or JAX: a launcher not imported yet started nothing,
    and one without ``terminate_all`` (an older copy) is skipped.
    """
    stopped = 0
    for module in _launchers():
        terminate = getattr(module, "terminate_all", None)
        if not callable(terminate):
            continue
        try:
            stopped += int(terminate(grace_s=grace_s) or 0)
        except Exception:
            # The contract says it never raises; if one does, the other launcher still runs.
            continue
    return stopped


@dataclass
class Interruption:
    """What `handle_signals` saw: the signal that interrupted the command ('' when none)."""

    signal_name: str = ""
    #: Processes still running at the interrupt, stopped by `terminate_all`.
    stopped: int = 0

    @property
    def interrupted(self) -> bool:
        return bool(self.signal_name)

    def message(self, prog: str = "crosscheck") -> str:
        """The one line printed on stderr."""
        if self.stopped:
            plural = "es" if self.stopped != 1 else ""
            what = f"stopped {self.stopped} process{plural} it had started"
        else:
            what = "no process it started is left running"
        return f"{prog}: interrupted by {self.signal_name}; {what}"


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    # Python delivers signals to the main thread: raising here unwinds the command exactly as
    # Ctrl-C does, through every launcher's `finally`.
    raise KeyboardInterrupt(signal.Signals(signum).name)


def interrupt_on_sigterm() -> None:
    """From now on SIGTERM raises KeyboardInterrupt("SIGTERM") in the main thread, as Ctrl-C
    does (main thread only; `handle_signals` does this for the length of a command)."""
    signal.signal(signal.SIGTERM, _raise_interrupt)


@contextlib.contextmanager
def handle_signals(prog: str = "crosscheck") -> Iterator[Interruption]:
    """Run a command with SIGTERM handled like Ctrl-C; an interrupt ends the `with` quietly.

    Inside the block, SIGTERM raises KeyboardInterrupt in the main thread. A KeyboardInterrupt
    out of the block is not re-raised: every process the launchers started is stopped
    (`terminate_all`), one line goes to stderr, and the yielded `Interruption` says what
    happened, so that the caller returns `crosscheck.exit_codes.INTERRUPTED`. Further SIGINT
    and SIGTERM are ignored while processes are being stopped (a second Ctrl-C must not leave
    them half-stopped); the previous handlers are restored on the way out. Outside the main
    thread signals cannot be handled: there only the interrupt is caught.
    """
    interruption = Interruption()
    main_thread = threading.current_thread() is threading.main_thread()
    previous: dict[signal.Signals, object] = {}
    if main_thread:
        previous[signal.SIGTERM] = signal.getsignal(signal.SIGTERM)
        previous[signal.SIGINT] = signal.getsignal(signal.SIGINT)
        signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        yield interruption
    except KeyboardInterrupt as error:
        name = str(error.args[0]) if error.args and str(error.args[0]).startswith("SIG") else ""
        interruption.signal_name = name or "SIGINT"
        if main_thread:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        interruption.stopped = terminate_all()
        print(interruption.message(prog), file=sys.stderr, flush=True)
    finally:
        for signum, handler in previous.items():
            # A handler installed from C reads as None and cannot be set back: default then.
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)  # type: ignore[arg-type]


def exit_bounded(code: int, wait_s: float = THREAD_WAIT_S) -> NoReturn:
    """Exit with `code` in bounded time, whatever worker threads still do.

    For the command-line process only (never from a library call): the interpreter waits for
    every non-daemon thread at exit, and a harness thread may still be waiting on a process
    that was just killed, or be starting one (a launch that was under way at the interrupt).
    For up to `wait_s` the threads are given time to end (and to remove their temporary
    folders) while processes are stopped again every `ROUND_S`, with a short grace: each
    round stops what a thread started since the last. Then one last round, and if a thread
    is still alive the process ends at once (``os._exit``).
    """
    deadline = time.monotonic() + wait_s
    current = threading.current_thread()

    def running() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t is not current and not t.daemon]

    while (threads := running()) and time.monotonic() < deadline:
        threads[0].join(min(ROUND_S, max(0.0, deadline - time.monotonic())))
        terminate_all(grace_s=FINAL_GRACE_S)
    terminate_all(grace_s=FINAL_GRACE_S)
    if any(t.is_alive() for t in running()):
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)
    sys.exit(code)
