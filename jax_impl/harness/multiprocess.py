"""Multi-process data parallelism with ``jax.distributed`` on CPU (gloo collectives).

Each process owns one CPU device and one rank (or `devices_per_process` of them, consecutive
ranks); the "data" mesh spans all processes and the
shard_map step runs unchanged (`jax_impl.shard_map_step`), each process supplying its own
rank's rows. `launch_multiprocess` starts real worker processes (``python -m
jax_impl.harness.multiprocess_worker``, which joins the job and runs the step) through
`crosscheck.launch.worker_processes.run_workers`, so every wait is bounded and a crashed
worker stops the others instead of leaving them blocked in a collective.

A worker runs a *spec* (JSON), plain data so that no harness code enters the workers:
``cases`` (``[{"fixture": path to a six-array fixture .npz, "accum_steps": M}]``; R is the
number of processes), ``dtypes``, ``schemes``, ``variants`` (``[[strategy, collective]]``),
``optimizer`` (``{"name": "adamw" | "sgd", **hyperparameters}``), ``max_grad_norm``,
``num_updates``, ``x64``, optionally ``scheme_specs`` (contract v2 spec dicts, run on the
cases' rows with their v2 fields, keyed ``spec<k>`` in place of a scheme, all in one
compiled sweep; ``spec_id_space``, ``{"num_groups": G, "num_documents": D}``, lays every
fixture out in one id space), ``jax_config`` (``[[name, value]]``: ``jax.config`` settings
each launched process makes before it traces anything; the harness turns Shardy off, so that
its sweeps are traced once for every batch shape, `jax_impl.harness.traced_once`) and, for
tests,
``fail_process`` (that process exits with 3 right after joining) and ``stall_process`` (that
process blocks for an hour after its first update's gradients, having written its pid to
``process<i>.stalled``: a test kills it there).
``dtypes`` are the params' dtypes (float64, float32, bfloat16); the soft weights are laid out
in the denominator dtype (float64 under x64, else float32) whatever the params' dtype, so that
no d is rounded before the step (`jax_impl.denominators`). It writes what it computed, nothing
judged, to ``process<i>.pkl``: per case and update the reduced gradient, the updated params
and the metrics (per-rank metrics: its own rank's entry only), under keys
``"<case>/<dtype>/<strategy>-<collective>/<scheme>/<update>/<field>"``, and its ``rank``, as
a pickled list of dicts of numpy arrays, one per rank of the process's devices (one here)
(bfloat16 values widened to float32, exactly, so that a reader needs no bfloat16 type)
(thousands of small arrays load far faster from one pickle than from as many members of an
.npz).

Under an outside launcher (a multi-host start: ``crosscheck run --coordinator ...``), this
process already belongs to a ``jax.distributed`` job (`joined_job`) whose processes may hold
several devices each: nothing is launched, each process runs the spec itself
(`jax_impl.harness.in_place.run_spec_in_place`).

Coordinator port: held by the launcher (`crosscheck.launch.worker_processes.PortReservation`) for
the whole launch, so concurrent launches never share one; process 0 checks it can bind the port
before starting the coordinator and otherwise exits with `PORT_TAKEN_EXIT`, and the launch is
retried on a fresh port.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from crosscheck.launch.worker_processes import (
    LaunchError,
    PortReservation,
    process_env,
    reserve_port,
    run_workers,
)
from crosscheck.launch.zygote import Zygote

#: The module each process runs: ``python -m jax_impl.harness.multiprocess_worker``.
WORKER_MODULE = "jax_impl.harness.multiprocess_worker"
#: Exit status of process 0 when the coordinator's port is taken (EX_TEMPFAIL): the launch is
#: retried on another port.
PORT_TAKEN_EXIT = 75
#: What gRPC writes when the coordinator cannot bind, before XLA crashes the process (SIGSEGV
#: in jaxlib 0.10): a port taken between process 0's check and the coordinator's bind.
_GRPC_BIND_FAILED = "Failed to add port to server"
#: Launch attempts, each on a fresh port, when the coordinator's port turns out to be taken.
PORT_ATTEMPTS = 3


def variant_name(strategy: str, collective: str) -> str:
    return f"{strategy}-{collective}"


def worker_env(
    base: Mapping[str, str] | None = None, extra_xla_flags: str = "", devices_per_process: int = 1
) -> dict[str, str]:
    """The environment of a worker: `devices_per_process` CPU devices (one rank each),
    jax_impl importable, one BLAS thread.

    A forced host device count inherited from the parent (a test session's 8) is replaced by
    `devices_per_process`. `extra_xla_flags` are appended.
    """
    env = dict(os.environ if base is None else base)
    flags = f"{env.get('XLA_FLAGS', '')} {extra_xla_flags}"
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", flags)
    count = f"--xla_force_host_platform_device_count={devices_per_process}"
    env["XLA_FLAGS"] = " ".join([*flags.split(), count])
    env["JAX_PLATFORMS"] = "cpu"
    return process_env(env)


def _port_taken(error: LaunchError, log_dir: Path) -> bool:
    """Whether a launch failed because process 0's coordinator could not bind its port."""
    if 0 not in error.failed:
        return False
    if error.failed[0] == PORT_TAKEN_EXIT:
        return True
    try:
        return _GRPC_BIND_FAILED in (log_dir / "worker0.err").read_text(errors="replace")
    except OSError:
        return False


def launch_multiprocess(
    spec: Mapping[str, Any],
    num_processes: int,
    work_dir: str | Path,
    *,
    timeout_s: float,
    extra_xla_flags: str = "",
    zygote: Zygote | None = None,
    devices_per_process: int = 1,
) -> list[dict[str, np.ndarray]]:
    """Run `spec` on `num_processes` real processes of `devices_per_process` CPU devices each
    (R = their product: process i holds ranks i d .. i d + d - 1); return each rank's results,
    in rank order.

    Raises `crosscheck.launch.worker_processes.LaunchError` when a worker fails (a worker killed by
    a signal is named with the signal, the others are stopped within a second) or `timeout_s`
    passes; the whole call, retries included, waits at most ``timeout_s`` plus the launcher's kill
    wait. With a `zygote` (`crosscheck.launch.zygote`) the processes are forked from it.

    The coordinator's port cannot race with another launch: it is held by a
    `crosscheck.launch.worker_processes.PortReservation` until the launch ends. Should it still be
    taken when process 0 starts the coordinator (a process that bound it explicitly), the launch is
    retried on a new port, up to `PORT_ATTEMPTS` attempts; each attempt's logs are in
    ``work_dir/attempt<k>``.
    """
    if num_processes < 1 or devices_per_process < 1:
        raise ValueError(
            f"num_processes and devices_per_process must be >= 1, got {num_processes} and "
            f"{devices_per_process}"
        )
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    spec_path = work_dir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    deadline = time.monotonic() + timeout_s
    env = worker_env(extra_xla_flags=extra_xla_flags, devices_per_process=devices_per_process)
    for attempt in range(1, PORT_ATTEMPTS + 1):
        log_dir = work_dir / f"attempt{attempt}"
        with reserve_port() as reservation:
            try:
                _launch_once(
                    reservation, spec_path, num_processes, work_dir, log_dir, env, zygote,
                    max(deadline - time.monotonic(), 1.0),
                )  # fmt: skip
                break
            except LaunchError as error:
                if attempt == PORT_ATTEMPTS or not _port_taken(error, log_dir):
                    raise
    outputs = []
    for i in range(num_processes):
        outputs.extend(pickle.loads((work_dir / f"process{i}.pkl").read_bytes()))
    return outputs


def joined_job() -> bool:
    """Whether this process already joined a ``jax.distributed`` job (started by an outside
    launcher, one process per host): then the spec runs in the job's processes
    (`run_spec_in_place`), no launch starts. Imports no JAX: a process that has not imported
    it has joined nothing."""
    jax = sys.modules.get("jax")
    return jax is not None and jax.distributed.is_initialized()


def _launch_once(
    reservation: PortReservation,
    spec_path: Path,
    num_processes: int,
    work_dir: Path,
    log_dir: Path,
    env: Mapping[str, str],
    zygote: Zygote | None,
    timeout_s: float,
) -> None:
    """One attempt of `launch_multiprocess`, on the reserved port."""
    coordinator = f"127.0.0.1:{reservation.port}"
    commands = [
        [
            sys.executable, "-m", WORKER_MODULE,
            "--coordinator", coordinator,
            "--num-processes", str(num_processes),
            "--process-id", str(i),
            "--spec", str(spec_path),
            "--out", str(work_dir),
        ]
        for i in range(num_processes)
    ]  # fmt: skip
    try:
        run_workers(commands, timeout_s=timeout_s, log_dir=log_dir, env=env, zygote=zygote)
    except LaunchError as error:
        raise LaunchError(
            f"multi-process launch of {num_processes} jax.distributed processes (worker i is "
            f"process i, coordinator {coordinator}) failed: {error}",
            failed=error.failed,
            timed_out=error.timed_out,
        ) from None
