r"""A user's training step on one rank: the torch side of ``crosscheck verify``.

:func:`run_user_steps` is a ``torch_impl.harness.launcher.launch`` target. On every rank of a gloo
group it imports the step named ``MODULE:FUNCTION`` (the caller's working directory first on
``sys.path``) and calls it once per :class:`UserStepJob`, in order, as
``crosscheck.verification.protocol`` states: a fresh float64 ``BilinearLM`` holding the job's
params, wrapped in ``DistributedDataParallel`` (or, for a step whose first parameter is
``model_factory``, a factory of fresh unwrapped models, and the model the step returns), this rank's
M microbatches as dicts of [B, T] tensors, and ``optimizer=torch.optim.SGD(params, lr=1.0)`` when
the step takes one. The gradient read back is ``.grad``, or with an optimizer

.. math::  g = \theta_{\text{before}} - \theta_{\text{after}},

which for SGD with learning rate 1 is exactly the gradient it applied (up to one rounding;
``torch_impl.harness.step_gradient``).

Ranks report through files in ``status_dir``, not the launcher's return value, so a finished
job keeps its result when a later one brings the launch down: ``job{i}-rank{r}.pkl`` (a
:class:`RankOutcome`), ``job{i}-rank{r}.failed`` (written after it when the outcome is an
error), ``job{i}-rank{r}.watchdog`` (a header, then ``faulthandler``'s stack dump when the
launch's deadline passed in that job; the watchdog then ends the rank), ``import-rank{r}.txt``
(why the step could not be imported; no job runs then) and ``ready.txt`` (when the ranks were
ready to run the first job: the harness counts the step's time from there).

Time and failures (`torch_impl.harness.step_watch`): every job must end by a deadline the ranks
agree on, or a watchdog dumps the rank's stack and ends it; a rank still in the step after a peer
failed the job is stopped by a watcher thread, so a failed job ends the launch within
``PEER_GRACE_S``, not at the collective timeout. After a failed job every rank returns; the
harness starts a fresh process group for the jobs that remain.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from torch_impl.batch import BATCH_KEYS, OPTIONAL_KEYS, rank_microbatches
from torch_impl.harness.jobs import BatchJob
from torch_impl.harness.model_reference import ModelSetupError, fresh_model, load_callable
from torch_impl.harness.step_gradient import StepResultError, read_grads

# Re-exported: the harness (crosscheck.verification.torch_verify) reads the status files by these.
from torch_impl.harness.step_watch import PEER_GRACE_S as PEER_GRACE_S
from torch_impl.harness.step_watch import (
    PeerWatcher,
    agree_deadline,
    frame_line,
    is_user_file,
    wait_for_peers,
    watchdog,
)
from torch_impl.harness.step_watch import WatchdogDump as WatchdogDump
from torch_impl.harness.step_watch import describe_watchdog_dump as describe_watchdog_dump
from torch_impl.harness.step_watch import failed_path as failed_path
from torch_impl.harness.step_watch import outcome_path as outcome_path
from torch_impl.harness.step_watch import read_watchdog as read_watchdog
from torch_impl.harness.step_watch import ready_path as ready_path
from torch_impl.harness.step_watch import watchdog_path as watchdog_path
from torch_impl.model import BilinearLM

#: Error kinds of a RankOutcome, most telling first: the harness reports the first it finds.
#: STOPPED: the watcher ended a rank that was still in the step after a peer failed.
RAISED, RESULT, TIMEOUT, PEER, STOPPED = "raised", "result", "timeout", "peer", "stopped"
_DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


def _take_logged_denominator() -> float | None:
    """What the step passed to ``crosscheck.log_denominator`` since the last call, or None.

    Read from the module the step imported, never imported here: torch_impl does not depend
    on the harness, and a step that logs nothing need not import it either.
    """
    protocol = sys.modules.get("crosscheck.verification.protocol")
    return None if protocol is None else protocol.take_logged_denominator()


@dataclass(frozen=True, kw_only=True, slots=True)
class UserStepJob(BatchJob):
    """One call of the user's step on every rank (the harness labels it VerifyJob.describe())."""

    accum_steps: int
    #: The dtype of the model handed to the step ("float64", "float32" or "bfloat16").
    dtype: str = "float64"


@dataclass(frozen=True, kw_only=True, slots=True)
class UserStepConfig:
    """What every rank of one launch shares."""

    #: ``MODULE:FUNCTION``.
    step: str
    #: The caller's working directory: put first on ``sys.path`` to import the step.
    cwd: str
    #: Where outcomes, watchdog dumps and rendezvous files go (the harness removes it).
    status_dir: str
    #: ``time.monotonic()`` by which every job must be over, whatever the budget (CLOCK_MONOTONIC
    #: is one clock for every process of the machine).
    hard_deadline: float
    #: Seconds of step time this launch may use, counted from when the ranks are ready.
    budget_s: float
    #: The process group's timeout.
    collective_timeout_s: float
    #: ``MODULE:FACTORY`` of the user's own model (``verify --model``), or "": the analytic
    #: model. The factory returns a fresh unwrapped nn.Module with the same weights each call.
    model: str = ""


@dataclass(frozen=True, slots=True)
class RankOutcome:
    """One rank's result of one job: the gradient, or what went wrong and its kind."""

    rank: int
    grads: dict[str, np.ndarray] | None
    error: str = ""
    kind: str = ""
    #: What the step passed to ``crosscheck.log_denominator`` on this rank (its last value).
    logged_denominator: float | None = None


@dataclass(frozen=True, slots=True)
class LoadedStep:
    """The imported step and which variant of the protocol its signature asks for."""

    fn: Callable[..., Any]
    factory: bool
    takes_optimizer: bool


def import_error_path(status_dir: str, rank: int) -> str:
    return os.path.join(status_dir, f"import-rank{rank}.txt")


def load_step(spec: str, cwd: str) -> LoadedStep:
    """Import ``MODULE:FUNCTION`` with `cwd` first on sys.path; ImportError says why not."""
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    module_name, _, function_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # ImportError, or whatever the module's body raised
        raise ImportError(f"cannot import the step {spec!r}: {describe_exception(error)}") from None
    fn = getattr(module, function_name, None)
    if not callable(fn):
        raise ImportError(
            f"cannot import the step {spec!r}: {module_name} has no function {function_name!r}"
        )
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError) as error:
        raise ImportError(f"cannot read the signature of the step {spec!r}: {error}") from None
    names = list(signature.parameters)
    factory = bool(names) and names[0] == "model_factory"
    takes_optimizer = "optimizer" in signature.parameters
    try:  # a signature that cannot take the protocol's arguments fails every job alike
        signature.bind(None, None, **({"optimizer": None} if takes_optimizer else {}))
    except TypeError as error:
        first = "model_factory" if factory else "model"
        raise ImportError(
            f"the step {spec!r} must accept ({first}, microbatches[, optimizer]): {error}"
        ) from None
    return LoadedStep(fn, factory, takes_optimizer)


_CPP_LOCATION = re.compile(r"\[[^\]\s]+\.(?:cc|cpp|h):\d+\] ")


def describe_exception(error: BaseException) -> str:
    """``Type: message`` and the traceback frames of the user's code (innermost last)."""
    # torch's C++ errors start with their source location ("[.../pair.cc:553] "): noise here.
    message = _CPP_LOCATION.sub("", str(error))
    lines = [f"{type(error).__name__}: {message}"]
    for frame in traceback.extract_tb(error.__traceback__):
        if is_user_file(frame.filename):
            lines.append(frame_line(frame.filename, frame.lineno or "?", frame.name))
            if frame.line:
                lines.append(f"    {frame.line}")
    return "\n".join(lines)


def _error_kind(error: BaseException) -> str:
    """A collective that timed out or lost its peer is a consequence; anything else a cause."""
    text = str(error).lower()
    if "timed out" in text:
        return TIMEOUT
    if any(m in text for m in ("connection reset", "connection closed", "broken pipe")):
        return PEER
    return RAISED


def _microbatches(job: UserStepJob, rank: int, world_size: int) -> list[dict[str, torch.Tensor]]:
    # The four v1 arrays, and contract v2's fields where the fixture gives them.
    return [
        {
            key: getattr(batch, key)
            for key in (*BATCH_KEYS, *OPTIONAL_KEYS)
            if getattr(batch, key) is not None
        }
        for batch in rank_microbatches(job.batch, rank, world_size, job.accum_steps)
    ]


def run_job(
    step: LoadedStep,
    job: UserStepJob,
    rank: int,
    world_size: int,
    user_model: Callable[[torch.dtype], nn.Module] | None = None,
) -> RankOutcome:
    """Call the step once on this rank and read its gradient; never raises. `user_model`
    builds the user's own model in a dtype (None: the analytic model)."""
    try:
        microbatches = _microbatches(job, rank, world_size)
        dtype = _DTYPES[job.dtype]

        def new_model() -> nn.Module:
            if user_model is not None:
                return user_model(dtype)
            return BilinearLM.from_numpy(job.params, dtype)

        first = new_model()
        params = job.params
        if user_model is not None:  # the initial weights, by name, for reading the update
            # A copy: a float64 parameter's numpy view would follow the optimizer's update.
            params = {
                n: p.detach().to(torch.float64).numpy().copy()
                for n, p in first.named_parameters()
                if p.requires_grad  # frozen parameters are no part of the gradient
            }
        optimizer = torch.optim.SGD(first.parameters(), lr=1.0) if step.takes_optimizer else None
        kwargs = {"optimizer": optimizer} if optimizer is not None else {}
        if step.factory:
            # The first model is the optimizer's; any later call gets a fresh one.
            unused = [first]

            def model_factory() -> nn.Module:
                return unused.pop() if unused else new_model()

            model: Any = model_factory
        else:
            model = DistributedDataParallel(first)
    except Exception as error:
        return RankOutcome(rank, None, f"preparing the step failed: {error!r}", _error_kind(error))
    _take_logged_denominator()  # forget what an earlier job logged
    try:
        returned = step.fn(model, microbatches, **kwargs)
    except (Exception, SystemExit) as error:
        return RankOutcome(
            rank, None, f"the step raised {describe_exception(error)}", _error_kind(error)
        )
    if step.factory:
        if not isinstance(returned, nn.Module):
            return RankOutcome(
                rank,
                None,
                f"a model_factory step must return the (wrapped) model it trained, "
                f"got {type(returned).__name__}",
                RESULT,
            )
        model = returned
    try:
        grads = read_grads(model, params, optimizer, full_names=user_model is not None)
        return RankOutcome(rank, grads, logged_denominator=_take_logged_denominator())
    except StepResultError as error:
        return RankOutcome(rank, None, f"after the step: {error}", RESULT)
    except Exception as error:  # gathering a sharded gradient failed: a collective
        return RankOutcome(
            rank, None, f"reading the gradient failed: {error!r}", _error_kind(error)
        )


def _user_model(config: UserStepConfig) -> Callable[[torch.dtype], nn.Module] | None:
    """A builder of the user's model in a dtype (None: the analytic model)."""
    if not config.model:
        return None
    factory = load_callable(config.model, config.cwd, "model factory")
    return lambda dtype: fresh_model(factory, config.model, dtype)


def run_user_steps(
    rank: int, world_size: int, config: UserStepConfig, jobs: list[UserStepJob]
) -> int:
    """Run the jobs in order on this rank (a launcher target); outcomes go to ``status_dir``.

    Returns how many jobs it went through: all of them; fewer when one failed (on any rank:
    that job is the last one run, the harness relaunches for the rest) or the deadline came
    before the next could start; 0 when the step could not be imported.
    """
    if not dist.is_initialized():
        raise RuntimeError(f"rank {rank}: run_user_steps needs an initialized process group")
    try:
        step = load_step(config.step, config.cwd)
        user_model = _user_model(config)
    except (ImportError, ModelSetupError) as error:  # alike on every rank, before a collective
        with open(import_error_path(config.status_dir, rank), "w") as f:
            f.write(str(error))
        return 0
    # DDP's first construction imports and initializes a lot (seconds on a busy machine):
    # paid here, every rank alike, before the step's time starts.
    DistributedDataParallel(nn.Linear(1, 1))
    deadline = agree_deadline(config.status_dir, rank, config.hard_deadline, config.budget_s)
    watcher = PeerWatcher(
        config.status_dir,
        rank,
        world_size,
        lambda error: RankOutcome(rank, None, error, STOPPED),
    )
    for index, job in enumerate(jobs):
        if time.monotonic() >= deadline:
            return index  # no time left to start it
        with watchdog(watchdog_path(config.status_dir, index, rank), deadline):
            watcher.begin(index)
            watcher.publish(index, run_job(step, job, rank, world_size, user_model))
            outcomes = wait_for_peers(config.status_dir, job.label, index, world_size, deadline)
        if any(o.error for o in outcomes):
            return index + 1  # every rank reads the same files, so all of them stop here
    return len(jobs)
