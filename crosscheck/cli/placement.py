"""Where `crosscheck run`'s processes compute: the torch ranks' device, the JAX workers' platform.

The matrix's runners start their processes in many places; rather than thread two arguments
through every one of them, `placed` sets two variables of this process's environment for the
run (`crosscheck.launch.devices.DEVICE_ENV`, read by `torch_impl.harness.launcher.launch`, and
`PLATFORM_ENV`, read by `crosscheck.launch.workers.jax_worker_env`) and restores them after,
so that a later command in the same process (a test calling ``main``) sees its own.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from crosscheck.launch.devices import (
    DEVICE_ENV,
    JAX_PLATFORM_VALUES,
    PLATFORM_ENV,
    DeviceError,
    jax_platform_problem,
    resolve_torch_device,
)
from crosscheck.run.implementations import framework_of
from crosscheck.run.plan import Plan


def torch_ranks(plan: Plan) -> int:
    """The largest world size any torch launch of `plan` uses (0 when it runs no torch)."""
    if not any(impl != "oracle" and framework_of(impl) == "torch" for impl in plan.impls):
        return 0
    # The plan's layouts (the world-size-change family included) and the resume rows' sizes.
    sizes = [R for R, _ in plan.wanted_layouts()]
    for case in plan.build().resume_cases:
        sizes += [case.world_size, case.resume_world_size]
    return max(sizes)


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def placed(
    device: str, platform: str | None, ranks: int, impls: list[str]
) -> contextlib.AbstractContextManager[None]:
    """A context in which the run's torch ranks use `device` and its JAX workers `platform`.

    Raises DeviceError (a ValueError) before any process starts: ``--device cuda`` without
    enough GPUs for `ranks`, or a platform JAX cannot start here. A run without torch ranks
    (`ranks` 0) never looks for a GPU, one without JAX workers (`impls`) never probes JAX.
    """
    platform = platform or "cpu"  # the workers' default, as without the option
    if platform not in JAX_PLATFORM_VALUES:
        raise DeviceError(f"--platform must be one of {', '.join(JAX_PLATFORM_VALUES)}")
    resolved = resolve_torch_device(device, ranks) if ranks else "cpu"
    runs_jax = any(impl != "oracle" and framework_of(impl) == "jax" for impl in impls)
    problem = jax_platform_problem(platform) if runs_jax else ""
    if problem:
        raise DeviceError(problem)
    return _environment({DEVICE_ENV: resolved, PLATFORM_ENV: platform})
