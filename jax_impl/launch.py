"""Start real worker processes and wait for them with every wait bounded.

A multi-process collective hangs when one peer dies: the others wait for a message that never
comes. So the launcher polls all processes, and as soon as one exits with an error, or the
deadline passes, it kills the rest (by the pids it started) and raises with each process's exit
status and the tail of its stderr. Output goes to files, never to pipes, so a chatty worker
cannot block on a full pipe buffer either.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # not at run time: this module must load without the jax_impl package
    from jax_impl.zygote import Zygote

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
KILL_WAIT_S = 10.0


class LaunchError(RuntimeError):
    """A worker failed or the deadline passed; the message holds every worker's status."""


@dataclass(frozen=True, slots=True)
class WorkerResult:
    """One finished worker: its index, exit status and where its output went."""

    index: int
    returncode: int
    stdout_path: Path
    stderr_path: Path

    def stderr_tail(self, num_chars: int = 3000) -> str:
        text = self.stderr_path.read_text(errors="replace")
        return text[-num_chars:]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for the jax coordinator)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _stop_and_describe(processes: Sequence[subprocess.Popen], paths: Sequence[Path]) -> str:
    """Kill the survivors, then one status paragraph per worker with its stderr tail."""
    running = [p.poll() is None for p in processes]
    _kill(processes)
    lines = []
    for index, (process, was_running, path) in enumerate(
        zip(processes, running, paths, strict=True)
    ):
        state = "still running (killed)" if was_running else f"exited with {process.returncode}"
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
) -> list[WorkerResult]:
    """Run every command as its own process; return when all exited with status 0.

    Raises LaunchError, after killing the survivors, when any worker exits non-zero or when
    `timeout_s` passes first. Never waits longer than `timeout_s` plus the kill grace period.
    With a `zygote`, commands of the form ``[sys.executable, "-m", MODULE, *ARGS]`` are forked
    from it (`jax_impl.zygote`) instead of started afresh; the rest is the same.
    """
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    processes: list[subprocess.Popen] = []
    paths: list[tuple[Path, Path]] = []
    deadline = time.monotonic() + timeout_s
    try:
        for index, command in enumerate(commands):
            out_path, err_path = log_dir / f"worker{index}.out", log_dir / f"worker{index}.err"
            paths.append((out_path, err_path))
            if zygote is not None and zygote.alive and list(command[:2]) == [sys.executable, "-m"]:
                try:
                    processes.append(
                        zygote.spawn(
                            command[2],
                            command[3:],
                            env=dict(os.environ if env is None else env),
                            cwd=cwd,
                            stdout=out_path,
                            stderr=err_path,
                        )
                    )
                    continue
                except zygote.Error:
                    pass  # a zygote that failed is a slower start, not a failed worker
            with out_path.open("wb") as out, err_path.open("wb") as err:
                processes.append(
                    subprocess.Popen(
                        list(command),
                        stdout=out,
                        stderr=err,
                        stdin=subprocess.DEVNULL,
                        env=dict(os.environ if env is None else env),
                        cwd=cwd,
                    )
                )
        while True:
            codes = [p.poll() for p in processes]
            failed = [i for i, rc in enumerate(codes) if rc not in (None, 0)]
            if failed:
                details = _stop_and_describe(processes, [err for _, err in paths])
                raise LaunchError(f"worker(s) {failed} failed; the others were stopped\n{details}")
            if all(rc == 0 for rc in codes):
                break
            if time.monotonic() > deadline:
                running = [i for i, rc in enumerate(codes) if rc is None]
                details = _stop_and_describe(processes, [err for _, err in paths])
                raise LaunchError(
                    f"worker(s) {running} still running after {timeout_s:.0f} s; all stopped\n"
                    f"{details}"
                )
            time.sleep(POLL_INTERVAL_S)
    finally:
        _kill(processes)
    return [
        WorkerResult(i, p.returncode, out_path, err_path)
        for i, (p, (out_path, err_path)) in enumerate(zip(processes, paths, strict=True))
    ]


def _kill(processes: Sequence[subprocess.Popen]) -> None:
    """Kill every process still running (only the ones this launcher started) and reap it."""
    for process in processes:
        if process.poll() is None:
            process.kill()
    for process in processes:
        # A SIGKILL that has not landed within the grace period is left to the OS.
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=KILL_WAIT_S)
