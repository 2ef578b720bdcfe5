"""A user's torch step run inside a job an existing launcher started (``torchrun``).

``torchrun --nproc-per-node N -m crosscheck verify --framework torch ...`` starts N copies of
the command, one per rank, each with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``
and ``MASTER_PORT`` (`crosscheck.launch.external`). Then crosscheck starts no process of its
own: every copy joins the launcher's process group (``init_method="env://"``), runs the step
on its own rank's microbatches for every job, in order (`torch_impl.harness.user_step.run_job`,
the code the harness's own ranks run), and the ranks exchange their outcomes over a gloo group
of their own (NCCL carries tensors, not pickled objects); each rank then holds every rank's
outcome of every job, and `crosscheck.verification.torch_verify_outcomes.judge` turns them into
the job's gradient (rank 0's, once every rank is known to hold the same) or a StepError.

`LaunchedTorchJob.agree` makes every rank exit with rank 0's status.

Bounds: the process group's collective timeout is `torch_verify.collective_timeout` of the
run's ``--timeout``, so a rank left waiting by a peer that raised fails its collective by then
and the exchange still happens (on its own group, unharmed by the timed-out one). A step that
never returns (a loop, not a collective) is ended by `WATCHDOG_GRACE_S` past ``--timeout``: the
rank prints why on stderr and exits with STEP_FAILED, and its peers' exchange then fails and
they exit alike. A job that failed on any rank is the last one run: later jobs are reported as
not run (the launcher's group cannot be rebuilt from inside it, as the harness's own launch is).
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from crosscheck import exit_codes
from crosscheck.launch.external import TorchLaunch
from crosscheck.verification import torch_verify_outcomes as rank_outcomes
from crosscheck.verification.protocol import StepError, VerifyJob, VerifyOutput
from crosscheck.verification.torch_verify import _user_job, collective_timeout

#: How long past ``--timeout`` a rank whose step never returned is ended by its watchdog: the
#: ranks' start-up (importing torch, joining the group) is inside the run, and on two shared
#: cores it took up to 11 s (torch_verify.STARTUP_GRACE_S allows 15 s for the same).
WATCHDOG_GRACE_S = 15.0


@dataclass
class LaunchedTorchJob:
    """This rank's membership of the launcher's job: joined on first use, left by `close`."""

    launch: TorchLaunch
    #: "cpu" (gloo) or "cuda" (this rank on GPU ``LOCAL_RANK``, NCCL).
    device: str
    timeout_s: float
    _exchange: Any = field(default=None, init=False)
    _watchdog: threading.Timer | None = field(default=None, init=False)

    def _join(self) -> None:
        import torch
        import torch.distributed as dist

        if self._exchange is not None:
            return
        if self.device == "cuda":
            # One rank per GPU of its machine: LOCAL_RANK picks it. The default device puts
            # the harness's model and batch there (as the harness's own ranks do).
            torch.cuda.set_device(self.launch.local_rank)
            torch.set_default_device(f"cuda:{self.launch.local_rank}")
        timeout = datetime.timedelta(seconds=collective_timeout(self.timeout_s))
        dist.init_process_group(
            "nccl" if self.device == "cuda" else "gloo", init_method="env://", timeout=timeout
        )
        # Outcomes are pickled objects: a gloo group of their own, whatever the step's backend,
        # and untouched by a collective of the step that timed out.
        self._exchange = dist.new_group(backend="gloo", timeout=timeout)
        self._watchdog = threading.Timer(self.timeout_s + WATCHDOG_GRACE_S, self._expire)
        self._watchdog.daemon = True
        self._watchdog.start()

    def _expire(self) -> None:
        print(
            f"crosscheck verify: rank {self.launch.rank}: the step did not finish within "
            f"{self.timeout_s:g} s (--timeout) + {WATCHDOG_GRACE_S:g} s; ending this rank",
            file=sys.stderr,
            flush=True,
        )
        os._exit(exit_codes.STEP_FAILED)

    def run(self, step: str, jobs: list[VerifyJob]) -> dict[VerifyJob, VerifyOutput | StepError]:
        """Every job's gradient or StepError, the same on every rank (a `verify` runner)."""
        import torch.distributed as dist

        from torch_impl.harness.user_step import RankOutcome, load_step, run_job

        self._join()
        rank, world_size = self.launch.rank, self.launch.world_size
        wrong = [job for job in jobs if job.world_size != world_size]
        if wrong:  # the CLI lays every job out at the launcher's world size
            raise ValueError(f"{wrong[0].describe()}: the launcher runs {world_size} ranks")
        try:
            loaded = load_step(step, os.getcwd())
        except ImportError as error:  # alike on every rank, before any collective
            return {job: StepError(f"{job.describe()}: {error}") for job in jobs}
        results: dict[VerifyJob, VerifyOutput | StepError] = {}
        collective_s = collective_timeout(self.timeout_s)
        for index, job in enumerate(jobs):
            outcome: RankOutcome = run_job(loaded, _user_job(job), rank, world_size)
            outcomes: list[Any] = [None] * world_size
            dist.all_gather_object(outcomes, outcome, group=self._exchange)
            results[job] = rank_outcomes.judge(job, outcomes, collective_s)
            if any(o.error for o in outcomes):  # every rank sees the same outcomes: all stop
                last = job.describe()
                for rest in jobs[index + 1 :]:
                    results[rest] = StepError(
                        f"{rest.describe()}: not run: the launcher's job failed at {last}"
                    )
                break
        return results

    def agree(self, code: int) -> int:
        """Rank 0's exit status, on every rank (`code` itself when the group was never joined:
        a set-up error found alike by every rank before any collective)."""
        if self._exchange is None:
            return code
        import torch.distributed as dist

        chosen = [code]
        dist.broadcast_object_list(chosen, src=0, group=self._exchange)
        return int(chosen[0])

    def close(self) -> None:
        """Stop the watchdog and leave the process group (when joined)."""
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._exchange is not None:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
            self._exchange = None
