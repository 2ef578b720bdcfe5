"""What runs inside a rank process of `torch_impl.harness.launcher.launch`, and what it leaves.

A rank is ``python -m torch_impl.harness.rank_main WORKDIR RANK WORLD_SIZE INIT_METHOD
TIMEOUT_S DEVICE`` (`main`), forked from the ranks' zygote or a fresh interpreter. `worker`
leads a process group of its own, reads the job from ``job.pkl`` in the launch's directory
(`write_job`: the caller's ``sys.path``, its main script when `fn` lives there, then ``(fn,
args)``), joins the gloo process group, calls ``fn(rank, world_size, *args)``, and leaves
``result-{rank}.pkl`` (the value) and then ``report-{rank}.pkl`` (a `Report`: ok, or the
traceback) for the launcher, which polls for the reports. Every file is written atomically
(`crosscheck.launch.worker_processes.write_atomically`), so a rank killed at any moment
leaves a whole file or none. `finish_rank` ends a rank at once, as if `fn` had returned, from
any of its threads.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import os
import pickle
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from crosscheck.launch.processes import usable_cores
from crosscheck.launch.worker_processes import write_atomically

#: The job every rank reads (`write_job`).
JOB_FILE = "job.pkl"
#: The name the caller's main script is imported under in a rank, as multiprocessing does: a
#: rank's own ``__main__`` is `torch_impl.harness.rank_main`.
MAIN_SCRIPT_MODULE = "__mp_main__"


@dataclass(frozen=True, slots=True)
class Report:
    """What a rank leaves in ``report-{rank}.pkl`` once `fn` returned, raised or was cut short."""

    ok: bool
    #: The traceback when not ok.
    details: str
    #: ``time.monotonic()`` when written: CLOCK_MONOTONIC is one clock for every process of
    #: the machine, so reports of different ranks are ordered by it.
    written_at: float


def result_file(rank: int) -> str:
    return f"result-{rank}.pkl"


def report_file(rank: int) -> str:
    return f"report-{rank}.pkl"


def write_pickle(path: str, value: Any) -> None:
    """`value` pickled to `path`, atomically (`write_atomically`)."""
    write_atomically(path, pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))


def write_job(workdir: str, fn: Callable[..., Any], args: tuple) -> None:
    """The job of every rank of a launch: where the caller imports from (``sys.path``), its
    main script when `fn` is defined there, and ``(fn, args)`` pickled on their own, so that a
    rank sets the first two up before it unpickles `fn` by its module's name."""
    main = sys.modules.get("__main__")
    script = getattr(main, "__file__", None) if fn.__module__ == "__main__" else None
    payload = pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL)
    write_pickle(os.path.join(workdir, JOB_FILE), (list(sys.path), script, payload))


def read_job(workdir: str) -> tuple[Callable[..., Any], tuple]:
    """``(fn, args)`` of `write_job`, with the caller's ``sys.path`` in place first and its main
    script imported as `MAIN_SCRIPT_MODULE` (its ``if __name__ == "__main__"`` block does not
    run) and taken for ``__main__`` where `fn` lives in it."""
    with open(os.path.join(workdir, JOB_FILE), "rb") as f:
        path, script, payload = pickle.load(f)
    sys.path[:] = [*path, *(p for p in sys.path if p not in path)]
    if script is not None:
        spec = importlib.util.spec_from_file_location(MAIN_SCRIPT_MODULE, script)
        module = importlib.util.module_from_spec(spec)
        sys.modules[MAIN_SCRIPT_MODULE] = module
        spec.loader.exec_module(module)
        sys.modules["__main__"] = module
    return pickle.loads(payload)


class _RankSlot:
    """This rank's report, written once: by `worker`'s main thread or by `finish_rank`."""

    def __init__(self, rank: int, workdir: str) -> None:
        self.rank = rank
        self.workdir = workdir
        self.lock = threading.Lock()
        self.reported = False

    def report(self, ok: bool, value: Any = None, details: str = "") -> bool:
        """Write the result (when ok) and then the report; False when one was written before.

        Held locked by the caller of `finish_rank` until the process ends, so a report cannot
        be overwritten by the main thread finishing at the same moment.
        """
        if self.reported:
            return False
        if ok:
            write_pickle(os.path.join(self.workdir, result_file(self.rank)), value)
        # The report goes last: once it exists, the result it announces is complete.
        report = Report(ok, details, time.monotonic())
        write_pickle(os.path.join(self.workdir, report_file(self.rank)), report)
        self.reported = True
        return True


#: The name the pinned torch's gloo gives each process group's device loop: the thread that
#: reads all of the group's sockets (gloo/transport/tcp/loop.cc).
GLOO_LOOP_THREAD = "gloo_tcp_loop"
#: The lowest priority; any process may give it to its own threads.
GLOO_LOOP_NICENESS = 19
#: How often a rank looks for the loops of process groups made after its first (a subgroup, a
#: device mesh's): every group starts one of its own.
GLOO_LOOP_WATCH_S = 0.2


def lower_gloo_loops() -> int:
    """Give every gloo device loop of this process the lowest priority; how many it lowered.

    A loop that cannot take a message yet leaves it in the socket and calls ``epoll_wait``
    again, which returns at once (level-triggered): gloo's `Pair::handleEvents`
    (gloo/transport/tcp/pair.cc L643-655 at gloo cc441984) gives up when another thread holds
    the pair's lock, and a message for a buffer not yet posted waits the same way. The loop
    spins until that other thread has run. With more ranks than cores that thread is often
    waiting for a core, and the loop spends its whole time slice spinning. At the lowest
    priority a spinning loop gives its core up to any other thread; alone on a core it runs
    as before. Nothing a collective computes changes. Measured (`perf stat`, 1000 all-reduces
    of 8 float64 over 4 ranks on 2 cores): 14.4 million ``epoll_wait`` calls, 6.0 s of wall
    and 7.7 s of CPU before; 5.7 million, 3.8 s and 4.8 s at niceness 19. Without /proc (not
    Linux) this does nothing.
    """
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        return 0
    lowered = 0
    for name in os.listdir(tasks):
        try:
            with open(os.path.join(tasks, name, "comm")) as comm:
                if comm.read().strip() != GLOO_LOOP_THREAD:
                    continue
            if os.getpriority(os.PRIO_PROCESS, int(name)) < GLOO_LOOP_NICENESS:
                os.setpriority(os.PRIO_PROCESS, int(name), GLOO_LOOP_NICENESS)
                lowered += 1
        except OSError:  # the thread ended while we looked
            continue
    return lowered


def bind_to_core(rank: int, world_size: int) -> int | None:
    """With at least as many ranks as this process may use cores, pin rank r (every thread and
    process it starts afterwards, gloo's threads included) to core r mod n of the n allowed;
    the core, or None where nothing is pinned (fewer ranks than cores, no
    ``sched_setaffinity``).

    Every core then holds the same number of ranks, give or take one, and so does it for
    every other group of this size started beside this one: the group spans them all. With
    fewer ranks than cores nothing is pinned, since several small groups pinned alike would
    crowd the first cores. Why: a rank's gloo loop spins while the thread it waits for has no
    core (`lower_gloo_loops`); on the loop's own core, at the lowest priority, the spin gives
    way to that thread at once, where an unpinned thread may wait on another core. Nothing a
    collective computes changes. Measured (1000 all-reduces of 8 float64 over 4 ranks on 2
    cores, the loops at niceness 19): 2.6 ms of wall and 3.7 ms of CPU per all-reduce
    unpinned, 1.0 ms and 1.7 ms pinned. (The bench, which runs alone, also gives each rank
    cores of its own where there are enough: `crosscheck.bench.torch_bench.pin_to_own_cores`.)
    """
    if not hasattr(os, "sched_setaffinity"):
        return None
    cores = usable_cores()
    if world_size < len(cores):
        return None
    core = cores[rank % len(cores)]
    os.sched_setaffinity(0, {core})
    return core


def _watch_gloo_loops() -> None:
    """`lower_gloo_loops` now and, from a daemon thread, every GLOO_LOOP_WATCH_S after."""
    lower_gloo_loops()

    def watch() -> None:
        while True:
            time.sleep(GLOO_LOOP_WATCH_S)
            lower_gloo_loops()

    threading.Thread(target=watch, name="gloo-loop-watch", daemon=True).start()


#: Set in a rank process by `worker`; None elsewhere.
_slot: _RankSlot | None = None


def finish_rank(value: Any) -> NoReturn:
    """End this rank now, as if `fn` had returned `value`; callable from any thread of a rank.

    For a rank whose main thread cannot return: blocked in a collective that a failed peer
    will never join (gloo cannot be woken from it until its timeout). The result and report
    are written, then the process exits at once (``os._exit``: no clean-up runs, the peers'
    collectives with it fail). Only in a rank process started by `launch`.
    """
    slot = _slot
    if slot is None:
        raise RuntimeError("finish_rank() is only for a rank process started by launch()")
    slot.lock.acquire()  # never released: the process ends holding it
    try:
        slot.report(True, value)
    finally:
        # Flush what the rank printed: os._exit skips it.
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(0)


def worker(
    rank: int,
    world_size: int,
    init_method: str,
    collective_timeout_s: float,
    workdir: str,
    device: str = "cpu",
) -> None:
    # First of all, before anything can start a child: lead a process group of its own, so that
    # the launcher's killpg() also ends whatever this rank's code starts.
    with contextlib.suppress(OSError):  # EPERM: already a group leader
        os.setsid()
    global _slot
    slot = _slot = _RankSlot(rank, workdir)
    # Several ranks share few cores: one intra-op thread each avoids oversubscription.
    torch.set_num_threads(1)
    if device == "cpu":
        bind_to_core(rank, world_size)  # before gloo starts its threads, which inherit it
    try:
        fn, args = read_job(workdir)
        if device == "cuda":
            # One rank per GPU, on one machine: the rank is the local rank. NCCL needs the
            # current device set before its first collective; the default device puts the
            # harness's models and batches there without a `.to` at every construction.
            torch.cuda.set_device(rank)
            torch.set_default_device(f"cuda:{rank}")
        dist.init_process_group(
            "nccl" if device == "cuda" else "gloo",
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=collective_timeout_s),
        )
        # Creating the gloo group is no synchronization point: a rank whose side of the mesh
        # is connected may run a short `fn` and exit while a peer is still connecting to it,
        # which then fails with "Connection closed by peer" (pytorch#61396). Every rank waits
        # here until the whole group is up.
        dist.barrier()
        _watch_gloo_loops()
        value = fn(rank, world_size, *args)
        outcome: tuple[bool, Any, str] = (True, value, "")
    except BaseException:
        outcome = (False, None, traceback.format_exc())
    # Report before leaving the process group: once this rank's sockets close its peers fail
    # too, and their reports must not be older than the root cause's.
    with slot.lock:
        ok, value, details = outcome
        try:
            slot.report(ok, value, details)
        except BaseException:  # the value did not pickle, say: a failure still reports
            slot.report(False, None, traceback.format_exc())
    if dist.is_initialized():
        dist.destroy_process_group()


def main(argv: Sequence[str]) -> int:
    """A rank's command line: ``WORKDIR RANK WORLD_SIZE INIT_METHOD TIMEOUT_S DEVICE``."""
    workdir, rank, world_size, init_method, timeout_s, device = argv
    worker(int(rank), int(world_size), init_method, float(timeout_s), workdir, device)
    return 0
