"""Running the bench: one torch launch, then one JAX worker, one after the other.

Never side by side: they would time each other. torch runs through
`torch_impl.harness.launcher.launch` (R rank processes in a gloo group, or one GPU each with NCCL),
JAX as one worker process through `crosscheck.launch.worker_processes.run_workers` with eight host
devices on the CPU; both bound every wait and leave no process behind, and an interrupt stops them
(`crosscheck.launch.processes`). torch and JAX are not imported into this process, except torch for
`--device cuda`'s count of GPUs.
"""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from crosscheck.bench.config import BenchConfig
from crosscheck.launch.processes import usable_cores
from crosscheck.launch.worker_processes import LaunchError, process_env, run_workers
from crosscheck.launch.workers import SMALL_PROGRAM_XLA_FLAGS
from crosscheck.run.implementations import not_installed

#: Bounds of one framework's run: the whole bench took 1.5 to 2.5 minutes on two heavily
#: shared cores (about 55 s of CPU), JAX's part the longer.
TORCH_TIMEOUT_S = 300.0
JAX_TIMEOUT_S = 400.0
#: A gloo collective whose peer died fails after this long instead of waiting forever.
COLLECTIVE_TIMEOUT_S = 120.0


class BenchSetupError(ValueError):
    """The bench cannot run as asked here (missing GPUs, say); found before any launch."""


@dataclass
class FrameworkRun:
    """What one framework's processes returned, or why they failed."""

    output: dict | None = None
    error: str = ""


@dataclass
class BenchRun:
    config: BenchConfig
    torch: FrameworkRun = field(default_factory=FrameworkRun)
    jax: FrameworkRun = field(default_factory=FrameworkRun)


def check_devices(config: BenchConfig) -> None:
    """Refuse a framework that is not installed, and `--device cuda` where fewer GPUs are
    visible than torch ranks asked for."""
    for framework in ("torch", "jax"):
        missing = not_installed(framework)
        if missing:
            raise BenchSetupError(f"{missing}; the bench times both frameworks")
    if config.device != "cuda":
        return
    import torch

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < config.torch_ranks:
        raise BenchSetupError(
            f"--device cuda runs one torch rank per GPU: --ranks {config.torch_ranks} needs "
            f"{config.torch_ranks} GPUs, torch sees {found} here"
            + ("" if found else " (no CUDA device, or a CPU-only torch build)")
        )
    if not torch.distributed.is_nccl_available():
        raise BenchSetupError("--device cuda needs torch's NCCL backend, not built in here")


def _threads_per_rank(ranks: int) -> int:
    """The cores this process may use, shared out between the ranks (at least one each)."""
    return max(1, len(usable_cores()) // ranks)


def run_torch(config: BenchConfig) -> FrameworkRun:
    from crosscheck.bench.torch_bench import bench_rank
    from torch_impl.harness.launcher import launch

    job = {"config": config, "threads": _threads_per_rank(config.torch_ranks)}
    try:
        per_rank = launch(
            bench_rank,
            config.torch_ranks,
            (job,),
            timeout_s=TORCH_TIMEOUT_S,
            collective_timeout_s=COLLECTIVE_TIMEOUT_S,
        )
    except Exception as error:  # a rank died or timed out: reported, the JAX run still runs
        return FrameworkRun(error=f"{type(error).__name__}: {error}")
    return FrameworkRun(output=per_rank[0])  # every rank returns the same, reduced, record


def jax_env(config: BenchConfig) -> dict[str, str]:
    """The JAX worker's environment: eight host devices and JAX's default compile flags (the
    harness's small-program flags trade run time for compile time: only `--quick` uses them),
    `--platform` as JAX_PLATFORMS, this repository first on PYTHONPATH."""
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "")
    if config.device == "cpu":
        flags = f"{flags} --xla_force_host_platform_device_count=8"
    if config.quick:
        flags = f"{flags} {SMALL_PROGRAM_XLA_FLAGS}"
    env["XLA_FLAGS"] = flags.strip()
    platform = config.platform or ("cpu" if config.device == "cpu" else None)
    if platform:
        env["JAX_PLATFORMS"] = platform
    else:
        env.pop("JAX_PLATFORMS", None)  # the default backend: a GPU where there is one
    return process_env(env)


def run_jax(config: BenchConfig) -> FrameworkRun:
    with tempfile.TemporaryDirectory(prefix="gradweight-bench-") as work:
        job_path, out_path = Path(work) / "job.pkl", Path(work) / "out.pkl"
        job_path.write_bytes(pickle.dumps({"config": config}))
        command = [sys.executable, "-m", "crosscheck.bench.jax_bench", str(job_path), str(out_path)]
        try:
            run_workers([command], timeout_s=JAX_TIMEOUT_S, log_dir=work, env=jax_env(config))
        except LaunchError as error:
            return FrameworkRun(error=str(error))
        return FrameworkRun(output=pickle.loads(out_path.read_bytes()))


def run_bench(config: BenchConfig) -> BenchRun:
    """Both frameworks' results (or errors), torch first; set-up problems raise first."""
    check_devices(config)
    return BenchRun(config, torch=run_torch(config), jax=run_jax(config))
