"""Running harness cases on JAX: a worker per front-end and world size, a launch per world size.

The in-process front-ends (pmap, shard_map, global jit) run in `crosscheck.run.jax_worker`
with eight fake CPU devices, one worker process per front-end, world size and dtype; the
multi-process front-end runs `jax_impl.harness.multiprocess` on R real processes joined by
jax.distributed over gloo, one launch per world size serving every case of that size. Every
worker is forked from one zygote that imported JAX once (`jax_impl.harness.zygote`) where the
platform allows it and ``GRADWEIGHT_NO_FORK_SERVERS`` is not set (else a plain process each), and
every wait is bounded by `jax_impl.harness.launch.run_workers`, which also kills each worker's
process group when its launch ends.
"""

from __future__ import annotations

import atexit
import functools
import os
import pickle
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from crosscheck.contract.cases import Case, CaseOutput, RankMetrics, TrainSettings
from crosscheck.fixtures.builtin import builtin_fixture
from crosscheck.launch.schedule import Job

if TYPE_CHECKING:
    from jax_impl.harness.zygote import Zygote

OnDone = Callable[[Case, CaseOutput | BaseException], None]

IN_PROCESS = ("jax-pmap", "jax-shard_map", "jax-jit")
WORKER_TIMEOUT_S = 300.0
MULTIPROCESS_SIZES = (2, 4)
#: Params' dtypes every JAX front-end runs. bfloat16 runs without x64: the cross-entropy, the
#: loss sums, d, D and g / D are float32 there whatever the params' dtype
#: (`jax_impl.denominators`); only params, gradients and optimizer state are bfloat16.
DTYPES = ("float64", "float32", "bfloat16")


class JaxCaseError(RuntimeError):
    """A case the JAX worker could not run; the message carries the worker's traceback."""


def why_unsupported(case: Case) -> str:
    """Why the JAX reference does not run `case`, or '' when it does. One sentence per reason,
    without the case's coordinates: the harness groups skips by it."""
    if case.dtype not in DTYPES:
        return f"the JAX reference runs {', '.join(DTYPES)}, not {case.dtype}"
    accidental = case.scheme in ("rank_mean", "microbatch_mean")
    if case.impl == "jax-multiprocess":
        if case.world_size not in MULTIPROCESS_SIZES:
            sizes = " and ".join(map(str, MULTIPROCESS_SIZES))
            return f"jax-multiprocess launches {sizes} processes, not {case.world_size}"
        if accidental:
            return "jax-multiprocess runs the intended schemes only"
        return ""
    if case.impl == "jax-jit" and accidental:
        return "jax-jit is a global view: there is no per-rank mean to take by accident"
    if case.world_size > 8:
        return f"the JAX worker has 8 devices, not {case.world_size}"
    return ""


def supports(case: Case) -> bool:
    """Whether the JAX reference runs `case` (`why_unsupported` says why not)."""
    return not why_unsupported(case)


#: What the zygote imports once for every worker it forks (see `jax_impl.harness.zygote`).
ZYGOTE_PRELOAD = (
    "jax",
    "jax.numpy",
    "optax",
    "jax_impl",
    "jax_impl.harness.multiprocess",
    "jax_impl.resume",
    "orbax.checkpoint",
    "crosscheck.run.jax_worker",
    "crosscheck.run.jax_resume",
)
#: How many zygotes one process may start: one, and a replacement when it was stopped (by
#: `jax_impl.harness.launch.terminate_all` after an interrupt, or a crash); not one per job.
MAX_ZYGOTE_STARTS = 5
_zygote_lock = threading.Lock()


class _ZygoteSlot:
    """This process's zygote (None before the first start or after a failed one), and how
    many were started."""

    zygote: Zygote | None = None
    starts: int = 0


_zygote_slot = _ZygoteSlot()


def worker_zygote() -> Zygote | None:
    """This process's JAX zygote, started on first use; None where none may run.

    Every JAX worker of a run is forked from it instead of importing JAX itself (about 1.3 s
    of CPU each). None, and workers start afresh as plain processes (slower, not different),
    when `jax_impl.harness.zygote.unavailable` says so (the platform lacks ``os.fork`` or
    ``os.waitid``, as macOS does, or the environment sets ``GRADWEIGHT_NO_FORK_SERVERS=1``;
    both are checked on every call), or when a zygote refuses to serve or fails to start. A
    zygote that has exited since (stopped on an interrupt) is replaced, up to
    `MAX_ZYGOTE_STARTS` starts per process.
    """
    from jax_impl.harness.zygote import Zygote, unavailable

    if unavailable():
        return None
    with _zygote_lock:
        slot = _zygote_slot
        if slot.zygote is not None and slot.zygote.alive:
            return slot.zygote
        if slot.starts >= MAX_ZYGOTE_STARTS:
            return None
        slot.starts += 1
        log = Path(tempfile.gettempdir()) / f"gradweight-zygote-{os.getpid()}.log"
        try:
            slot.zygote = Zygote(ZYGOTE_PRELOAD, _worker_env(), log)
        except Exception:  # any failure to start means: no zygote, plain processes
            slot.zygote = None
            slot.starts = MAX_ZYGOTE_STARTS  # one that failed to start would fail again
            return None
        atexit.register(slot.zygote.close)
        return slot.zygote


def _worker_env() -> dict[str, str]:
    from jax_impl.harness.launch import (
        SMALL_PROGRAM_XLA_FLAGS,  # here: importing jax_impl imports jax
    )

    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count=8 {SMALL_PROGRAM_XLA_FLAGS}"
    env["JAX_PLATFORMS"] = "cpu"
    env.setdefault("OMP_NUM_THREADS", "1")
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def _run_in_process(
    cases: list[Case], settings: TrainSettings, on_done: OnDone, dtype: str
) -> None:
    """One worker process with eight CPU devices runs `cases`, all of one dtype."""
    from jax_impl.harness.launch import run_workers

    with tempfile.TemporaryDirectory(prefix="gradweight-jax-") as tmp:
        work = Path(tmp)
        job, out = work / "job.pkl", work / "out.pkl"
        job.write_bytes(pickle.dumps({"cases": cases, "settings": settings, "dtype": dtype}))
        command = [sys.executable, "-m", "crosscheck.run.jax_worker", str(job), str(out)]
        try:
            run_workers(
                [command],
                timeout_s=WORKER_TIMEOUT_S,
                log_dir=work,
                env=_worker_env(),
                zygote=worker_zygote(),
            )
        except Exception as error:
            for case in cases:
                on_done(case, error)
            return
        results = pickle.loads(out.read_bytes())
    for case in cases:
        result = results.get(case, "the worker produced no result for this case")
        on_done(case, JaxCaseError(result) if isinstance(result, str) else result)


def _multiprocess_output(case: Case, per_process: list[dict], index: int, n: int) -> CaseOutput:
    variant = "precount-pmean" if case.strategy == "precount" else "postnorm-psum"
    key = f"{index}/{case.dtype}/{variant}/{case.scheme}"
    first = per_process[0]
    metrics = []
    for update in range(n):
        for process in per_process:
            prefix = f"{key}/{update}"
            rank = int(process["rank"])
            metrics.append(
                RankMetrics(
                    rank=rank,
                    update=update,
                    valid_tokens=int(np.ravel(process[f"{prefix}/rank_valid_tokens"])[0]),
                    loss_sum=float(np.ravel(process[f"{prefix}/rank_loss_sums"])[0]),
                    denominator=float(process[f"{prefix}/global_denominator"]),
                    objective=float(process[f"{prefix}/loss"]),
                    grad_norm=float(process[f"{prefix}/grad_norm"]),
                    clipped_grad_norm=float(process[f"{prefix}/clipped_grad_norm"]),
                )
            )

    def tree(update: int, kind: str) -> dict[str, np.ndarray]:
        return {leaf: first[f"{key}/{update}/{kind}.{leaf}"] for leaf in ("embed", "unembed")}

    return CaseOutput(
        grads=tree(0, "grads"), params=[tree(u, "params") for u in range(n)], metrics=metrics
    )


def _run_multiprocess(
    cases: list[Case], settings: TrainSettings, on_done: OnDone, world_size: int, dtype: str
) -> None:
    """One launch of `world_size` processes runs every multi-process case of that size."""
    from jax_impl.harness.launch import SMALL_PROGRAM_XLA_FLAGS
    from jax_impl.harness.multiprocess import launch_multiprocess

    batches = sorted({(case.fixture, case.accum_steps) for case in cases})
    with tempfile.TemporaryDirectory(prefix="gradweight-jax-mp-") as tmp:
        work = Path(tmp)
        spec_cases = []
        saved: dict[str, Path] = {}
        for fixture, M in batches:
            # By index, not by name: a fixture may be a user's file path, not a short name.
            if fixture not in saved:
                saved[fixture] = work / f"fixture-{len(saved)}.npz"
                builtin_fixture(fixture).save(saved[fixture])
            spec_cases.append({"fixture": str(saved[fixture]), "accum_steps": M})
        spec = {
            "cases": spec_cases,
            "dtypes": [dtype],
            "x64": dtype == "float64",
            "schemes": sorted({case.scheme for case in cases}),
            "variants": [["precount", "pmean"], ["postnorm", "psum"]],
            "optimizer": settings.optimizer_spec(),
            "num_updates": settings.num_updates,
            "max_grad_norm": settings.max_grad_norm,
        }
        try:
            per_process = launch_multiprocess(
                spec,
                world_size,
                work / "run",
                timeout_s=WORKER_TIMEOUT_S,
                extra_xla_flags=SMALL_PROGRAM_XLA_FLAGS,
                zygote=worker_zygote(),
            )
        except Exception as error:
            for case in cases:
                on_done(case, error)
            return
    for case in cases:
        index = batches.index((case.fixture, case.accum_steps))
        try:
            output = _multiprocess_output(case, per_process, index, settings.num_updates)
        except Exception as error:
            on_done(case, error)
        else:
            on_done(case, output)


def jobs(cases: list[Case], settings: TrainSettings, on_done: OnDone) -> list[Job]:
    """The work for `cases`: one worker process per in-process front-end, world size and
    dtype, one launch per world size and dtype for the multi-process front-end. Each reports
    its cases through `on_done`. Workers fork from the zygote, so a process of its own costs
    little, and small jobs let the scheduler keep both cores busy to the end: one worker for
    all three front-ends would be the run's longest job by far."""
    in_process: dict[tuple[str, int, str], list[Case]] = {}
    multiprocess: dict[tuple[int, str], list[Case]] = {}
    for case in cases:
        if case.impl in IN_PROCESS:
            in_process.setdefault((case.impl, case.world_size, case.dtype), []).append(case)
        elif case.impl == "jax-multiprocess":
            multiprocess.setdefault((case.world_size, case.dtype), []).append(case)
        else:
            raise ValueError(f"{case.describe()}: not a JAX implementation")
    # Costs (CPU seconds, measured on 2 cores): compiling and running one program per
    # front-end, layout and batch shape, paid by every process of a multi-process launch.
    work = [
        Job(
            name=f"{impl} R={world_size} {dtype}",
            processes=1,
            cost=0.5 + 0.8 * _programs(group),
            run=functools.partial(_run_in_process, group, settings, on_done, dtype),
        )
        for (impl, world_size, dtype), group in sorted(in_process.items())
    ]
    work += [
        Job(
            name=f"jax-multiprocess R={world_size} {dtype}",
            processes=world_size,
            cost=world_size * (1.0 + 0.5 * _programs(group)),
            run=functools.partial(_run_multiprocess, group, settings, on_done, world_size, dtype),
        )
        for (world_size, dtype), group in sorted(multiprocess.items())
    ]
    return work


def _programs(cases: list[Case]) -> int:
    """Distinct compiled sweeps among `cases`: one per front-end, layout and batch shape."""
    return len(
        {
            (c.impl, c.world_size, c.accum_steps, builtin_fixture(c.fixture).targets.shape)
            for c in cases
        }
    )
