"""Whether this process was started by an existing launcher, and where it stands in the job.

``crosscheck verify`` (and ``crosscheck run``'s torch rows) normally start their own processes.
Under a launcher that already started one process per rank, they join that job instead:

* **torch** (`torch_launch`): ``torchrun`` (``python -m torch.distributed.run``), or any launcher
  that sets the same variables: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
  ``MASTER_PORT``. The process group is joined with ``init_method="env://"``, which reads them.
  Detected when ``RANK`` or ``WORLD_SIZE`` is set; then all five must be, or the start is
  refused naming the missing ones (a half-set environment is a launcher problem, and guessing
  would hang every rank in the rendezvous).
* **JAX** (`jax_multihost`): a multi-host start, ``jax.distributed.initialize(coordinator,
  num_processes, process_id)``, from ``--coordinator/--num-processes/--process-id`` or, for
  those not given, ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``
  (the names JAX's own ``initialize()`` reads). All three or none: a partial set is refused.

Nothing here imports torch or JAX; the values are read and checked, nothing is joined.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

TORCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
JAX_VARIABLES = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


class LauncherError(ValueError):
    """The launcher's environment is incomplete or malformed (a set-up error: exit 2)."""


@dataclass(frozen=True, slots=True)
class TorchLaunch:
    """This process's place in a job a torch launcher started (one process per rank)."""

    rank: int
    world_size: int
    #: The rank's index on its machine: the GPU it uses under ``--device cuda``.
    local_rank: int
    master_addr: str
    master_port: int


@dataclass(frozen=True, slots=True)
class JaxMultiHost:
    """This process's place in a multi-host JAX job: ``jax.distributed.initialize``'s three
    arguments."""

    coordinator: str
    num_processes: int
    process_id: int


def _integer(name: str, text: str, low: int, high: int | None = None) -> int:
    """`text` read as an integer in [low, high), or LauncherError naming `name` and why."""
    try:
        value = int(text)
    except ValueError:
        raise LauncherError(f"{name}={text!r} is not an integer") from None
    if value < low or (high is not None and value >= high):
        bound = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise LauncherError(f"{name}={value} must be {bound}")
    return value


def torch_launch(environ: Mapping[str, str] | None = None) -> TorchLaunch | None:
    """Where this process stands in a torch launcher's job, or None when none started it.

    Raises LauncherError when ``RANK`` or ``WORLD_SIZE`` is set but the five variables are not
    all there and well formed (see the module docstring).
    """
    env = os.environ if environ is None else environ
    if "RANK" not in env and "WORLD_SIZE" not in env:
        return None
    missing = [name for name in TORCH_VARIABLES if not env.get(name)]
    if missing:
        raise LauncherError(
            f"a torch launcher's environment needs {', '.join(TORCH_VARIABLES)}; "
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set "
            "(start it with torchrun, or unset RANK and WORLD_SIZE to let crosscheck start "
            "its own processes)"
        )
    world_size = _integer("WORLD_SIZE", env["WORLD_SIZE"], 1)
    return TorchLaunch(
        rank=_integer("RANK", env["RANK"], 0, world_size),
        world_size=world_size,
        local_rank=_integer("LOCAL_RANK", env["LOCAL_RANK"], 0, world_size),
        master_addr=env["MASTER_ADDR"],
        master_port=_integer("MASTER_PORT", env["MASTER_PORT"], 1, 65536),
    )


def jax_multihost(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> JaxMultiHost | None:
    """A multi-host JAX start from the options given, the environment for the others; None
    when neither names any of the three. LauncherError for a partial or malformed set."""
    env = os.environ if environ is None else environ
    given = {
        "JAX_COORDINATOR_ADDRESS": coordinator,
        "JAX_NUM_PROCESSES": None if num_processes is None else str(num_processes),
        "JAX_PROCESS_ID": None if process_id is None else str(process_id),
    }
    values = {name: value if value is not None else env.get(name) for name, value in given.items()}
    if not any(values.values()):
        return None
    missing = [name for name, value in values.items() if not value]
    if missing:
        raise LauncherError(
            "a multi-host JAX start needs the coordinator's HOST:PORT, the number of processes "
            "and this process's id (--coordinator, --num-processes, --process-id, or "
            f"{', '.join(JAX_VARIABLES)}); missing: {', '.join(missing)}"
        )
    address = str(values["JAX_COORDINATOR_ADDRESS"])
    host, colon, port = address.rpartition(":")
    if not colon or not host:
        raise LauncherError(f"the JAX coordinator must be HOST:PORT, got {address!r}")
    _integer("the coordinator's port", port, 1, 65536)
    count = _integer("JAX_NUM_PROCESSES", str(values["JAX_NUM_PROCESSES"]), 1)
    return JaxMultiHost(
        address, count, _integer("JAX_PROCESS_ID", str(values["JAX_PROCESS_ID"]), 0, count)
    )
