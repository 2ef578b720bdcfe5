"""A user's JAX step run in a multi-host JAX job (``jax.distributed``), one process per host.

``crosscheck verify --framework jax ...`` with ``--coordinator/--num-processes/--process-id``
(or ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``;
`crosscheck.launch.external`) starts no worker: this process itself joins the job with
``jax.distributed.initialize`` (gloo collectives on CPU), and every process calls the step on
the same jobs, the world size R being the global device count and the "data" mesh spanning
every process's devices, process by process. The step's arguments and the reading of its
result are the ones the harness's own worker uses (`crosscheck.verification.jax_verify_worker`):
the global [R, M, B, T] batch as numpy arrays, float64 params. Every process reads the same
replicated gradient and judges it alike; `LaunchedJaxJob.agree` still makes every process exit
with process 0's status.

x64 and the platform are process-global in JAX: this path is for a process of its own, as
the command line is. Bounds: ``jax.distributed``'s own waits (initialization, heartbeat,
shutdown) are ``--timeout``; a step that never returns is ended by the same watchdog as the
torch path (`WATCHDOG_GRACE_S` past ``--timeout``, exit STEP_FAILED).
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass, field

from crosscheck import exit_codes
from crosscheck.launch.devices import JAX_PLATFORM_VALUES
from crosscheck.launch.external import JaxMultiHost
from crosscheck.verification.protocol import StepError, VerifyJob, VerifyOutput
from crosscheck.verification.torch_launched import WATCHDOG_GRACE_S


@dataclass
class LaunchedJaxJob:
    """This process's membership of a multi-host JAX job: `join`, `run`, `agree`, `close`."""

    multihost: JaxMultiHost
    #: cpu, gpu or tpu (`crosscheck.launch.devices.JAX_PLATFORM_VALUES`); None: the backend
    #: JAX finds (a TPU host's TPUs, a GPU host's GPUs, else the CPU).
    platform: str | None
    timeout_s: float
    #: Who says so when the watchdog ends the process.
    command: str = "crosscheck verify"
    _joined: bool = field(default=False, init=False)
    _watchdog: threading.Timer | None = field(default=None, init=False)

    def join(self) -> int:
        """Join the job (once); the world size R, every process's devices together."""
        import jax

        if not self._joined:
            # Before any backend exists: both settings are read when the first one starts.
            if self.platform is not None:
                jax.config.update("jax_platforms", JAX_PLATFORM_VALUES[self.platform])
            jax.config.update("jax_enable_x64", True)
            # Collectives between CPU devices of different processes; no effect on a GPU's or
            # TPU's, which have their own (NCCL, ICI).
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            wait_s = max(1, int(self.timeout_s))
            jax.distributed.initialize(
                self.multihost.coordinator,
                num_processes=self.multihost.num_processes,
                process_id=self.multihost.process_id,
                initialization_timeout=wait_s,
                heartbeat_timeout_seconds=wait_s,
                shutdown_timeout_seconds=wait_s,
            )
            self._joined = True
            self._watchdog = threading.Timer(self.timeout_s + WATCHDOG_GRACE_S, self._expire)
            self._watchdog.daemon = True
            self._watchdog.start()
        return jax.device_count()

    def _expire(self) -> None:
        print(
            f"{self.command}: JAX process {self.multihost.process_id}: did not finish within "
            f"{self.timeout_s:g} s + {WATCHDOG_GRACE_S:g} s; ending it",
            file=sys.stderr,
            flush=True,
        )
        os._exit(exit_codes.STEP_FAILED)

    def run(self, step: str, jobs: list[VerifyJob]) -> dict[VerifyJob, VerifyOutput | StepError]:
        """Every job's gradient or StepError (a `verify` runner); the same on every process."""
        import jax

        from crosscheck.verification import jax_verify_worker as worker
        from jax_impl.shard_map_step import data_mesh

        world_size = self.join()
        # The mesh spans every process's devices, process by process: rank r's rows on the
        # r-th device of that order. The worker's own mesh takes jax.devices() as they come.
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        mesh = data_mesh(world_size, devices=devices)
        try:
            fn = worker.import_step(step, os.getcwd())
        except (Exception, SystemExit) as error:
            message = f"cannot import step {step}: {worker.describe_error(error, None, False)}"
            return {job: StepError(f"{job.describe()}: {message}") for job in jobs}
        module = sys.modules.get(step.partition(":")[0])
        module_file = getattr(module, "__file__", None)
        results: dict[VerifyJob, VerifyOutput | StepError] = {}
        for job in jobs:
            if job.world_size != world_size:  # the CLI lays every job out at R
                raise ValueError(f"{job.describe()}: the JAX job has {world_size} devices")
            status, payload = worker.run_job(fn, step, job, module_file, mesh)
            results[job] = VerifyOutput(*payload) if status == "ok" else StepError(payload)
        return results

    def agree(self, code: int) -> int:
        """Process 0's exit status, on every process (`code` when the job was never joined)."""
        if not self._joined:
            return code
        import numpy as np
        from jax.experimental import multihost_utils

        return int(multihost_utils.broadcast_one_to_all(np.int32(code)))

    def close(self) -> None:
        """Stop the watchdog and leave the job (when joined)."""
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._joined:
            import jax

            jax.distributed.shutdown()
            self._joined = False
