r"""A user's training step on one rank: the torch side of ``crosscheck verify``.

:func:`run_user_steps` is a ``torch_impl.launcher.launch`` target. On every rank of a gloo
group it imports the step named ``MODULE:FUNCTION`` (the caller's working directory first on
``sys.path``) and calls it once per :class:`UserStepJob`, in order, as ``crosscheck.protocol``
states: a fresh float64 ``BilinearLM`` holding the job's params, wrapped in
``DistributedDataParallel`` (or, for a step whose first parameter is ``model_factory``, a
factory of fresh unwrapped models, and the model the step returns), this rank's M microbatches
as dicts of [B, T] tensors, and ``optimizer=torch.optim.SGD(params, lr=1.0)`` when the step
takes one. The gradient read back is ``.grad``, or with an optimizer

.. math::  g = \theta_{\text{before}} - \theta_{\text{after}},

which for SGD with learning rate 1 is exactly the gradient it applied (up to one rounding).

Ranks report through files in ``status_dir``, not the launcher's return value, so a finished
job keeps its result when a later one brings the launch down: ``job{i}-rank{r}.pkl`` (a
:class:`RankOutcome`), ``job{i}-rank{r}.watchdog`` (``faulthandler``'s stack dump when the job
ran past ``timeout_s``; the watchdog then ends the rank, so a hung step costs one job's time)
and ``import-rank{r}.txt`` (why the step could not be imported; no job runs then).

After each job the ranks wait for each other's outcome files. A job that failed on any rank
may have left the ranks' collectives out of step (one rank raised while another waited in an
all-reduce), so then every rank replaces the default process group with a fresh one before the
next job. A peer left waiting in a collective by a rank that raised fails at the group's
collective timeout (destroying, aborting or shutting down a gloo group does not close its
sockets while a DDP reducer still holds it, so it cannot be woken sooner).
"""

from __future__ import annotations

import datetime
import faulthandler
import functools
import gc
import importlib
import inspect
import os
import pickle
import re
import sys
import sysconfig
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from torch_impl.batch import BATCH_KEYS, rank_microbatches
from torch_impl.model import PARAM_NAMES, BilinearLM

#: Error kinds of a RankOutcome, most telling first: the harness reports the first it finds.
RAISED, RESULT, TIMEOUT, PEER = "raised", "result", "timeout", "peer"
_POLL_S = 0.01
_DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


def _take_logged_denominator() -> float | None:
    """What the step passed to ``crosscheck.log_denominator`` since the last call, or None.

    Read from the module the step imported, never imported here: torch_impl does not depend
    on the harness, and a step that logs nothing need not import it either.
    """
    protocol = sys.modules.get("crosscheck.protocol")
    return None if protocol is None else protocol.take_logged_denominator()


@dataclass(frozen=True, kw_only=True, slots=True)
class UserStepJob:
    """One call of the user's step on every rank."""

    #: Names the job in every message (the harness passes VerifyJob.describe()).
    label: str
    #: Global [N, T] arrays: inputs, targets, segment_ids, weights.
    batch: Mapping[str, np.ndarray]
    #: float64 ``embed`` [V, H] and ``unembed`` [H, V].
    params: Mapping[str, np.ndarray]
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
    #: Each job must finish on a rank within this, or the watchdog ends the rank.
    timeout_s: float
    #: The process group's timeout (also for the groups rebuilt after a failed job).
    collective_timeout_s: float
    #: How long past ``timeout_s`` a rank waits for its peers' outcomes: a hung peer is ended
    #: by its own watchdog by then and the launcher notices its exit.
    exchange_grace_s: float = 15.0


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


class StepResultError(ValueError):
    """The step returned, but what it left behind cannot be read as a gradient."""


def outcome_path(status_dir: str, index: int, rank: int) -> str:
    return os.path.join(status_dir, f"job{index}-rank{rank}.pkl")


def watchdog_path(status_dir: str, index: int, rank: int) -> str:
    return os.path.join(status_dir, f"job{index}-rank{rank}.watchdog")


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


@functools.cache
def _internal_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = {os.path.dirname(torch.__file__), os.path.dirname(__file__)}
    dirs |= {paths["stdlib"], paths["platstdlib"]}
    return tuple(os.path.join(os.path.abspath(d), "") for d in dirs)


def _is_user_file(filename: str) -> bool:
    """Whether a frame is the user's code, not torch, the standard library or this harness."""
    if filename.startswith("<"):
        return False
    return not os.path.abspath(filename).startswith(_internal_dirs())


def _frame_line(filename: str, lineno: int | str, name: str) -> str:
    relative = os.path.relpath(filename)  # short under the working directory, else absolute
    return (
        f'  File "{filename if relative.startswith("..") else relative}", line {lineno}, in {name}'
    )


_CPP_LOCATION = re.compile(r"\[[^\]\s]+\.(?:cc|cpp|h):\d+\] ")


def describe_exception(error: BaseException) -> str:
    """``Type: message`` and the traceback frames of the user's code (innermost last)."""
    # torch's C++ errors start with their source location ("[.../pair.cc:553] "): noise here.
    message = _CPP_LOCATION.sub("", str(error))
    lines = [f"{type(error).__name__}: {message}"]
    for frame in traceback.extract_tb(error.__traceback__):
        if _is_user_file(frame.filename):
            lines.append(_frame_line(frame.filename, frame.lineno or "?", frame.name))
            if frame.line:
                lines.append(f"    {frame.line}")
    return "\n".join(lines)


_DUMP_FRAME = re.compile(r'File "(?P<file>.+)", line (?P<line>\d+) in (?P<name>.+)')


def describe_watchdog_dump(dump: str) -> str:
    """The user's frames in a faulthandler dump (innermost first, as faulthandler writes)."""
    frames = [
        _frame_line(m["file"], m["line"], m["name"])
        for m in _DUMP_FRAME.finditer(dump)
        if _is_user_file(m["file"])
    ]
    return "\n".join(frames) if frames else "  (no frame of the user's code on the stack)"


def _error_kind(error: BaseException) -> str:
    """A collective that timed out or lost its peer is a consequence; anything else a cause."""
    text = str(error).lower()
    if "timed out" in text:
        return TIMEOUT
    if any(m in text for m in ("connection reset", "connection closed", "broken pipe")):
        return PEER
    return RAISED


def _full(tensor: torch.Tensor) -> torch.Tensor:
    # A sharded DTensor (FSDP2) is all-gathered: a collective, which every rank reaches alike.
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def read_grads(
    model: nn.Module,
    params: Mapping[str, np.ndarray],
    optimizer: torch.optim.Optimizer | None,
) -> dict[str, np.ndarray]:
    """The gradient the step left in `model`, float64 numpy, or StepResultError saying why not.

    Parameters are matched on their last name component (``module.embed`` under DDP). With
    an optimizer the gradient is ``params - after`` (SGD, learning rate 1).
    """
    named: dict[str, nn.Parameter] = {}
    for name, param in model.named_parameters():
        short = name.rsplit(".", 1)[-1]
        if short in named:
            raise StepResultError(f"the model holds two parameters named {short!r}")
        named[short] = param
    if set(named) != set(PARAM_NAMES):
        raise StepResultError(
            f"the model's parameters are {sorted(named)}, expected {list(PARAM_NAMES)}"
        )
    if optimizer is not None:
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if any(id(p) not in held for p in named.values()):
            raise StepResultError(
                "the optimizer given to the step does not hold the returned model's parameters: "
                "the wrapper replaced them (fully_shard does); such a step must build its own "
                "optimizer after wrapping and take no optimizer argument"
            )
    grads = {}
    for name in PARAM_NAMES:  # a fixed order: gathering a DTensor is a collective
        param, expected = named[name], np.asarray(params[name]).shape
        if tuple(param.shape) != expected:
            raise StepResultError(
                f"parameter {name!r} has shape {tuple(param.shape)}, expected {expected}"
            )
        if optimizer is not None:
            after = _full(param.detach()).to(torch.float64).numpy()
            grads[name] = np.asarray(params[name], dtype=np.float64) - after
        elif param.grad is None:
            raise StepResultError(
                f"parameter {name!r} has no gradient (no backward reached it, or the step set "
                "it to None)"
            )
        else:
            grads[name] = _full(param.grad.detach()).to(torch.float64).numpy().copy()
    unchanged = optimizer is not None and not any(g.any() for g in grads.values())
    # Each rank looks at its own shard of a DTensor: no collective on a path one may skip.
    has_grads = any(p.grad is not None and bool(_local(p.grad).any()) for p in named.values())
    if unchanged and has_grads:
        raise StepResultError(
            "the parameters did not change although they have gradients: the step takes "
            "an optimizer but did not call optimizer.step()"
        )
    return grads


def _microbatches(job: UserStepJob, rank: int, world_size: int) -> list[dict[str, torch.Tensor]]:
    return [
        {key: getattr(batch, key) for key in BATCH_KEYS}
        for batch in rank_microbatches(job.batch, rank, world_size, job.accum_steps)
    ]


def run_job(step: LoadedStep, job: UserStepJob, rank: int, world_size: int) -> RankOutcome:
    """Call the step once on this rank and read its gradient; never raises."""
    try:
        microbatches = _microbatches(job, rank, world_size)
        dtype = _DTYPES[job.dtype]
        first = BilinearLM.from_numpy(job.params, dtype)
        optimizer = torch.optim.SGD(first.parameters(), lr=1.0) if step.takes_optimizer else None
        kwargs = {"optimizer": optimizer} if optimizer is not None else {}
        if step.factory:
            # The first model is the optimizer's; any later call gets a fresh one.
            unused = [first]

            def model_factory() -> BilinearLM:
                return unused.pop() if unused else BilinearLM.from_numpy(job.params, dtype)

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
        grads = read_grads(model, job.params, optimizer)
        return RankOutcome(rank, grads, logged_denominator=_take_logged_denominator())
    except StepResultError as error:
        return RankOutcome(rank, None, f"after the step: {error}", RESULT)
    except Exception as error:  # gathering a sharded gradient failed: a collective
        return RankOutcome(
            rank, None, f"reading the gradient failed: {error!r}", _error_kind(error)
        )


@contextmanager
def _watchdog(path: str, timeout_s: float) -> Iterator[None]:
    """End this process after `timeout_s`, dumping every thread's stack to `path` first.

    faulthandler's timer is a C thread that needs no GIL, so it fires in a ``time.sleep``, a
    busy Python loop or a blocked native call alike; ending the rank lets the launcher see
    it exit and stop the launch, where an exception could not interrupt the step.
    """
    with open(path, "w") as dump:
        faulthandler.dump_traceback_later(timeout_s, exit=True, file=dump)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()


def _new_group(config: UserStepConfig, index: int, rank: int, world_size: int) -> None:
    """Replace the default group: a failed job may have left collectives pending in the old."""
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()  # the failed job's model and frames, before the new group's sockets open
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(config.status_dir, f'rendezvous-{index}')}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=config.collective_timeout_s),
    )


def _write_atomic(path: str, value: object) -> None:
    with open(path + ".tmp", "wb") as f:
        pickle.dump(value, f, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(path + ".tmp", path)


def _wait_for_peers(
    config: UserStepConfig, job: UserStepJob, index: int, world_size: int, deadline: float
) -> list[RankOutcome]:
    paths = [outcome_path(config.status_dir, index, r) for r in range(world_size)]
    while True:
        missing = [r for r, p in enumerate(paths) if not os.path.exists(p)]
        if not missing:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{job.label}: rank(s) {', '.join(map(str, missing))} reported nothing within "
                f"{config.timeout_s + config.exchange_grace_s:g} s"
            )
        time.sleep(_POLL_S)
    outcomes = []
    for path in paths:
        with open(path, "rb") as f:
            outcomes.append(pickle.load(f))
    return outcomes


def run_user_steps(
    rank: int, world_size: int, config: UserStepConfig, jobs: list[UserStepJob]
) -> int:
    """Run every job on this rank (a launcher target); outcomes go to ``config.status_dir``.

    Returns the number of jobs run: 0 when the step could not be imported.
    """
    if not dist.is_initialized():
        raise RuntimeError(f"rank {rank}: run_user_steps needs an initialized process group")
    try:
        step = load_step(config.step, config.cwd)
    except ImportError as error:  # the same on every rank, before any collective
        with open(import_error_path(config.status_dir, rank), "w") as f:
            f.write(str(error))
        return 0
    # DDP's first construction imports and initializes a lot (seconds on a busy machine):
    # paid here, every rank alike, so that a job's time limit measures the step only.
    DistributedDataParallel(nn.Linear(1, 1))
    for index, job in enumerate(jobs):
        started = time.monotonic()
        with _watchdog(watchdog_path(config.status_dir, index, rank), config.timeout_s):
            outcome = run_job(step, job, rank, world_size)
        _write_atomic(outcome_path(config.status_dir, index, rank), outcome)
        deadline = started + config.timeout_s + config.exchange_grace_s
        outcomes = _wait_for_peers(config, job, index, world_size, deadline)
        if any(o.error for o in outcomes):
            # Every rank reads the same files, so all of them rebuild, in step.
            _new_group(config, index, rank, world_size)
    return len(jobs)
