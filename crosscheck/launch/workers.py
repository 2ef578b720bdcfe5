"""Starting the harness's worker processes: one module every runner launches through.

JAX (`crosscheck.run.jax_runner`, `crosscheck.run.jax_resume`, `crosscheck.bugs.jax_bugs`,
`crosscheck.verification.jax_verify`) runs in worker processes with eight fake CPU devices,
started and waited for by `crosscheck.launch.worker_processes.run_workers`:

- `jax_worker_env`: a worker's environment (the device count, the compile flags
  `SMALL_PROGRAM_XLA_FLAGS`, this repository importable);
- `worker_zygote`: this process's JAX zygote, which forks the workers instead of starting each
  afresh (`crosscheck.launch.zygote`);
- `serve_job`: the worker's side, its ``main``: read the pickled job, turn x64 on for float64,
  write the pickled result atomically (`write_atomically`) for the launcher to read.

torch (`crosscheck.run.torch_runner`, `crosscheck.bugs.torch_bugs`,
`crosscheck.verification.torch_verify`) launches one process group per world size through
`torch_impl.harness.launcher.launch`: `launch_each` runs a list of items (cases, bug steps) in
one launch and judges each from every rank's output; `launch_arrays` is what a launch sends of
a built-in fixture, and `layout_problem` says why one cannot be laid out.

`launchable` sets aside what cannot run (it fails at once, by name, without a launch). torch and
JAX are imported only when something is launched, never at import.
"""

from __future__ import annotations

import pickle
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from crosscheck.contract.fixture import PARAM_KEYS
from crosscheck.contract.layout import Layout
from crosscheck.fixtures.builtin import builtin_fixture
from crosscheck.launch.devices import chosen_platform, jax_platform_env
from crosscheck.launch.worker_processes import process_env, run_workers, write_atomically
from crosscheck.launch.zygote import Zygote, shared_zygote

Item = TypeVar("Item")
Judged = TypeVar("Judged")


# ---- every framework ---------------------------------------------------------------------------


def launchable(
    items: Iterable[Item],
    problem: Callable[[Item], str],
    on_done: Callable[[Item, BaseException], None],
) -> list[Item]:
    """The items `problem` finds nothing wrong with, in order. Every other item is reported to
    `on_done` at once, with ``ValueError(problem(item))``, and never launched."""
    runnable = []
    for item in items:
        why_not = problem(item)
        if why_not:
            on_done(item, ValueError(why_not))
        else:
            runnable.append(item)
    return runnable


# ---- JAX: the environment, the zygote ---------------------------------------------------------

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
#: jax.config settings for the in-process workers (eight fake devices in one process), set
#: by each before it traces anything (`crosscheck.launch.workers.serve_job`), and for the
#: processes of the multi-process launches (their spec's ``jax_config``): the GSPMD
#: partitioner instead of Shardy. Their programs are shard_map, pmap (a shard_map in this jax)
#: and global jit over a 1-D data mesh; Shardy's propagation passes were a fifth of XLA's
#: compile time there (shard_map at R = 2: 6.8 s -> 5.5 s of compile per worker), the results
#: are bit-identical (every case of every in-process front-end at R = 1, 2, 4, compared bit for
#: bit), and under GSPMD a sweep is traced once for every batch shape
#: (`jax_impl.harness.traced_once`; jaxlib 0.10.2 crashes doing that under Shardy). An earlier
#: measurement had the multi-process programs run slower under GSPMD (58 s instead of 40 s of
#: wall); with their sweeps traced once the family now takes less wall and CPU than under
#: Shardy, every row the same (docs/performance.md). Not for a user's own step (`crosscheck
#: verify`): that runs as its author configured it.
SMALL_PROGRAM_JAX_CONFIG: tuple[tuple[str, bool], ...] = (("jax_use_shardy_partitioner", False),)


def jax_worker_env(platform: str | None = None) -> dict[str, str]:
    """The environment of a JAX worker: eight fake CPU devices, the small-program compile
    flags (`SMALL_PROGRAM_XLA_FLAGS`), one OpenMP thread unless set, and this repository
    first on ``PYTHONPATH``. Imports no JAX. On another `platform` than
    the CPU (None: `crosscheck.launch.devices.chosen_platform`, which ``crosscheck run
    --platform`` sets), that platform's devices instead of the fake CPU ones."""
    env = process_env()
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count=8 {SMALL_PROGRAM_XLA_FLAGS}"
    env["JAX_PLATFORMS"] = "cpu"
    return jax_platform_env(platform or chosen_platform(), env)


#: What the zygote imports once for every worker it forks (see `crosscheck.launch.zygote`): JAX
#: and the modules the workers of `crosscheck.run` run, named here, not imported.
ZYGOTE_PRELOAD = (
    "jax",
    "jax.numpy",
    "optax",
    "jax_impl",
    "jax_impl.harness.multiprocess_worker",
    "jax_impl.resume",
    "orbax.checkpoint",
    "crosscheck.run.jax_worker",
    "crosscheck.run.jax_resume",
)


def worker_zygote() -> Zygote | None:
    """This process's JAX zygote, started on first use; None where none may run.

    Every JAX worker of a run is forked from it instead of importing JAX itself (about 1.3 s
    of CPU each). None, and workers start afresh as plain processes (slower, not different),
    when `crosscheck.launch.zygote.unavailable` says so (the platform lacks ``os.fork`` or
    ``os.waitid``, as macOS does, or the environment sets ``GRADWEIGHT_NO_FORK_SERVERS=1``;
    both are checked on every call), or when a zygote refuses to serve or fails to start. A
    zygote that has exited since (stopped on an interrupt) is replaced, up to
    `crosscheck.launch.zygote.MAX_ZYGOTE_STARTS` starts per process (`shared_zygote`).
    """
    return shared_zygote(ZYGOTE_PRELOAD, jax_worker_env())


# ---- JAX: the worker's side --------------------------------------------------------------------


def run_jax_job(
    module: str, job: dict, work: Path, *, timeout_s: float, use_zygote: bool = True
) -> Any:
    """Run ``python -m MODULE JOB OUT`` as one JAX worker and return what it pickled to OUT.

    The job is pickled into `work` (which also takes the worker's log); the worker runs with
    `jax_worker_env` (eight CPU devices), forked from the zygote where `use_zygote` and the
    platform allow, bounded by `timeout_s` and killed with its process group when the launch
    ends (`crosscheck.launch.worker_processes.run_workers`, whose error this raises).
    MODULE's ``main`` is `serve_job`."""
    work.mkdir(parents=True, exist_ok=True)
    job_path, out = work / "job.pkl", work / "out.pkl"
    job_path.write_bytes(pickle.dumps(job))
    run_workers(
        [[sys.executable, "-m", module, str(job_path), str(out)]],
        timeout_s=timeout_s,
        log_dir=work,
        env=jax_worker_env(),
        zygote=worker_zygote() if use_zygote else None,
    )
    return pickle.loads(out.read_bytes())


def report_jax_job(
    module: str,
    items: Sequence[Item],
    on_done: Callable[[Item, Any], None],
    *,
    timeout_s: float,
    prefix: str,
    dtype: str = "float64",
    extra: Mapping[str, Any] | None = None,
    item_error: Callable[[str], Exception] = RuntimeError,
) -> None:
    """Run every item in one JAX worker (`run_jax_job` with ``{"cases": items, "dtype":
    dtype, **extra}``) and report each through ``on_done(item, output_or_error)``, exactly
    once: a worker that fails fails every item with its error, an item the worker failed (a
    traceback string) or left out gets ``item_error(text)`` saying so."""
    job = {"cases": list(items), "dtype": dtype, **(extra or {})}
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        try:
            results = run_jax_job(module, job, Path(tmp), timeout_s=timeout_s)
        except Exception as error:
            for item in items:
                on_done(item, error)
            return
    for item in items:
        result = results.get(item, "the worker produced no result for this case")
        on_done(item, item_error(result) if isinstance(result, str) else result)


def report_launch_each(
    target: Callable[..., Any],
    world_size: int,
    items: Sequence[Item],
    payload: Callable[[Item], Any],
    judge: Callable[[Item, list[Any]], Judged],
    on_done: Callable[[Item, Judged | Exception], None],
    *,
    timeout_s: float,
    collective_timeout_s: float,
) -> None:
    """`launch_each`, each item's judged output (or error) reported through `on_done`."""
    results = launch_each(
        target,
        world_size,
        items,
        payload,
        judge,
        timeout_s=timeout_s,
        collective_timeout_s=collective_timeout_s,
    )
    for item, result in zip(items, results, strict=True):
        on_done(item, result)


def serve_job(argv: Sequence[str], work: Callable[[dict], object]) -> int:
    """A JAX worker's ``main(JOB OUT)``: `work` the pickled job, pickle its result to OUT.

    x64 is process-global in JAX and must be set before any array exists: it is on exactly
    when the job's ``"dtype"`` is float64. The harness's compile settings
    (`SMALL_PROGRAM_JAX_CONFIG`) are set too: these workers run the
    project's own programs only. OUT is written atomically: the launcher reads it only after
    the worker exited 0, and a worker that dies leaves none.
    """
    job_path, out_path = Path(argv[0]), Path(argv[1])
    job = pickle.loads(job_path.read_bytes())
    import jax

    jax.config.update("jax_enable_x64", job["dtype"] == "float64")
    for name, value in SMALL_PROGRAM_JAX_CONFIG:
        jax.config.update(name, value)
    write_atomically(out_path, pickle.dumps(work(job)))
    return 0


# ---- torch: one launch per world size ----------------------------------------------------------


def layout_problem(
    fixture_name: str, world_size: int, accum_steps: int, layout: Layout | None = None
) -> str:
    """Why a built-in fixture cannot be laid out over `world_size` x `accum_steps` (and the
    context split of `layout`, when given), or ''."""
    try:
        fixture = builtin_fixture(fixture_name)
    except ValueError as error:  # an unknown fixture: the message lists the known ones
        return str(error)
    if not fixture.fits(world_size, accum_steps):
        return (
            f"the {fixture.num_rows} rows of fixture {fixture_name!r} cannot be laid out over "
            f"world_size={world_size} x accum_steps={accum_steps}"
        )
    if layout is not None and not layout.splits(fixture.seq_len):
        return (
            f"the rows of {fixture.seq_len} positions of fixture {fixture_name!r} cannot be "
            f"split over context_size={layout.context_size} ({layout.context_order}): "
            f"{fixture.seq_len} is not divisible by {layout.chunks}"
        )
    return ""


def launch_arrays(fixture_name: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(batch, params) of a built-in fixture as a launch sends them: the fixture's own
    read-only arrays, not copies, so that pickle sends an array shared by several items of one
    launch once."""
    fixture = builtin_fixture(fixture_name)
    # The batch, and contract v2's fields where the fixture gives them (group_ids, ...).
    arrays = fixture.npz_arrays()
    batch = {key: np.asarray(value) for key, value in arrays.items() if key not in PARAM_KEYS}
    params = {"embed": np.asarray(fixture.embed), "unembed": np.asarray(fixture.unembed)}
    return batch, params


def first_disagreeing_rank(per_rank: Sequence[Any]) -> int | None:
    """The first rank whose ``grads`` differ from rank 0's (other keys, or other bytes), or
    None: after the gradient all-reduce every rank must hold the same gradient, bit for bit."""
    first = per_rank[0].grads
    for rank, other in enumerate(per_rank[1:], start=1):
        grads = other.grads
        if grads.keys() != first.keys() or not all(
            np.array_equal(grads[key], first[key]) for key in first
        ):
            return rank
    return None


def launch_each(
    target: Callable[..., Any],
    world_size: int,
    items: Sequence[Item],
    payload: Callable[[Item], Any],
    judge: Callable[[Item, list[Any]], Judged],
    *,
    timeout_s: float,
    collective_timeout_s: float,
) -> list[Judged | Exception]:
    """One torch launch of `world_size` ranks for all of `items`; per item, in order, what
    `judge` makes of its output on every rank, or the exception that stopped it.

    Every rank runs ``target([payload(item) for item in items])`` (a `torch_impl.harness`
    target returns one output per payload) in a process group of its own, bounded by
    `timeout_s`. A launch that fails (a rank died, the time ran out, a payload could not be
    built) fails every item it carried, with its error; ``judge(item, per_rank)`` gets the
    item's output of each rank, in rank order, and an exception it raises fails that item
    alone.
    """
    from torch_impl.harness.launcher import launch

    try:
        per_rank = launch(
            target,
            world_size,
            ([payload(item) for item in items],),
            timeout_s=timeout_s,
            collective_timeout_s=collective_timeout_s,
        )
    except Exception as error:  # a failed launch fails every item it carried
        return [error] * len(items)
    judged: list[Judged | Exception] = []
    for index, item in enumerate(items):
        try:
            judged.append(judge(item, [outputs[index] for outputs in per_rank]))
        except Exception as error:
            judged.append(error)
    return judged
