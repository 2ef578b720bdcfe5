"""`crosscheck run` under an existing launcher: torchrun, or a multi-host JAX start.

``torchrun --nproc-per-node N -m crosscheck run --impls oracle,torch-ddp`` starts N copies of
the command. Each joins the launcher's process group (`torch_impl.harness.in_place`) and runs
the matrix of the oracle and the torch implementations at R = N only: the torch launch of
that world size then runs in the ranks themselves instead of starting processes. JAX
implementations are refused there: a JAX run under torchrun would start its own workers on
every rank.

``crosscheck run --coordinator HOST:PORT --num-processes P --process-id I`` (or
``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``), once per host, joins
that ``jax.distributed`` job (`crosscheck.verification.jax_launched.LaunchedJaxJob`: x64,
the platform JAX finds or ``--platform``) and runs the oracle and ``jax-multiprocess`` rows
at R = the job's device count, every process holding its own devices' ranks: the
multi-process launch then runs in the job's processes (`jax_impl.harness.in_place`). float64
only (x64 is set once, for the whole job); the in-process front-ends and torch are refused
(they would start workers of their own on every host). The trainer modes run there (the
multi-process spec sweep holds them), not under torchrun.

In both, the world-size-change, resume and objective rows are off (they launch other world
sizes, or processes of their own), rank (process) 0 prints the report and writes ``--json``,
``--log`` and ``--plot``, and every process exits with rank 0's status. `launched_run`
returns None when no launcher started this process, or when it already joined (the matrix
itself then runs).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

from rich.console import Console

from crosscheck.cli.outputs import refuse
from crosscheck.launch.devices import resolve_torch_device
from crosscheck.launch.external import JaxMultiHost, LauncherError, jax_multihost, torch_launch
from crosscheck.run.implementations import IMPLEMENTATIONS

#: The collective timeout of the launcher's process group: a rank whose peer raised waits at
#: most this long (the harness's own torch launches of `crosscheck run` use 60 s).
COLLECTIVE_TIMEOUT_S = 60.0


def launched_run(
    args: argparse.Namespace, console: Console, run: Callable[[argparse.Namespace, Console], int]
) -> int | None:
    """Run `run` as one rank of a launcher's job; None when there is none to join."""
    try:
        place = torch_launch()
        multihost = jax_multihost(args.coordinator, args.num_processes, args.process_id)
    except LauncherError as error:
        return refuse(console, f"crosscheck run: {error}")
    if place is not None and multihost is not None:
        return refuse(
            console,
            "crosscheck run: started by torchrun and given a multi-host JAX job at once; "
            "run the torch rows under torchrun and the JAX rows in the JAX job, separately",
        )
    if multihost is not None:
        return _launched_jax_run(args, console, run, multihost)
    if place is None:
        return None
    # Only now: a run that no launcher started never imports torch here.
    from torch_impl.harness import in_place

    if in_place.active():
        return None
    say = console if place.rank == 0 else Console(quiet=True)  # one copy of every line
    impls = args.impls or ["oracle", "torch-ddp", "torch-fsdp2"]
    jax = [impl for impl in impls if IMPLEMENTATIONS.get(impl) == "jax"]
    if jax:
        return refuse(
            say,
            f"crosscheck run: under torchrun only the oracle and the torch implementations run "
            f"(not {', '.join(jax)}); pass --impls oracle,torch-ddp,torch-fsdp2",
        )
    ranks = f"the launcher runs {place.world_size} ranks"
    if problem := _world_size_problem(args, place.world_size, ranks):
        return refuse(say, problem)
    try:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or place.world_size)
        device = resolve_torch_device(args.device, local_ranks)
    except ValueError as error:
        return refuse(say, f"crosscheck run: {error}")
    mine = _joined_args(args, impls, place.world_size, place.rank)
    mine.no_spec_modes = True
    # The device is the joined group's; the run's own placement must not look for GPUs for
    # launches it will not start.
    mine.device = "cpu"
    in_place.join(device, place.local_rank, COLLECTIVE_TIMEOUT_S)
    try:
        return int(in_place.agree(run(mine, say)))
    finally:
        in_place.leave()


def _launched_jax_run(
    args: argparse.Namespace,
    console: Console,
    run: Callable[[argparse.Namespace, Console], int],
    multihost: JaxMultiHost,
) -> int | None:
    """`run` as one process of a multi-host JAX job; None when this process already joined."""
    from jax_impl.harness.multiprocess import joined_job

    if joined_job():
        return None
    say = console if multihost.process_id == 0 else Console(quiet=True)
    impls = args.impls or ["oracle", "jax-multiprocess"]
    others = [impl for impl in impls if impl not in ("oracle", "jax-multiprocess")]
    if others:
        return refuse(
            say,
            f"crosscheck run: in a multi-host JAX job only the oracle and jax-multiprocess run "
            f"(not {', '.join(others)}); pass --impls oracle,jax-multiprocess",
        )
    if args.dtypes not in (None, ["float64"]):
        return refuse(
            say,
            f"crosscheck run: --dtypes {','.join(args.dtypes)}: a multi-host JAX job runs "
            "float64 only (x64 is set once, for the whole job)",
        )
    from crosscheck.run.jax_runner import WORKER_TIMEOUT_S
    from crosscheck.verification.jax_launched import LaunchedJaxJob

    job = LaunchedJaxJob(multihost, args.platform, WORKER_TIMEOUT_S, command="crosscheck run")
    try:
        world_size = job.join()
        devices = f"the JAX job has {world_size} devices"
        if problem := _world_size_problem(args, world_size, devices):
            return job.agree(refuse(say, problem))
        mine = _joined_args(args, impls, world_size, multihost.process_id)
        # The job's backend is already up (`job.join`); the run starts no JAX worker whose
        # platform it would probe or set.
        mine.platform = None
        return job.agree(run(mine, say))
    finally:
        job.close()


def _world_size_problem(args: argparse.Namespace, world_size: int, job: str) -> str:
    """Why ``--world-sizes`` names another R than the joined job's `world_size` (`job` says
    whose), or ''."""
    if args.world_sizes is None or set(args.world_sizes) == {world_size}:
        return ""
    return (
        f"crosscheck run: --world-sizes {','.join(map(str, args.world_sizes))}: {job}, the "
        "only world size here"
    )


def _joined_args(
    args: argparse.Namespace, impls: list[str], world_size: int, rank: int
) -> argparse.Namespace:
    """The run's options inside a joined job: `impls` at its world size only, without the
    rows that launch other world sizes or processes of their own; outputs from rank 0 alone."""
    mine = argparse.Namespace(**vars(args))
    mine.impls, mine.world_sizes = impls, [world_size]
    mine.no_world_size_change = mine.no_resume = mine.no_objectives = True
    mine.no_context_parallel = True
    if rank != 0:
        mine.json = mine.log = mine.plot = None
    return mine
