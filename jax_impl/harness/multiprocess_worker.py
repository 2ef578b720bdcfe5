"""One process of a multi-process run (`jax_impl.harness.multiprocess`): join, run, write.

``python -m jax_impl.harness.multiprocess_worker --coordinator HOST:PORT --num-processes R
--process-id I --spec SPEC --out DIR``, started by
`jax_impl.harness.multiprocess.launch_multiprocess` (the spec's format is described there).
The process joins the job with ``jax.distributed`` over gloo (`initialize`), owns one CPU
device and one rank of the "data" mesh that spans every process (`global_data_mesh`), runs the
shard_map step (`jax_impl.shard_map_step`) on its own rank's rows for every case, dtype,
scheme spec and variant of the spec, and writes what it computed, nothing judged, to
``DIR/process<I>.pkl``: a list of one dict per rank of its devices (one, as the launcher
starts it). In a process that already joined a job (a multi-host start),
`jax_impl.harness.in_place.run_spec_in_place` runs the same spec (`compute_spec`) without
files and gathers every process's records.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
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

from crosscheck.launch.worker_processes import write_atomically
from jax_impl.batch import Batch, lay_out_global_batch, rank_slice
from jax_impl.denominators import denominator_dtype
from jax_impl.harness.multiprocess import PORT_TAKEN_EXIT, variant_name
from jax_impl.harness.traced_once import TracedOnce
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
#: How long a process waits for process 0 to publish a program it compiles: the launch's own
#: deadline (`crosscheck.run.jax_runner.WORKER_TIMEOUT_S`, 300 s) ends a launch that stalls
#: sooner; this bound only keeps the wait finite where a worker runs without a launcher.
SHARED_PROGRAM_WAIT_S = 600


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

    Then `share_compiled_programs`: process 0 compiles each program that spans the
    processes, the others load its binary (and the spec sweeps process 0 alone traces too,
    `CompiledByProcessZero`).
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
    share_compiled_programs()


def shared_program_key(options: Any, backend: Any, computation: Any, devices: Any, **_: Any) -> str:
    """The key under which process 0 publishes a compiled program: a hash of the module's
    text and its compile options, which every process of an SPMD program holds identical.

    jax's own key (``jax._src.compiler._get_cache_key``) hashes each process's own devices
    too, so on CPU it differs between processes and a process waiting for process 0's binary
    would wait for a key nobody publishes. Compile options that did differ (a program local
    to one process, whose options name its own device) give different keys: such a program
    is not shared (jax shares only programs whose devices span several processes).
    """
    digest = hashlib.sha256(str(computation).encode())
    digest.update(options.SerializeAsString())
    return f"gradweight-shared-{digest.hexdigest()}"


#: Whether `share_compiled_programs` turned sharing on in this process: then `compute_spec`
#: has process 0 alone trace its sweeps too (`CompiledByProcessZero`).
_SHARING = False


def share_compiled_programs(wait_s: int = SHARED_PROGRAM_WAIT_S) -> bool:
    """Compile every program that spans the processes once, in process 0, and hand the
    binary to the others through jax.distributed's key-value store; whether it is on.

    Every process of a launch otherwise compiles the same SPMD programs, on the same few
    cores: at R = 4 three of the four compilations were waste. The binary is the one process 0
    compiled, so every process runs exactly the same code (results are bit-identical to each
    process compiling its own: same module, same options, same compiler). jax does the
    publishing and loading (``jax_share_binary_between_hosts``); this process only gives it
    a key every process computes alike (`shared_program_key`), through the private hook
    ``jax._src.compiler._get_cache_key``. Where a jax version lacks that hook, nothing is
    shared (every process compiles, as before): sharing with jax's own key would hang.
    """
    from jax._src import compiler

    if not callable(getattr(compiler, "_get_cache_key", None)):
        return False
    compiler._get_cache_key = shared_program_key
    jax.config.update("jax_share_binary_between_hosts", True)
    jax.config.update("jax_share_binary_between_hosts_timeout_ms", wait_s * 1000)
    global _SHARING
    _SHARING = True
    return True


def shared_program_count() -> int:
    """How many programs this process compiled and published (process 0) or loaded from
    process 0 (the others): what jax's sharing holds, and the sweeps `CompiledByProcessZero`
    shared (jax's sharing never sees those: process 0 compiles them ahead of time); 0 when
    nothing was shared."""
    from jax._src import compiler

    held = getattr(getattr(compiler, "_compile_and_share_module", None), "modules_cache", {})
    return len(held) + CompiledByProcessZero.called


class CompiledByProcessZero:
    """A jitted program of every process of the job that only process 0 traces, lowers and
    compiles; every other process loads its binary without tracing the program at all.

    jax's own sharing (`share_compiled_programs`) saves the other processes the compile only:
    each still traces and lowers the program to compute the key it waits for, and for the
    spec sweeps that is most of what such a process does (a sweep's trace and lowering cost
    more than its compile). Here the key is what every process knows before tracing: the
    order in which the job's programs are first called, which an SPMD job keeps the same in
    every process (each waits in the other's collectives otherwise), and the arguments'
    shapes, dtypes and shardings, which name a mismatch if the order ever differed. Process 0
    publishes ``jax.experimental.serialize_executable.serialize`` of its compiled program
    through jax.distributed's key-value store; the others ``deserialize_and_load`` it. Every
    process runs process 0's binary, as with jax's sharing: the results are the same bits.
    """

    #: Programs first called in this process so far (the next one's place in the job's order).
    called = 0
    #: Programs this process loaded from process 0 (`shared_program_count`).
    loaded = 0

    def __init__(self, jitted: Any, wait_s: int = SHARED_PROGRAM_WAIT_S) -> None:
        self._jitted = jitted
        self._wait_ms = wait_s * 1000
        self._compiled: dict[str, Any] = {}

    def __call__(self, *args: Any) -> Any:
        leaves, tree = jax.tree.flatten(args)
        signature = f"{tree}|" + "|".join(
            f"{leaf.shape}{leaf.dtype}{getattr(leaf, 'sharding', None)}" for leaf in leaves
        )
        compiled = self._compiled.get(signature)
        if compiled is None:
            compiled = self._compiled[signature] = self._share(signature, args)
        return compiled(*args)

    def _share(self, signature: str, args: tuple) -> Any:
        from jax._src import config, distributed
        from jax.experimental.serialize_executable import deserialize_and_load, serialize

        order = CompiledByProcessZero.called
        CompiledByProcessZero.called += 1
        digest = hashlib.sha256(signature.encode()).hexdigest()
        key = f"gradweight-sweep-{order}-{digest}"
        client = distributed.global_state.client
        if jax.process_index() == 0:
            # Not published a second time by jax's own sharing, which no process reads.
            with config.share_binary_between_hosts(False):
                compiled = self._jitted.lower(*args).compile()
            client.key_value_set_bytes(key, pickle.dumps(serialize(compiled)))
            return compiled
        try:
            published = client.blocking_key_value_get_bytes(key, self._wait_ms)
        except Exception as error:  # jax.errors.JaxRuntimeError: DEADLINE_EXCEEDED
            raise RuntimeError(
                f"process {jax.process_index()}: process 0 published no program {order} "
                f"with these arguments within {self._wait_ms // 1000} s (it failed, or the "
                f"processes called their programs in another order): {signature[:300]}"
            ) from error
        payload, in_tree, out_tree = pickle.loads(published)
        CompiledByProcessZero.loaded += 1
        return deserialize_and_load(payload, in_tree, out_tree)


#: Every sweep program of this process (`traced_sweeps` counts their exports).
_SWEEPS: list[TracedOnce] = []


def _sweep_program(jitted: Any) -> Any:
    """How a spec sweep's program is compiled: traced once for every batch shape
    (`TracedOnce`, under GSPMD: the spec's ``jax_config`` may turn Shardy off), and where
    sharing is on, traced and compiled by process 0 alone (`CompiledByProcessZero`)."""
    traced = TracedOnce(jitted)
    _SWEEPS.append(traced)
    return CompiledByProcessZero(traced) if _SHARING else traced


def traced_sweeps() -> int:
    """How many sweeps this process traced through an export (0 under Shardy, and in every
    process but 0 where sharing is on: those load process 0's binaries untraced)."""
    return sum(sweep.traces for sweep in _SWEEPS)


def global_data_mesh() -> tuple[Mesh, list[jax.Device]]:
    """The "data" mesh over every process's devices, process by process, and this process's
    own devices in rank order: rank r is the r-th device of the mesh, so that a process's ranks
    are consecutive (one per process where each has one device, as the launcher starts them)."""
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mine = [d for d in devices if d.process_index == jax.process_index()]
    return data_mesh(len(devices), devices=devices), mine


def _optimizer(settings: Mapping[str, Any]) -> optax.GradientTransformation:
    settings = dict(settings)
    name = settings.pop("name")
    if name == "adamw":
        return optax.adamw(**settings)
    if name == "sgd":
        return optax.sgd(**settings)
    raise ValueError(f"spec optimizer: name must be 'adamw' or 'sgd', got {name!r}")


def _own(x: jax.Array, device: jax.Device) -> np.ndarray:
    """The block of `x` on `device`: the whole value if replicated, its rank's entry if per-rank.

    bfloat16 comes back as float32 (exact: every bfloat16 is a float32)."""
    (shard,) = [shard for shard in x.addressable_shards if shard.device == device]
    value = np.asarray(shard.data)
    return value.astype(np.float32) if x.dtype == jnp.bfloat16 else value


def _run_configs(
    sweep: SweepFn,
    configs: Sequence[StepConfig],
    labels: Sequence[str],
    params0: Params,
    batch: Batch,
    num_updates: int,
    prefix: str,
    records: Sequence[tuple[jax.Device, dict[str, np.ndarray]]],
    stall_marker: Path | None = None,
) -> None:
    """`num_updates` consecutive updates of every config, all from the same start; a config's
    records are keyed by its variant and its scheme's label."""
    state0 = init_opt_state(configs[0].optimizer, params0)
    pending: list[tuple[str, UpdateResult]] = []
    params, states = [params0] * len(configs), [state0] * len(configs)
    for update in range(num_updates):
        reduced = sweep(params, batch)
        if stall_marker is not None:
            # Test hook: stop in the middle of the run, gradients reduced but the update
            # not applied, so the peers block in their next collective.
            jax.block_until_ready(reduced)
            stall_marker.write_text(str(os.getpid()))
            time.sleep(3600)
        for v, (config, label) in enumerate(zip(configs, labels, strict=True)):
            out = apply_optimizer(reduced[v], params[v], states[v], config)
            params[v], states[v] = out.params, out.opt_state
            name = variant_name(config.strategy.value, config.collective.value)
            pending.append((f"{prefix}/{name}/{label}/{update}", out))
    # Read back only after everything was dispatched: a host sync per update would make every
    # process wait for the slowest peer's compile and collective at each step.
    for key, out in pending:
        for device, results in records:
            for leaf in ("embed", "unembed"):
                results[f"{key}/grads.{leaf}"] = _own(out.grads[leaf], device)
                results[f"{key}/params.{leaf}"] = _own(out.params[leaf], device)
            for field, value in out.metrics._asdict().items():
                results[f"{key}/{field}"] = _own(value, device)


def run_spec(spec: Mapping[str, Any], out_path: Path) -> None:
    """Run every case of `spec` on the global mesh; write this process's records (a list, one
    dict per rank of its devices) to `out_path`."""
    stall = (
        out_path.with_suffix(".stalled")
        if spec.get("stall_process") == jax.process_index()
        else None
    )
    records = compute_spec(spec, stall)
    write_atomically(out_path, pickle.dumps(records, protocol=pickle.HIGHEST_PROTOCOL))


def compute_spec(spec: Mapping[str, Any], stall: Path | None = None) -> list[dict[str, Any]]:
    """Every case of `spec` on the global mesh: a dict per rank of this process's devices."""
    mesh, devices = global_data_mesh()
    first_rank = list(mesh.devices.flat).index(devices[0])
    optimizer = _optimizer(spec["optimizer"])
    # Every scheme of the spec: the names (``schemes``, labelled by name) and the contract v2
    # specs (``scheme_specs``, their dicts, labelled ``spec<k>``), every variant of each side
    # by side in one sweep per set of labels the cases name: one compiled program per batch
    # shape and set.
    schemes = [(name, name) for name in spec["schemes"]]
    schemes += [(f"spec{k}", s) for k, s in enumerate(spec.get("scheme_specs", []))]
    records = [(device, {"rank": np.asarray(first_rank + i)}) for i, device in enumerate(devices)]
    # A case may name the labels it needs (``"schemes"``): the cases that need the same ones
    # share a sweep, so that no program computes a scheme its fixtures do not run.
    sweeps: dict[tuple[str, ...], list[int]] = {}
    known = [label for label, _ in schemes]
    for case_index, case in enumerate(spec["cases"]):
        wanted = case.get("schemes")
        unknown = sorted(set(wanted or ()) - set(known))
        if unknown or wanted == []:
            raise ValueError(
                f"spec case {case_index} names schemes {unknown or wanted!r}: each must be one "
                f"the spec holds ({', '.join(known)}), and at least one"
            )
        key = tuple(label for label in known if wanted is None or label in wanted)
        sweeps.setdefault(key, []).append(case_index)
    for wanted_labels, case_indices in sweeps.items():
        configs, labels = [], []
        for label, scheme in schemes:
            if label not in wanted_labels:
                continue
            for strategy, collective in spec["variants"]:
                configs.append(
                    StepConfig(
                        optimizer=optimizer,
                        scheme=scheme,
                        strategy=strategy,
                        collective=collective,
                        max_grad_norm=spec.get("max_grad_norm"),
                    )
                )
                labels.append(label)
        sweep = make_shard_map_sweep(configs, mesh, compile_with=_sweep_program)
        for case_index in case_indices:
            case = spec["cases"][case_index]
            with np.load(case["fixture"], allow_pickle=False) as archive:
                arrays = {key: archive[key] for key in archive.files}
            for dtype in spec["dtypes"]:
                laid_out = lay_out_global_batch(
                    arrays,
                    mesh.size,
                    case["accum_steps"],
                    vocab_size=arrays["embed"].shape[0],
                    # Not the params' dtype: a bfloat16 weight is already rounded to 8 bits.
                    weights_dtype=np.dtype(denominator_dtype().name),
                    # One id space for every fixture of the launch (``spec_id_space``), so that
                    # they share the compiled program of their shape.
                    **spec.get("spec_id_space", {}),
                )
                # Each process places only its own rank's rows; the global array spans them.
                batch = shard_batch(rank_slice(laid_out, first_rank, len(devices)), mesh)
                params = {key: arrays[key] for key in ("embed", "unembed")}
                params0 = replicate(params_from_numpy(params, dtype), mesh)
                _run_configs(
                    sweep, configs, labels, params0, batch, spec["num_updates"],
                    f"{case_index}/{dtype}", records, stall,
                )  # fmt: skip
    for _, results in records:
        results["shared_programs"] = np.asarray(shared_program_count())
        results["loaded_programs"] = np.asarray(CompiledByProcessZero.loaded)
        results["traced_sweeps"] = np.asarray(traced_sweeps())
    return [results for _, results in records]


def main(argv: Sequence[str] | None = None) -> int:
    """Worker entry point: ``python -m jax_impl.harness.multiprocess_worker --spec S ...``."""
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
    for name, value in spec.get("jax_config", []):
        jax.config.update(name, value)
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


if __name__ == "__main__":
    sys.exit(main())
