"""Running harness cases on JAX: a worker per front-end and world size, a launch per world size.

The in-process front-ends (pmap, shard_map, global jit) run in `crosscheck.run.jax_worker`
with eight fake CPU devices, one worker process per front-end, world size and dtype; the
multi-process front-end runs `jax_impl.harness.multiprocess` on real processes joined by
jax.distributed over gloo (R of one rank each, or R / 2 of two: `devices_per_process`), one
launch per world size serving every case of that size. Every
worker is forked from one zygote that imported JAX once (`crosscheck.launch.workers`) where the
platform allows it and ``GRADWEIGHT_NO_FORK_SERVERS`` is not set (else a plain process each), and
every wait is bounded by `crosscheck.launch.worker_processes.run_workers`, which also kills
each worker's process group when its launch ends.
"""

from __future__ import annotations

import functools
import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from crosscheck.contract.cases import Case, CaseOutput, RankMetrics, TrainSettings
from crosscheck.contract.schemes import SCHEMES as V1_SCHEMES
from crosscheck.contract.schemes import resolve_scheme
from crosscheck.fixtures.builtin import builtin_fixture
from crosscheck.launch.schedule import Job
from crosscheck.launch.workers import (
    SMALL_PROGRAM_JAX_CONFIG,
    SMALL_PROGRAM_XLA_FLAGS,
    report_jax_job,
    worker_zygote,
)
from crosscheck.run.jax_worker import id_space

OnDone = Callable[[Case, CaseOutput | BaseException], None]

IN_PROCESS = ("jax-pmap", "jax-shard_map", "jax-jit")
WORKER_TIMEOUT_S = 300.0
MULTIPROCESS_SIZES = (2, 4)


def devices_per_process(world_size: int) -> int:
    """How many CPU devices (ranks) each process of a multi-process launch holds: one at R = 2
    (two processes of one rank), two from R = 4 on (R / 2 processes of two ranks: a rank's
    collectives then cross a process boundary for some peers and not for others, as on hosts
    of several accelerators). On 2 cores four single-rank processes waited on each other at
    every collective and spent 13 of their 32 s of CPU in the kernel."""
    return 2 if world_size >= 4 and world_size % 2 == 0 else 1


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
    if case.scheme not in V1_SCHEMES and case.dtype != "float64":
        return "the matrix runs trainer modes (scheme specs) in float64"
    accidental = case.scheme in ("rank_mean", "microbatch_mean")
    if case.impl == "jax-multiprocess":
        if case.world_size not in MULTIPROCESS_SIZES:
            sizes = " and ".join(map(str, MULTIPROCESS_SIZES))
            return f"jax-multiprocess runs world sizes {sizes}, not {case.world_size}"
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


def _run_in_process(
    cases: list[Case], settings: TrainSettings, on_done: OnDone, dtype: str
) -> None:
    """One worker process with eight CPU devices runs `cases`, all of one dtype."""
    report_jax_job(
        "crosscheck.run.jax_worker",
        cases,
        on_done,
        timeout_s=WORKER_TIMEOUT_S,
        prefix="gradweight-jax-",
        dtype=dtype,
        extra={"settings": settings},
        item_error=JaxCaseError,
    )


def _multiprocess_output(
    case: Case, per_rank: list[dict], index: int, n: int, label: str
) -> CaseOutput:
    variant = "precount-pmean" if case.strategy == "precount" else "postnorm-psum"
    key = f"{index}/{case.dtype}/{variant}/{label}"
    first = per_rank[0]
    metrics = []
    for update in range(n):
        for record in per_rank:
            prefix = f"{key}/{update}"
            rank = int(record["rank"])
            metrics.append(
                RankMetrics(
                    rank=rank,
                    update=update,
                    valid_tokens=int(np.ravel(record[f"{prefix}/rank_valid_tokens"])[0]),
                    loss_sum=float(np.ravel(record[f"{prefix}/rank_loss_sums"])[0]),
                    denominator=float(record[f"{prefix}/global_denominator"]),
                    objective=float(record[f"{prefix}/loss"]),
                    grad_norm=float(record[f"{prefix}/grad_norm"]),
                    clipped_grad_norm=float(record[f"{prefix}/clipped_grad_norm"]),
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
    """One launch of `world_size` processes runs every multi-process case of that size; in a
    process of a multi-host job (``crosscheck run --coordinator ...``), the job's processes
    run them instead, each its own devices' ranks."""
    from jax_impl.harness.multiprocess import joined_job, launch_multiprocess

    batches = sorted({(case.fixture, case.accum_steps) for case in cases})
    spec_names = sorted({case.scheme for case in cases if case.scheme not in V1_SCHEMES})

    def label(scheme: str) -> str:
        """A scheme's key in the launch's records: v1's by name, a trainer mode's spec<k>."""
        return scheme if scheme in V1_SCHEMES else f"spec{spec_names.index(scheme)}"

    with tempfile.TemporaryDirectory(prefix="gradweight-jax-mp-") as tmp:
        work = Path(tmp)
        spec_cases = []
        saved: dict[str, Path] = {}
        for fixture, M in batches:
            # By index, not by name: a fixture may be a user's file path, not a short name.
            if fixture not in saved:
                saved[fixture] = work / f"fixture-{len(saved)}.npz"
                builtin_fixture(fixture).save(saved[fixture])
            labels = sorted(
                {label(c.scheme) for c in cases if (c.fixture, c.accum_steps) == (fixture, M)}
            )
            spec_cases.append({"fixture": str(saved[fixture]), "accum_steps": M, "schemes": labels})
        spec = {
            "cases": spec_cases,
            "dtypes": [dtype],
            "x64": dtype == "float64",
            "schemes": sorted({case.scheme for case in cases if case.scheme in V1_SCHEMES}),
            # Trainer modes: one sweep of their specs, keyed spec<k> (float64 cases only).
            "scheme_specs": [resolve_scheme(name).to_dict() for name in spec_names],
            "spec_id_space": id_space([case.fixture for case in cases]),
            "variants": [["precount", "pmean"], ["postnorm", "psum"]],
            "optimizer": settings.optimizer_spec(),
            "num_updates": settings.num_updates,
            "max_grad_norm": settings.max_grad_norm,
            "jax_config": [list(setting) for setting in SMALL_PROGRAM_JAX_CONFIG],
        }
        try:
            if joined_job():
                from jax_impl.harness.in_place import run_spec_in_place

                # Through JSON as a started worker reads it: the same lists, numbers, keys.
                per_rank = run_spec_in_place(json.loads(json.dumps(spec)), world_size)
            else:
                per_process = devices_per_process(world_size)
                per_rank = launch_multiprocess(
                    spec,
                    world_size // per_process,
                    work / "run",
                    timeout_s=WORKER_TIMEOUT_S,
                    extra_xla_flags=SMALL_PROGRAM_XLA_FLAGS,
                    zygote=worker_zygote(),
                    devices_per_process=per_process,
                )
        except Exception as error:
            for case in cases:
                on_done(case, error)
            return
    for case in cases:
        index = batches.index((case.fixture, case.accum_steps))
        try:
            output = _multiprocess_output(
                case, per_rank, index, settings.num_updates, label(case.scheme)
            )
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
    for (world_size, dtype), group in sorted(multiprocess.items()):
        processes = world_size // devices_per_process(world_size)
        work.append(
            Job(
                name=f"jax-multiprocess R={world_size} {dtype}",
                processes=processes,
                cost=processes * (1.0 + 0.5 * _programs(group)),
                run=functools.partial(
                    _run_multiprocess, group, settings, on_done, world_size, dtype
                ),
            )
        )
    return work


def _programs(cases: list[Case]) -> float:
    """Compiled sweeps among `cases`, in units of a v1 sweep: one per front-end, layout and
    batch shape, and one spec sweep beside it where trainer modes run, which holds every spec
    in both strategies and costs about four v1 sweeps to compile (measured: 36 variants)."""
    v1 = {
        (c.impl, c.world_size, c.accum_steps, builtin_fixture(c.fixture).targets.shape)
        for c in cases
        if c.scheme in V1_SCHEMES
    }
    specs = {
        (c.impl, c.world_size, c.accum_steps, builtin_fixture(c.fixture).targets.shape)
        for c in cases
        if c.scheme not in V1_SCHEMES
    }
    return len(v1) + 4.0 * len(specs)
