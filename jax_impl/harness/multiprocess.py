"""Multi-process data parallelism with ``jax.distributed`` on CPU (gloo collectives).

Each process owns one CPU device and one rank; the "data" mesh spans all processes and the
shard_map step runs unchanged (`jax_impl.shard_map_step`), each process supplying its own
rank's rows. `launch_multiprocess` starts real worker processes (``python -m
jax_impl.harness.multiprocess``) through `jax_impl.harness.launch.run_workers`, so every wait is
bounded and a crashed worker stops the others instead of leaving them blocked in a collective.

A worker runs a *spec* (JSON), plain data so that no harness code enters the workers:
``cases`` (``[{"fixture": path to a six-array fixture .npz, "accum_steps": M}]``; R is the
number of processes), ``dtypes``, ``schemes``, ``variants`` (``[[strategy, collective]]``),
``optimizer`` (``{"name": "adamw" | "sgd", **hyperparameters}``), ``max_grad_norm``,
``num_updates``, ``x64`` and, for tests, ``fail_process`` (that process exits with 3 right
after joining) and ``stall_process`` (that process blocks for an hour after its first update's
gradients, having written its pid to ``process<i>.stalled``: a test kills it there).
``dtypes`` are the params' dtypes (float64, float32, bfloat16); the soft weights are laid out
in the denominator dtype (float64 under x64, else float32) whatever the params' dtype, so that
no d is rounded before the step (`jax_impl.denominators`). It writes what it computed, nothing
judged, to ``process<i>.pkl``: per case and update the reduced gradient, the updated params
and the metrics (per-rank metrics: its own rank's entry only), under keys
``"<case>/<dtype>/<strategy>-<collective>/<scheme>/<update>/<field>"``, and its ``rank``, as
one pickled dict of numpy arrays (bfloat16 values widened to float32, exactly, so that a
reader needs no bfloat16 type) (thousands of small arrays load far faster from one pickle
than from as many members of an .npz).

Coordinator port: held by the launcher (`jax_impl.harness.launch.PortReservation`) for the whole
launch, so concurrent launches never share one; process 0 checks it can bind the port before
starting the coordinator and otherwise exits with `PORT_TAKEN_EXIT`, and the launch is retried
on a fresh port.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from jax_impl.batch import lay_out_global_batch, rank_slice
from jax_impl.denominators import denominator_dtype
from jax_impl.harness.launch import LaunchError, PortReservation, reserve_port, run_workers
from jax_impl.harness.zygote import Zygote
from jax_impl.losses import Microbatch
from jax_impl.model import Params, params_from_numpy
from jax_impl.shard_map_step import (
    data_mesh,
    init_opt_state,
    make_shard_map_sweep,
    replicate,
    shard_batch,
)
from jax_impl.update import StepConfig, SweepFn, UpdateResult, apply_optimizer

WORKER_TIMEOUT_S = 60  # jax.distributed's own waits (initialization, heartbeat, shutdown)
#: Exit status of process 0 when the coordinator's port is taken (EX_TEMPFAIL): the launch is
#: retried on another port.
PORT_TAKEN_EXIT = 75
#: What gRPC writes when the coordinator cannot bind, before XLA crashes the process (SIGSEGV
#: in jaxlib 0.10): a port taken between process 0's check and the coordinator's bind.
_GRPC_BIND_FAILED = "Failed to add port to server"
#: Launch attempts, each on a fresh port, when the coordinator's port turns out to be taken.
PORT_ATTEMPTS = 3


def check_coordinator_port(coordinator_address: str) -> str:
    """Why the coordinator cannot bind `coordinator_address`'s port, or '' when it can.

    Binds the port as the coordinator's gRPC server does (SO_REUSEPORT where it exists, so a
    launcher's `PortReservation` does not count as taken) and lets it go. Without this check a
    taken port crashes process 0 inside XLA (SIGSEGV) with a one-line gRPC error.
    """
    host, _, port = coordinator_address.rpartition(":")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        if hasattr(socket, "SO_REUSEPORT"):
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            probe.bind((host, int(port)))
        except OSError as error:
            return f"the coordinator port {port} on {host} is taken ({error.strerror})"
    return ""


def initialize(
    coordinator_address: str, num_processes: int, process_id: int, *, timeout_s: int = 60
) -> None:
    """Join the job: gloo CPU collectives, then ``jax.distributed.initialize`` with timeouts.

    Every process compiles each SPMD program itself. (jax's ``share_binary_between_hosts``
    would compile once and hand the binary over, but on CPU in jax 0.10 the persistent-cache
    key differs between processes, so the receivers wait for a key nobody publishes.)
    """
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=timeout_s,
        heartbeat_timeout_seconds=timeout_s,
        shutdown_timeout_seconds=timeout_s,
    )


def global_data_mesh() -> tuple[Mesh, int]:
    """The "data" mesh over every process's device, rank r on process r; and our rank."""
    if jax.local_device_count() != 1:
        raise RuntimeError(
            f"process {jax.process_index()}: expected 1 local device, found "
            f"{jax.local_device_count()}; do not force a host device count in XLA_FLAGS"
        )
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return data_mesh(len(devices), devices=devices), devices.index(jax.local_devices()[0])


def variant_name(strategy: str, collective: str) -> str:
    return f"{strategy}-{collective}"


def _optimizer(settings: Mapping[str, Any]) -> optax.GradientTransformation:
    settings = dict(settings)
    name = settings.pop("name")
    if name == "adamw":
        return optax.adamw(**settings)
    if name == "sgd":
        return optax.sgd(**settings)
    raise ValueError(f"spec optimizer: name must be 'adamw' or 'sgd', got {name!r}")


def _own(x: jax.Array) -> np.ndarray:
    """This process's block: the whole value if replicated, its rank's entry if per-rank.

    bfloat16 comes back as float32 (exact: every bfloat16 is a float32)."""
    value = np.asarray(x.addressable_data(0))
    return value.astype(np.float32) if x.dtype == jnp.bfloat16 else value


def _run_schemes(
    sweep: SweepFn,
    configs: Sequence[StepConfig],
    params0: Params,
    batch: Microbatch,
    spec: Mapping[str, Any],
    prefix: str,
    results: dict[str, np.ndarray],
    stall_marker: Path | None = None,
) -> None:
    """`num_updates` consecutive updates per scheme, every variant from the same start."""
    state0 = init_opt_state(configs[0].optimizer, params0)
    pending: list[tuple[str, UpdateResult]] = []
    for scheme in spec["schemes"]:
        params, states = [params0] * len(configs), [state0] * len(configs)
        for update in range(spec["num_updates"]):
            reduced = sweep(params, batch, scheme)
            if stall_marker is not None:
                # Test hook: stop in the middle of the run, gradients reduced but the update
                # not applied, so the peers block in their next collective.
                jax.block_until_ready(reduced)
                stall_marker.write_text(str(os.getpid()))
                time.sleep(3600)
            for v, config in enumerate(configs):
                out = apply_optimizer(reduced[v], params[v], states[v], config)
                params[v], states[v] = out.params, out.opt_state
                name = variant_name(config.strategy.value, config.collective.value)
                pending.append((f"{prefix}/{name}/{scheme}/{update}", out))
    # Read back only after everything was dispatched: a host sync per update would make every
    # process wait for the slowest peer's compile and collective at each step.
    for key, out in pending:
        for leaf in ("embed", "unembed"):
            results[f"{key}/grads.{leaf}"] = _own(out.grads[leaf])
            results[f"{key}/params.{leaf}"] = _own(out.params[leaf])
        for field, value in out.metrics._asdict().items():
            results[f"{key}/{field}"] = _own(value)


def run_spec(spec: Mapping[str, Any], out_path: Path) -> None:
    """Run every case of `spec` on the global mesh; write this process's results."""
    mesh, rank = global_data_mesh()
    optimizer = _optimizer(spec["optimizer"])
    configs = [
        StepConfig(
            optimizer=optimizer,
            strategy=strategy,
            collective=collective,
            max_grad_norm=spec.get("max_grad_norm"),
        )
        for strategy, collective in spec["variants"]
    ]
    sweep = make_shard_map_sweep(configs, mesh)
    results: dict[str, np.ndarray] = {"rank": np.asarray(rank)}
    stall = (
        out_path.with_suffix(".stalled")
        if spec.get("stall_process") == jax.process_index()
        else None
    )
    for case_index, case in enumerate(spec["cases"]):
        with np.load(case["fixture"]) as archive:
            arrays = {key: archive[key] for key in archive.files}
        for dtype in spec["dtypes"]:
            laid_out = lay_out_global_batch(
                arrays,
                mesh.size,
                case["accum_steps"],
                vocab_size=arrays["embed"].shape[0],
                # Not the params' dtype: a bfloat16 weight is already rounded to 8 bits.
                weights_dtype=np.dtype(denominator_dtype().name),
            )
            # Each process places only its own rank's rows; the global array spans them all.
            batch = shard_batch(rank_slice(laid_out, rank), mesh)
            params = {key: arrays[key] for key in ("embed", "unembed")}
            params0 = replicate(params_from_numpy(params, dtype), mesh)
            _run_schemes(
                sweep, configs, params0, batch, spec, f"{case_index}/{dtype}", results, stall
            )
    tmp = out_path.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(results, protocol=pickle.HIGHEST_PROTOCOL))
    tmp.replace(out_path)


def main(argv: Sequence[str] | None = None) -> int:
    """Worker entry point.

    ``python -m jax_impl.harness.multiprocess --spec S --process-id I ...``.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--coordinator", required=True, help="host:port of process 0")
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--spec", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True, help="directory for process<i>.pkl")
    args = parser.parse_args(argv)
    spec = json.loads(args.spec.read_text())
    # x64 is global and must be set before any array exists; float32 cases stay float32
    # because every array they use is cast to float32 explicitly.
    jax.config.update("jax_enable_x64", bool(spec.get("x64", False)))
    if args.process_id == 0:
        taken = check_coordinator_port(args.coordinator)
        if taken:
            print(f"process 0: {taken}; the launch should retry on another port", file=sys.stderr)
            return PORT_TAKEN_EXIT
    initialize(args.coordinator, args.num_processes, args.process_id, timeout_s=WORKER_TIMEOUT_S)
    if spec.get("fail_process") == args.process_id:
        # Test hook: die after joining, so that the peers block in their first collective and
        # the launcher has to notice and stop them.
        print(f"process {args.process_id}: failing on purpose (spec fail_process)", file=sys.stderr)
        os._exit(3)
    run_spec(spec, args.out / f"process{args.process_id}.pkl")
    jax.distributed.shutdown()
    return 0


def worker_env(base: Mapping[str, str] | None = None, extra_xla_flags: str = "") -> dict[str, str]:
    """The environment of a worker: one CPU device, jax_impl importable, one BLAS thread.

    A forced host device count inherited from the parent (a test session's 8) is replaced by
    1: each process is one rank. `extra_xla_flags` are appended.
    """
    env = dict(os.environ if base is None else base)
    flags = f"{env.get('XLA_FLAGS', '')} {extra_xla_flags}"
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", flags)
    env["XLA_FLAGS"] = " ".join([*flags.split(), "--xla_force_host_platform_device_count=1"])
    env["JAX_PLATFORMS"] = "cpu"
    env.setdefault("OMP_NUM_THREADS", "1")
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


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
) -> list[dict[str, np.ndarray]]:
    """Run `spec` on `num_processes` real processes; return each process's results, in order.

    Raises `jax_impl.harness.launch.LaunchError` when a worker fails (a worker killed by a signal is
    named with the signal, the others are stopped within a second) or `timeout_s` passes; the
    whole call, retries included, waits at most ``timeout_s`` plus the launcher's kill wait.
    With a `zygote` (`jax_impl.harness.zygote`) the processes are forked from it.

    The coordinator's port cannot race with another launch: it is held by a
    `jax_impl.harness.launch.PortReservation` until the launch ends. Should it still be taken when
    process 0 starts the coordinator (a process that bound it explicitly), the launch is
    retried on a new port, up to `PORT_ATTEMPTS` attempts; each attempt's logs are in
    ``work_dir/attempt<k>``.
    """
    if num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes}")
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    spec_path = work_dir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    deadline = time.monotonic() + timeout_s
    env = worker_env(extra_xla_flags=extra_xla_flags)
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
        outputs.append(pickle.loads((work_dir / f"process{i}.pkl").read_bytes()))
    return outputs


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
            sys.executable, "-m", "jax_impl.harness.multiprocess",
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


if __name__ == "__main__":
    sys.exit(main())
