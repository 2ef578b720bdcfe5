"""Device requirements of the multi-device front-ends, failing loudly when devices are missing.

A data-parallel check that silently runs on fewer devices than asked for proves nothing (chex's
pmap variant skips in that case); here a missing device is an error that says how to get it.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from jax_impl.batch import BATCH_KEYS, Batch


def require_devices(world_size: int) -> list[jax.Device]:
    """The first `world_size` devices, or RuntimeError naming what is missing and the fix."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    devices = jax.devices()
    if len(devices) < world_size:
        raise RuntimeError(
            f"world_size={world_size} needs {world_size} devices, found {len(devices)} "
            f"({devices[0].platform}); on CPU set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={world_size} before importing jax"
        )
    return devices[:world_size]


def check_rank_axis(batch: Batch, world_size: int, where: str) -> None:
    """Every token array of `batch` must be [R, M, B, T] with R = world_size."""
    for name in BATCH_KEYS:
        shape: Sequence[int] = np.shape(getattr(batch, name))
        if len(shape) != 4 or shape[0] != world_size:
            raise ValueError(
                f"{where}: batch.{name} must be [R={world_size}, M, B, T], got shape "
                f"{tuple(shape)}; lay the global batch out with "
                f"jax_impl.lay_out_global_batch(batch, world_size, accum_steps)"
            )
