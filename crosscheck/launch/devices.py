"""Which device the torch ranks use and which platform the JAX workers run on.

torch (``--device``):

* ``cpu``: every rank on the CPU, collectives on gloo (what every test here runs);
* ``cuda``: one rank per GPU of this machine (rank r on ``cuda:r``, its local rank), the model
  and batch on that GPU, collectives on NCCL; the gradient is read back to the CPU in float64
  to be judged. Refused (`DeviceError`, exit 2) when torch sees no GPU or fewer GPUs than the
  largest world size asked for: one rank per GPU is what NCCL expects, and two ranks sharing
  a GPU would hang NCCL's collectives;
* ``auto``: ``cuda`` when torch sees a GPU *and* at least as many GPUs as the largest world
  size, ``cpu`` otherwise. Never a mix: a run whose layouts need four ranks on a two-GPU
  machine runs every layout on the CPU, so that all its rows are judged on one device.

JAX (``--platform``) sets ``JAX_PLATFORMS`` in the JAX worker processes: ``cpu`` (with eight
fake devices, as always), ``gpu`` (NVIDIA: ``cuda``; JAX's alias ``gpu`` would also try ROCm
and oneAPI and fail loudly where their plugins are absent) or ``tpu``. JAX then lays its
"data" mesh over that platform's devices, so a layout needs R devices of it.

torch is imported only to resolve ``auto`` or check ``cuda``: a command that runs no torch
rank never pays for it. ``torch.cuda.is_available()`` and ``device_count()`` do not create a
CUDA context in this process (they ask the driver for a count), and the ranks are forked from
a zygote or started fresh, never from this process, so checking here cannot poison them.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

TORCH_DEVICES = ("auto", "cpu", "cuda")
JAX_PLATFORMS = ("cpu", "gpu", "tpu")
#: ``--platform`` -> the ``JAX_PLATFORMS`` value a worker gets (see the module docstring).
JAX_PLATFORM_VALUES = {"cpu": "cpu", "gpu": "cuda", "tpu": "tpu"}


class DeviceError(ValueError):
    """The device asked for is not there (a set-up error: exit 2, before any process)."""


#: The device files through which torch reaches a GPU on Linux: NVIDIA's driver (its control
#: device, the first GPU, the driver's /proc entry), WSL2's GPU paravirtualization, AMD's
#: ROCm (torch.cuda on a ROCm build). With none of them, no GPU is visible to torch.
GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia", "/dev/dxg", "/dev/kfd")


def visible_gpus() -> int:
    """How many CUDA GPUs torch sees here (0 without torch, its CUDA build or a driver)."""
    # A run without torch installed skips its torch rows (crosscheck.run.implementations):
    # `auto` must then choose the CPU, not fail on the import.
    if importlib.util.find_spec("torch") is None:
        return 0
    # On Linux without a GPU's device files torch sees none, and asking it would cost this
    # process an import of torch (1.4 s on two cores) that nothing else here needs.
    if sys.platform.startswith("linux") and not any(map(os.path.exists, GPU_DEVICE_FILES)):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_torch_device(requested: str, ranks: int, gpus: int | None = None) -> str:
    """``"cpu"`` or ``"cuda"`` for a run whose largest world size is `ranks`.

    `gpus` is the number of visible GPUs (counted by `visible_gpus` when None; a parameter so
    that the choice can be checked on a machine without one). Raises DeviceError for an
    unknown name, or for ``cuda`` with no GPU or fewer GPUs than `ranks`.
    """
    if requested not in TORCH_DEVICES:
        raise DeviceError(f"--device must be one of {', '.join(TORCH_DEVICES)}, got {requested!r}")
    if ranks < 1:
        raise DeviceError(f"a run needs at least one rank, got {ranks}")
    if requested == "cpu":
        return "cpu"
    count = visible_gpus() if gpus is None else gpus
    if requested == "auto":
        return "cuda" if count >= ranks else "cpu"
    if count == 0:
        raise DeviceError(
            "--device cuda: torch sees no CUDA GPU here (torch.cuda.is_available() is False: "
            "a CPU build of torch, no driver, or CUDA_VISIBLE_DEVICES hides them); "
            "use --device cpu"
        )
    if count < ranks:
        raise DeviceError(
            f"--device cuda: the layouts need {ranks} ranks, one GPU each, and torch sees "
            f"{count} GPU(s); choose world sizes of at most {count} (--world-sizes), or "
            "--device cpu"
        )
    return "cuda"


def torch_backend(device: str) -> str:
    """The collectives' backend for ranks on `device`: NCCL on GPUs, gloo on the CPU."""
    return "nccl" if device == "cuda" else "gloo"


def jax_platform_env(platform: str, env: dict[str, str]) -> dict[str, str]:
    """`env` for a JAX worker on `platform`: ``JAX_PLATFORMS`` set, and off the CPU, no fake
    CPU device count (it would only add CPU devices the mesh does not use)."""
    if platform not in JAX_PLATFORM_VALUES:
        raise DeviceError(f"--platform must be one of {', '.join(JAX_PLATFORMS)}, got {platform!r}")
    env = dict(env)
    env["JAX_PLATFORMS"] = JAX_PLATFORM_VALUES[platform]
    if platform != "cpu":
        flags = env.get("XLA_FLAGS", "").split()
        kept = [f for f in flags if not f.startswith("--xla_force_host_platform_device_count")]
        env["XLA_FLAGS"] = " ".join(kept)
    return env


#: How long `jax_platform_problem`'s probe may take: importing JAX and starting one backend
#: (a few seconds; a GPU backend's first start may take longer).
PLATFORM_PROBE_TIMEOUT_S = 60.0
_PROBE = "import jax; print(jax.device_count(), jax.devices()[0].platform)"


def jax_platform_problem(platform: str) -> str:
    """Why JAX cannot run on `platform` here, or ''. The CPU always can; another platform is
    probed in a short, bounded process of its own (this one must not start a JAX backend:
    the platform is process-global). Without the probe a worker on a missing platform fails
    every job with JAX's bare AssertionError."""
    if platform == "cpu":
        return ""
    env = jax_platform_env(platform, dict(os.environ))
    try:
        probe = subprocess.run(
            [sys.executable, "-c", _PROBE],
            env=env,
            capture_output=True,
            text=True,
            timeout=PLATFORM_PROBE_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return (
            f"--platform {platform}: JAX did not start its {env['JAX_PLATFORMS']} backend "
            f"within {PLATFORM_PROBE_TIMEOUT_S:g} s"
        )
    if probe.returncode == 0:
        return ""
    lines = [line for line in probe.stderr.strip().splitlines() if line.strip()]
    last = lines[-1] if lines else f"exit status {probe.returncode}"
    if last.strip() == "AssertionError":  # JAX's own when no backend of the list started
        last = f"no {env['JAX_PLATFORMS']} device or plugin was found"
    return (
        f"--platform {platform}: JAX cannot run on {env['JAX_PLATFORMS']} here ({last}); "
        "use --platform cpu"
    )


#: Set by `crosscheck run --platform` / `verify --platform` for the JAX workers this process
#: starts (`crosscheck.launch.workers.jax_worker_env` reads it): the workers are started from
#: several runners, and one variable reaches all of them with one hunk.
PLATFORM_ENV = "GRADWEIGHT_JAX_PLATFORM"
#: Set by `--device` for the torch ranks this process launches (read by the launcher).
DEVICE_ENV = "GRADWEIGHT_TORCH_DEVICE"


def chosen_platform(env: dict[str, str] | None = None) -> str:
    """The JAX platform this process's workers run on: `PLATFORM_ENV`, else ``cpu``."""
    return (os.environ if env is None else env).get(PLATFORM_ENV) or "cpu"
