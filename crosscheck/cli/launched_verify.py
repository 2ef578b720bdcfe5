"""`crosscheck verify` inside a job an existing launcher started: torchrun, or multi-host JAX.

`launched_verify` returns None when no launcher started this process (the usual `verify`
then starts its own processes). Otherwise this process is one rank (torch) or one process
(JAX) of the launcher's job (`crosscheck.launch.external`): the layouts are those of the
launcher's world size R only (``--world-sizes`` may only repeat it), with the accumulation
steps of ``--accum-steps`` or, by default, each M the default layouts pair with that R (each M of
the default layouts when none has that R); every rank runs the step, rank 0 prints the report
and writes ``--json``, and every rank exits with rank 0's status. A set-up error (exit 2) is
found alike by every rank before any collective, and only rank 0 prints it.
"""

from __future__ import annotations

import argparse
import os
import time

from rich.console import Console

from crosscheck import exit_codes
from crosscheck.cli.outputs import refuse
from crosscheck.cli.verify_report import verify_exit_code, write_verify_report
from crosscheck.launch.devices import resolve_torch_device
from crosscheck.launch.external import LauncherError, jax_multihost, torch_launch
from crosscheck.verification.verifier import DEFAULT_LAYOUTS, verify


def default_accum(world_size: int) -> list[int]:
    """The M of every default layout at R = `world_size`; every default M when none has R."""
    paired = sorted({M for R, M in DEFAULT_LAYOUTS if world_size == R})
    return paired or sorted({M for _, M in DEFAULT_LAYOUTS})


def _refuse(console: Console, rank: int, message: str) -> int:
    if rank != 0:  # every rank found the same: one copy of the line, on stderr
        return exit_codes.SETUP_ERROR
    return refuse(console, f"crosscheck verify: {message}")


def launched_verify(args: argparse.Namespace, console: Console) -> int | None:
    """Run `verify` as one rank of a launcher's job; None when no launcher started us."""
    started = time.perf_counter()
    try:
        if args.framework == "torch":
            if args.coordinator or args.num_processes is not None or args.process_id is not None:
                raise LauncherError(
                    "--coordinator, --num-processes and --process-id start a multi-host JAX "
                    "job; a torch step runs under torchrun instead"
                )
            torch_place = torch_launch()
            if torch_place is None:
                return None
            rank, world_size = torch_place.rank, torch_place.world_size
        else:
            multihost = jax_multihost(args.coordinator, args.num_processes, args.process_id)
            if multihost is None:
                return None
            rank = multihost.process_id
    except LauncherError as error:
        return _refuse(console, 0, str(error))
    if args.framework == "torch":
        from crosscheck.verification.torch_launched import LaunchedTorchJob

        try:
            # One GPU per rank of this machine; torchrun's LOCAL_WORLD_SIZE says how many.
            local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or world_size)
            device = resolve_torch_device(args.device, local_ranks)
        except ValueError as error:
            return _refuse(console, rank, str(error))
        job = LaunchedTorchJob(torch_place, device, args.timeout)
    else:
        from crosscheck.verification.jax_launched import LaunchedJaxJob

        job = LaunchedJaxJob(multihost, args.platform, args.timeout)
        world_size = job.join()
    try:
        if args.world_sizes is not None and set(args.world_sizes) != {world_size}:
            return job.agree(
                _refuse(
                    console,
                    rank,
                    f"--world-sizes {','.join(map(str, args.world_sizes))}: the launcher runs "
                    f"{world_size} ranks, the only world size here",
                )
            )
        try:
            report = verify(
                args.step,
                framework=args.framework,
                scheme=args.scheme,
                objective=args.objective,
                fixtures=args.fixtures,
                world_sizes=[world_size],
                accum_steps=args.accum_steps or default_accum(world_size),
                timeout_s=args.timeout,
                precision="float64" if args.strict else args.precision,
                dtype=args.dtype,
                run_jobs=job.run,
                # Refused under a launcher (verify's _context_problem), never dropped.
                context_sizes=args.context_sizes,
                context_orders=args.context_orders,
            )
        except ValueError as error:  # alike on every rank, before the step ran
            return job.agree(_refuse(console, rank, str(error)))
        if rank == 0:  # before the agreement: a launcher may stop the ranks once one exits
            wall = time.perf_counter() - started
            figures = f"{world_size} launched ranks   wall {wall:.1f} s"
            extra = {"wall_time_s": wall, "launched_world_size": world_size}
            write_verify_report(console, report, args, figures, extra)
        return job.agree(verify_exit_code(report))
    finally:
        job.close()
