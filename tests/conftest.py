"""Shared test set-up.

JAX reads XLA_FLAGS once, at import: eight fake CPU devices must be requested before any test
module imports jax, so it happens here, first. Tests that need them check `jax.device_count()`
and fail (never skip) when the devices are missing.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
# Keep numpy/BLAS to one thread per process: the multi-process tests start several processes
# on a 2-core machine, and oversubscribed BLAS threads only make them slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")
