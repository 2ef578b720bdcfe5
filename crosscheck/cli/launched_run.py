"""`crosscheck run` under torchrun: the torch rows at the launcher's world size, in its ranks.

``torchrun --nproc-per-node N -m crosscheck run --impls oracle,torch-ddp`` starts N copies of
the command. Each joins the launcher's process group (`torch_impl.harness.in_place`) and runs
the matrix of the oracle and the torch implementations at R = N only: the torch launch of
that world size then runs in the ranks themselves instead of starting processes. The
world-size-change, resume, objective and trainer-mode rows are off (they launch other world
sizes, or a process group of their own). Rank 0 prints the report and writes ``--json``,
``--log`` and ``--plot``; every rank exits with rank 0's status. JAX implementations are
refused here: a JAX run under torchrun would start its own workers on every rank.

`launched_run` returns None when no torch launcher started this process, or when it already
joined (the matrix itself then runs).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

from rich.console import Console

from crosscheck.cli.outputs import refuse
from crosscheck.launch.devices import resolve_torch_device
from crosscheck.launch.external import LauncherError, torch_launch
from crosscheck.run.implementations import IMPLEMENTATIONS

#: The collective timeout of the launcher's process group: a rank whose peer raised waits at
#: most this long (the harness's own torch launches of `crosscheck run` use 60 s).
COLLECTIVE_TIMEOUT_S = 60.0


def launched_run(
    args: argparse.Namespace, console: Console, run: Callable[[argparse.Namespace, Console], int]
) -> int | None:
    """Run `run` as one rank of a torch launcher's job; None when there is none to join."""
    try:
        place = torch_launch()
    except LauncherError as error:
        return refuse(console, f"crosscheck run: {error}")
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
    if args.world_sizes is not None and set(args.world_sizes) != {place.world_size}:
        return refuse(
            say,
            f"crosscheck run: --world-sizes {','.join(map(str, args.world_sizes))}: the "
            f"launcher runs {place.world_size} ranks, the only world size here",
        )
    try:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or place.world_size)
        device = resolve_torch_device(args.device, local_ranks)
    except ValueError as error:
        return refuse(say, f"crosscheck run: {error}")
    mine = argparse.Namespace(**vars(args))
    mine.impls, mine.world_sizes = impls, [place.world_size]
    mine.no_world_size_change = mine.no_resume = True
    mine.no_objectives = mine.no_spec_modes = True
    # The device is the joined group's; the run's own placement must not look for GPUs for
    # launches it will not start.
    mine.device = "cpu"
    if place.rank != 0:
        mine.json = mine.log = mine.plot = None
    in_place.join(device, place.local_rank, COLLECTIVE_TIMEOUT_S)
    try:
        return int(in_place.agree(run(mine, say)))
    finally:
        in_place.leave()
