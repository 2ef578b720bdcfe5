r"""The JAX side of the bench: shard_map over R devices, three ways to weight one update.

Runs as a worker process (``python -m crosscheck.bench.jax_bench JOB OUT``, started by
`crosscheck.bench.runner` with eight host devices on the CPU). Each path is one jitted
``shard_map`` program over a 1-D "data" mesh of R devices: every device takes the gradient
of its rank's M microbatches of the small transformer (`jax_impl.transformer`, float32), a
``lax.scan`` accumulating them, then the collective. With G_r rank r's gradient of its summed
token losses, n_r its valid targets over M microbatches and N = sum_r n_r:

naive
    scale the sum by 1 / n_r, then pmean the gradient: (1/R) sum_r G_r / n_r.
precount
    psum(n_r) first (one extra scalar all-reduce), scale by 1 / N, psum the gradient.
fused
    one psum over (gradient, n_r) together, then divide by N.

The params enter each rank as its own copy (`jax_impl.shard_map_step.rank_varying`), so
``jax.grad`` returns the rank's own contribution and the step's collective is the only one.
"""

from __future__ import annotations

import pickle
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from crosscheck.bench.checks import float64_tree, refusals
from crosscheck.bench.config import IGNORE_INDEX, BenchConfig, packed_batch
from crosscheck.launch.workers import write_atomically
from jax_impl.shard_map_step import data_mesh, rank_varying
from jax_impl.transformer import initial_params, token_losses

PATHS = ("naive", "precount", "fused")
AXIS = "data"
Batch = tuple[jax.Array, jax.Array, jax.Array]  # inputs, targets, segment_ids: [M, B, T]


def _gradient_sum(params: dict, rank_batch: Batch, scale: jax.Array) -> dict:
    """sum over the M microbatches of grad(scale * sum of token losses); no collective."""

    def scaled_sum(p: dict, inputs: jax.Array, targets: jax.Array, segments: jax.Array):
        return token_losses(p, inputs, targets, segments).sum() * scale

    def micro_step(acc: dict, microbatch: Batch) -> tuple[dict, None]:
        grads = jax.grad(scaled_sum)(params, *microbatch)
        return jax.tree.map(jnp.add, acc, grads), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    total, _ = jax.lax.scan(micro_step, zeros, rank_batch)
    return total


def _local_count(rank_batch: Batch) -> jax.Array:
    """n_r as int32: exact for any count a device can hold."""
    return jnp.sum(rank_batch[1] != IGNORE_INDEX, dtype=jnp.int32)


def _naive(params: dict, batch: Batch) -> dict:
    rank_batch = tuple(x[0] for x in batch)
    local = rank_varying(params, AXIS)
    scale = 1.0 / _local_count(rank_batch).astype(jnp.float32)
    return jax.lax.pmean(_gradient_sum(local, rank_batch, scale), AXIS)


def _precount(params: dict, batch: Batch) -> dict:
    rank_batch = tuple(x[0] for x in batch)
    local = rank_varying(params, AXIS)
    total = jax.lax.psum(_local_count(rank_batch), AXIS)  # the extra scalar collective
    scale = 1.0 / total.astype(jnp.float32)
    return jax.lax.psum(_gradient_sum(local, rank_batch, scale), AXIS)


def _fused(params: dict, batch: Batch) -> dict:
    rank_batch = tuple(x[0] for x in batch)
    local = rank_varying(params, AXIS)
    grads = _gradient_sum(local, rank_batch, jnp.float32(1.0))
    # The count joins the gradient's all-reduce as one more float32 operand: one collective.
    # A float32 count is exact below 2^24 (a device holds far fewer targets here; `run_setup`
    # checks), and an int32 operand would be an all-reduce of its own.
    grads, total = jax.lax.psum((grads, _local_count(rank_batch).astype(jnp.float32)), AXIS)
    return jax.tree.map(lambda g: g / total, grads)


def _rank_sums(params: dict, batch: Batch) -> tuple[dict, jax.Array]:
    """Every rank's own G_r and n_r, stacked over ranks (for the references only)."""
    rank_batch = tuple(x[0] for x in batch)
    grads = _gradient_sum(rank_varying(params, AXIS), rank_batch, jnp.float32(1.0))
    return jax.tree.map(lambda g: g[None], grads), _local_count(rank_batch)[None]


def _program(per_rank: Callable, mesh: jax.sharding.Mesh, out_specs: object) -> Callable:
    return jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=out_specs))


def _references(rank_grads: dict, counts: np.ndarray) -> dict[str, dict[str, np.ndarray]]:
    """intended = sum_r G_r / N and rank_mean = (1/R) sum_r G_r / n_r, in float64."""
    n = counts.astype(np.float64)
    intended, rank_mean = {}, {}
    for name, stacked in rank_grads.items():
        g = np.asarray(stacked, dtype=np.float64)
        intended[name] = g.sum(axis=0) / n.sum()
        rank_mean[name] = (g / n.reshape((-1,) + (1,) * (g.ndim - 1))).mean(axis=0)
    return {"intended": intended, "rank_mean": rank_mean}


def run_setup(config: BenchConfig, world_size: int, batch: dict[str, np.ndarray]) -> dict:
    """Judge, time and measure the three paths on a mesh of `world_size` devices."""
    mesh = data_mesh(world_size, AXIS, jax.devices()[:world_size])
    params = jax.device_put(initial_params(jnp.float32), NamedSharding(mesh, P()))
    placed = tuple(
        jax.device_put(jnp.asarray(batch[key]), NamedSharding(mesh, P(AXIS)))
        for key in ("inputs", "targets", "segment_ids")
    )
    counts = (batch["targets"] != IGNORE_INDEX).reshape(world_size, -1).sum(axis=1)
    if counts.max() >= 2**24:
        raise ValueError(f"a rank holds {counts.max()} targets: past 2^24, float32 rounds it")
    programs = {
        "naive": _program(_naive, mesh, P()),
        "precount": _program(_precount, mesh, P()),
        "fused": _program(_fused, mesh, P()),
    }
    compiled = {path: fn.lower(params, placed).compile() for path, fn in programs.items()}
    path_grads = {path: float64_tree(compiled[path](params, placed)) for path in PATHS}
    rank_grads, rank_counts = _program(_rank_sums, mesh, (P(AXIS), P(AXIS)))(params, placed)
    refused = refusals(
        path_grads, _references(rank_grads, np.asarray(rank_counts)), counts.tolist()
    )
    timed = [p for p in PATHS if p not in refused]
    wall: dict[str, list[float]] = {path: [] for path in timed}
    cpu: dict[str, list[float]] = {path: [] for path in timed}
    for round_index in range(config.warmup + config.rounds):
        # Interleaved, and each round starts one path later, so that no path always runs
        # first (right after the previous round's last) or always last.
        shift = round_index % len(timed) if timed else 0
        for path in timed[shift:] + timed[:shift]:
            start, start_cpu = time.perf_counter(), time.process_time()
            jax.block_until_ready(compiled[path](params, placed))
            if round_index >= config.warmup:
                wall[path].append(time.perf_counter() - start)
                # Every device's thread is in this process: its CPU time is all R ranks'.
                cpu[path].append(time.process_time() - start_cpu)
    return {
        "times": wall,
        "cpu_times": cpu,
        "refused": refused,
        "peak_mem_bytes": {path: _program_bytes(compiled[path]) for path in timed},
        "rank_counts": counts.tolist(),
        "collectives": {path: _all_reduces(compiled[path]) for path in PATHS},
    }


def _program_bytes(compiled: jax.stages.Compiled) -> int | None:
    """Arguments + outputs + temporaries of the compiled program, per device (XLA's own
    accounting; None where the backend gives none)."""
    analysis = compiled.memory_analysis()
    if analysis is None:
        return None
    return int(
        analysis.argument_size_in_bytes
        + analysis.output_size_in_bytes
        + analysis.temp_size_in_bytes
    )


def _all_reduces(compiled: jax.stages.Compiled) -> int:
    """How many all-reduce ops the optimized program runs (fused must run as many as naive)."""
    text = compiled.as_text()
    return text.count(" all-reduce(") + text.count(" all-reduce-start(")


MEMORY_METHOD = (
    "compiled program's memory_analysis(): argument + output + temp bytes per device "
    "(the CPU backend's device.memory_stats() gives none)"
)


def run_job(job: dict) -> dict:
    """Every JAX setup of the job, in turn, and what the report needs of this process."""
    config: BenchConfig = job["config"]
    devices = jax.devices()
    # On a GPU: one setup over every device the backend has; on the CPU: the configured ones.
    world_sizes = (len(devices),) if config.device == "cuda" else config.jax_world_sizes
    wanted = max(world_sizes)
    if len(devices) < wanted:
        raise RuntimeError(
            f"the JAX bench needs {wanted} devices, found {len(devices)} "
            f"({devices[0].platform}); on CPU the bench sets "
            "XLA_FLAGS=--xla_force_host_platform_device_count=8"
        )
    setups = {R: run_setup(config, R, packed_batch(config, R)) for R in world_sizes}
    return {
        "setups": setups,
        "memory_method": MEMORY_METHOD,
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "device_count": len(devices),
        "jax_version": jax.__version__,
    }


def main(argv: Sequence[str]) -> int:
    """``JOB OUT``: run the pickled job, pickle the result to OUT (written whole or not at all)."""
    job = pickle.loads(Path(argv[0]).read_bytes())
    write_atomically(argv[1], pickle.dumps(run_job(job)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
