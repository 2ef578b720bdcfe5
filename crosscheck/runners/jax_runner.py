"""Running harness cases on JAX: one worker process per dtype, one process set per world size.

The in-process front-ends (pmap, shard_map, global jit) run in `crosscheck.runners.jax_worker`
with eight fake CPU devices; the multi-process front-end runs `jax_impl.multiprocess` on R real
processes joined by jax.distributed over gloo, one launch per world size serving every case of
that size. Every wait is bounded by `jax_impl.launch.run_workers`.
"""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from crosscheck.cases import Case, CaseOutput, RankMetrics, TrainSettings
from crosscheck.catalogue import builtin_fixture

OnDone = Callable[[Case, CaseOutput | BaseException], None]

IN_PROCESS = ("jax-pmap", "jax-shard_map", "jax-jit")
WORKER_TIMEOUT_S = 300.0
# These programs are tiny: LLVM at -O0 compiles them much faster, and code generation at any
# level keeps IEEE semantics (XLA's own HLO passes are unchanged).
XLA_FLAGS = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
MULTIPROCESS_SIZES = (2, 4)


class JaxCaseError(RuntimeError):
    """A case the JAX worker could not run; the message carries the worker's traceback."""


def supports(case: Case) -> bool:
    if case.dtype not in ("float64", "float32"):
        return False
    accidental = case.scheme in ("rank_mean", "microbatch_mean")
    if case.impl == "jax-multiprocess":
        return case.world_size in MULTIPROCESS_SIZES and not accidental
    if case.impl == "jax-jit" and accidental:
        return False  # global view: no per-rank mean to take by accident
    return case.world_size <= 8


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = XLA_FLAGS
    env["JAX_PLATFORMS"] = "cpu"
    env.setdefault("OMP_NUM_THREADS", "1")
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def _run_in_process(cases: list[Case], settings: TrainSettings, on_done: OnDone, work: Path):
    from jax_impl.launch import run_workers

    by_dtype: dict[str, list[Case]] = {}
    for case in cases:
        by_dtype.setdefault(case.dtype, []).append(case)
    commands, outs = [], {}
    for dtype, group in sorted(by_dtype.items()):
        job = work / f"job-{dtype}.pkl"
        job.write_bytes(pickle.dumps({"cases": group, "settings": settings, "dtype": dtype}))
        outs[dtype] = work / f"out-{dtype}.pkl"
        commands.append(
            [sys.executable, "-m", "crosscheck.runners.jax_worker", str(job), str(outs[dtype])]
        )
    try:
        run_workers(commands, timeout_s=WORKER_TIMEOUT_S, log_dir=work, env=_worker_env())
    except Exception as error:
        for case in cases:
            on_done(case, error)
        return
    for dtype, group in by_dtype.items():
        results = pickle.loads(outs[dtype].read_bytes())
        for case in group:
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


def _run_multiprocess(cases: list[Case], settings: TrainSettings, on_done: OnDone, work: Path):
    from jax_impl.multiprocess import launch_multiprocess

    c = settings.optimizer
    by_size: dict[tuple[int, str], list[Case]] = {}
    for case in cases:
        by_size.setdefault((case.world_size, case.dtype), []).append(case)
    for (world_size, dtype), group in sorted(by_size.items()):
        batches = sorted({(case.fixture, case.accum_steps) for case in group})
        spec_cases = []
        for fixture, M in batches:
            path = work / f"{fixture}.npz"
            if not path.exists():
                builtin_fixture(fixture).save(path)
            spec_cases.append({"fixture": str(path), "accum_steps": M})
        spec = {
            "cases": spec_cases,
            "dtypes": [dtype],
            "x64": dtype == "float64",
            "schemes": sorted({case.scheme for case in group}),
            "variants": [["precount", "pmean"], ["postnorm", "psum"]],
            "optimizer": {
                "name": "adamw",
                "learning_rate": c.learning_rate,
                "b1": c.b1,
                "b2": c.b2,
                "eps": c.eps,
                "weight_decay": c.weight_decay,
            },
            "num_updates": settings.num_updates,
            "max_grad_norm": settings.max_grad_norm,
        }
        try:
            per_process = launch_multiprocess(
                spec, world_size, work / f"mp-{world_size}-{dtype}", timeout_s=WORKER_TIMEOUT_S
            )
        except Exception as error:
            for case in group:
                on_done(case, error)
            continue
        for case in group:
            index = batches.index((case.fixture, case.accum_steps))
            try:
                output = _multiprocess_output(case, per_process, index, settings.num_updates)
            except Exception as error:
                on_done(case, error)
            else:
                on_done(case, output)


def run(cases: list[Case], settings: TrainSettings, on_done: OnDone) -> None:
    """Run every case; report each through `on_done`."""
    with tempfile.TemporaryDirectory(prefix="gradweight-jax-") as tmp:
        work = Path(tmp)
        in_process = [case for case in cases if case.impl in IN_PROCESS]
        multiprocess = [case for case in cases if case.impl == "jax-multiprocess"]
        if in_process:
            _run_in_process(in_process, settings, on_done, work)
        if multiprocess:
            _run_multiprocess(multiprocess, settings, on_done, work)
