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

Time and failures (the second half of this module): every job must end by a deadline the ranks
agree on, or a watchdog dumps the rank's stack and ends it; a rank still in the step after a peer
failed the job is stopped by a watcher thread, so a failed job ends the launch within
``PEER_GRACE_S``, not at the collective timeout. After a failed job every rank returns; the
harness starts a fresh process group for the jobs that remain.
"""

from __future__ import annotations

import faulthandler
import functools
import importlib
import inspect
import os
import pickle
import re
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from crosscheck.launch import worker_processes
from crosscheck.launch.worker_processes import write_atomically
from torch_impl.batch import (
    BATCH_KEYS,
    OPTIONAL_KEYS,
    context_microbatches,
    context_positions,
    rank_microbatches,
)
from torch_impl.fsdp import context_parallel_mesh
from torch_impl.harness.jobs import BatchJob
from torch_impl.harness.model_reference import ModelSetupError, fresh_model, load_callable
from torch_impl.harness.rank_worker import finish_rank, write_pickle
from torch_impl.harness.step_gradient import StepResultError, gradient_dtypes, read_grads
from torch_impl.model import BilinearLM
from torch_impl.objective import ObjectiveLM

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
    #: A multi-term objective's step (``verify --objective``): the model is the multi-term
    #: family's ``torch_impl.objective.ObjectiveLM`` holding `params` (the ones the terms
    #: read; a frozen reference among them gets no gradient), and the batch may hold
    #: ``mtp_targets``, handed on in every microbatch.
    objective: bool = False
    #: Context-parallel ranks C splitting every row's positions in `context_order`
    #: (``torch_impl.batch.context_positions``): the launch's P processes are R = P / C data
    #: ranks of C context ranks each, process r C + c at [r, c].
    context_size: int = 1
    context_order: str = "contiguous"


@dataclass(frozen=True, slots=True)
class ContextGroup:
    """What a context-parallel step is handed as ``context=`` on process r C + c
    (crosscheck.verification.protocol, "Context parallel")."""

    #: C: the context ranks that split each row.
    size: int
    #: c: which of them this process is.
    rank: int
    #: "contiguous" or "zigzag": how a row's positions are dealt to the context ranks.
    order: str
    #: [T/C] int64: the row positions this process's shard holds, increasing (what a model
    #: with position embeddings or a causal mask reads).
    positions: torch.Tensor
    #: The 2-D ("dp", "cp") DeviceMesh of R x C processes (``torch_impl.fsdp.
    #: context_parallel_mesh``): ``mesh["cp"]`` is `group`, ``mesh["dp"]`` `data_group`.
    mesh: Any
    #: The C processes r C + c' holding this process's rows (c' = 0 .. C - 1).
    group: dist.ProcessGroup
    #: The R processes r' C + c at this context rank (r' = 0 .. R - 1).
    data_group: dist.ProcessGroup


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
    #: The dtypes of the gradient the step left (``step_gradient.gradient_dtypes``).
    gradient_dtypes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class LoadedStep:
    """The imported step and which variant of the protocol its signature asks for."""

    fn: Callable[..., Any]
    factory: bool
    takes_optimizer: bool
    #: The step declares ``context``: it is context-parallel, handed a `ContextGroup`.
    takes_context: bool = False


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
    keywords = {name: None for name in ("optimizer", "context") if _declares(signature, name)}
    try:  # a signature that cannot take the protocol's arguments fails every job alike
        signature.bind(None, None, **keywords)
    except TypeError as error:
        first = "model_factory" if factory else "model"
        raise ImportError(
            f"the step {spec!r} must accept ({first}, microbatches[, optimizer][, context]): "
            f"{error}"
        ) from None
    return LoadedStep(fn, factory, "optimizer" in keywords, "context" in keywords)


def _declares(signature: inspect.Signature, name: str) -> bool:
    """Whether the step asks for `name` by a parameter that takes a keyword (a bare
    ``**kwargs`` does not ask; the rule of ``crosscheck verify``'s up-front check)."""
    parameter = signature.parameters.get(name)
    return parameter is not None and parameter.kind not in (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.VAR_POSITIONAL,
        inspect.Parameter.VAR_KEYWORD,
    )


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
    """Process `rank`'s M microbatches as the step gets them: its rows, and under context
    parallel (`world_size` processes of C context ranks each) its shard of their positions."""
    if job.context_size > 1:
        R, C = world_size // job.context_size, job.context_size
        batches = context_microbatches(job.batch, rank, R, C, job.accum_steps, job.context_order)
    else:
        batches = rank_microbatches(job.batch, rank, world_size, job.accum_steps)
    # The four v1 arrays, and contract v2's fields where the fixture gives them.
    out = [
        {
            key: getattr(batch, key)
            for key in (*BATCH_KEYS, *OPTIONAL_KEYS)
            if getattr(batch, key) is not None
        }
        for batch in batches
    ]
    shifted = job.batch.get("mtp_targets")
    if shifted is not None:  # the same rows as every other array: B of them per microbatch
        rows = len(shifted) // (world_size * job.accum_steps)
        for m, microbatch in enumerate(out):
            first = (rank * job.accum_steps + m) * rows
            part = shifted[first : first + rows]
            microbatch["mtp_targets"] = torch.tensor(part, dtype=torch.long)
    return out


@functools.cache
def _context_mesh(data_parallel: int, context_parallel: int, device_type: str) -> Any:
    """The ("dp", "cp") mesh, built once per process and shape (every process builds it at
    the same job: the jobs run in the same order everywhere, as DeviceMesh's groups need)."""
    return context_parallel_mesh(data_parallel, context_parallel, device_type)[0]


def context_group(job: UserStepJob, process: int, processes: int) -> ContextGroup:
    """Process `process`'s `ContextGroup` for `job` (of `processes` = R x C)."""
    C = job.context_size
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = _context_mesh(processes // C, C, device_type)
    seq_len = int(np.shape(job.batch["targets"])[1])
    positions = context_positions(seq_len, C, job.context_order)[process % C]
    return ContextGroup(
        size=C,
        rank=process % C,
        order=job.context_order,
        positions=torch.tensor(positions, dtype=torch.long),
        mesh=mesh,
        group=mesh["cp"].get_group(),
        data_group=mesh["dp"].get_group(),
    )


def run_job(
    step: LoadedStep,
    job: UserStepJob,
    rank: int,
    world_size: int,
    user_model: Callable[[torch.dtype], nn.Module] | None = None,
) -> RankOutcome:
    """Call the step once on this rank and read its gradient; never raises. `user_model`
    builds the user's own model in a dtype (None: the analytic model). `world_size` is the
    launch's processes: R x C under context parallel."""
    if job.context_size > 1 and not step.takes_context:
        return RankOutcome(
            rank,
            None,
            f"a context-parallel layout (C={job.context_size}) needs a step that declares a "
            "`context` parameter, to know its context-parallel group (docs/verify.md#context-"
            "parallel)",
            RAISED,
        )
    try:
        microbatches = _microbatches(job, rank, world_size)
        dtype = _DTYPES[job.dtype]

        def new_model() -> nn.Module:
            if user_model is not None:
                return user_model(dtype)
            if job.objective:
                return ObjectiveLM(job.params, dtype)
            return BilinearLM.from_numpy(job.params, dtype)

        first = new_model()
        params = job.params
        named = user_model is not None or job.objective  # read by name, frozen ones left out
        if named:  # the initial weights, by name, for reading the update
            # A copy: a float64 parameter's numpy view would follow the optimizer's update.
            params = {
                n: p.detach().to(torch.float64).numpy().copy()
                for n, p in first.named_parameters()
                if p.requires_grad  # frozen parameters are no part of the gradient
            }
        optimizer = torch.optim.SGD(first.parameters(), lr=1.0) if step.takes_optimizer else None
        kwargs: dict[str, Any] = {"optimizer": optimizer} if optimizer is not None else {}
        if step.takes_context:
            kwargs["context"] = context_group(job, rank, world_size)
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
        grads = read_grads(model, params, optimizer, full_names=named)
        return RankOutcome(
            rank,
            grads,
            logged_denominator=_take_logged_denominator(),
            gradient_dtypes=gradient_dtypes(model, optimizer),
        )
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


# -- time and peers: the deadline, the watchdog, the peer watcher ------------------------------
#
# What ends a rank that must not go on: the deadline the ranks agree on, the watchdog that
# dumps a rank's stack and ends it when the deadline passes in a job, and the watcher that ends
# a rank still in the step after a peer failed; with the files through which the ranks and the
# harness learn of it, and the reading of a stack as the user's own frames.
#
# Time: the ranks agree on one deadline, ``min(hard_deadline, ready + budget_s)``
# (`agree_deadline`), and every job, with the wait for the peers' outcomes after it
# (`wait_for_peers`), must end by then, or the watchdog (`watchdog`) dumps the rank's stack to
# ``job{i}-rank{r}.watchdog`` and ends it.
#
# A failed job ends the launch: one rank may have raised while another waits in a collective it
# will never complete, and a gloo collective cannot be woken before the group's timeout (not
# even by destroying the group while a DDP reducer holds it). So each rank runs a watcher
# thread (`PeerWatcher`): when a peer's outcome for the current job is an error and this rank has
# written none ``PEER_GRACE_S`` later, the watcher writes this rank's outcome ("stopped", with
# where the step was) and ends the rank through ``launcher.finish_rank``.

#: How long after a peer's failure a rank still in the job may take to write its own outcome
#: (a step that fails alike on every rank then reports every rank's own error) before the
#: watcher stops it.
PEER_GRACE_S = 0.5
#: After the deadline, how long a rank waits for its peers' outcomes before it gives up (its
#: watchdog ends it at the deadline; this only bounds a wait the watchdog did not cover).
_PEER_WAIT_GRACE_S = 5.0
_POLL_S = 0.01
_WATCH_POLL_S = 0.05
_WATCHDOG_HEADER = "# gradweight watchdog:"


def outcome_path(status_dir: str, index: int, rank: int) -> str:
    return os.path.join(status_dir, f"job{index}-rank{rank}.pkl")


def watchdog_path(status_dir: str, index: int, rank: int) -> str:
    return os.path.join(status_dir, f"job{index}-rank{rank}.watchdog")


def failed_path(status_dir: str, index: int, rank: int) -> str:
    return os.path.join(status_dir, f"job{index}-rank{rank}.failed")


def ready_path(status_dir: str) -> str:
    return os.path.join(status_dir, "ready.txt")


@dataclass(frozen=True, slots=True)
class WatchdogDump:
    """What the watchdog left when the deadline passed in a job: when, and where the step was."""

    #: ``time.monotonic()`` when the job started on this rank, and the deadline it had.
    started: float
    deadline: float
    #: The user's frames (innermost last), or a line saying there was none.
    frames: str


def read_watchdog(status_dir: str, index: int, rank: int) -> WatchdogDump | None:
    """The watchdog's dump of job `index` on `rank`, or None when it did not fire there."""
    try:
        with open(watchdog_path(status_dir, index, rank)) as f:
            text = f.read()
    except OSError:
        return None
    header, _, dump = text.partition("\n")
    # faulthandler's dump_traceback_later starts with "Timeout (h:mm:ss)!".
    if not header.startswith(_WATCHDOG_HEADER) or not dump.startswith("Timeout ("):
        return None
    times = dict(field.split("=", 1) for field in header.removeprefix(_WATCHDOG_HEADER).split())
    return WatchdogDump(
        float(times["started"]), float(times["deadline"]), describe_watchdog_dump(dump)
    )


@functools.cache
def _internal_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    # torch_impl as a whole: the reference's frames (update, schemes) are not the user's either.
    package = os.path.dirname(os.path.dirname(__file__))
    # And the process layer that started the rank (the zygote's frames sit below every rank's).
    process_layer = os.path.dirname(worker_processes.__file__)
    dirs = {os.path.dirname(torch.__file__), package, process_layer}
    dirs |= {paths["stdlib"], paths["platstdlib"]}
    return tuple(os.path.join(os.path.abspath(d), "") for d in dirs)


def is_user_file(filename: str) -> bool:
    """Whether a frame is the user's code, not torch, the standard library or this harness."""
    if filename.startswith("<"):
        return False
    return not os.path.abspath(filename).startswith(_internal_dirs())


def frame_line(filename: str, lineno: int | str, name: str) -> str:
    relative = os.path.relpath(filename)  # short under the working directory, else absolute
    return (
        f'  File "{filename if relative.startswith("..") else relative}", line {lineno}, in {name}'
    )


_DUMP_FRAME = re.compile(r'File "(?P<file>.+)", line (?P<line>\d+) in (?P<name>.+)')


_DUMP_THREAD = re.compile(r"^(?:Current thread|Thread) 0x", re.MULTILINE)


def describe_watchdog_dump(dump: str) -> str:
    """The user's frames in a faulthandler dump, thread by thread, innermost last.

    faulthandler writes each thread's frames innermost first; they are turned around to read
    like every other traceback here.
    """
    frames = []
    for thread in _DUMP_THREAD.split(dump):
        frames += reversed(
            [
                frame_line(m["file"], m["line"], m["name"])
                for m in _DUMP_FRAME.finditer(thread)
                if is_user_file(m["file"])
            ]
        )
    return "\n".join(frames) if frames else "  (no frame of the user's code on the stack)"


@contextmanager
def watchdog(path: str, deadline: float) -> Iterator[None]:
    """End this process at `deadline` (monotonic), dumping every thread's stack to `path` first.

    faulthandler's timer is a C thread that needs no GIL, so it fires in a ``time.sleep``, a
    busy Python loop or a blocked native call alike; ending the rank lets the launcher see
    it exit and stop the launch, where an exception could not interrupt the step. The file
    starts with a header line (when the job started, and the deadline) for the harness.
    """
    with open(path, "w") as dump:
        started = time.monotonic()
        dump.write(f"{_WATCHDOG_HEADER} started={started!r} deadline={deadline!r}\n")
        dump.flush()  # before faulthandler writes to the same descriptor
        faulthandler.dump_traceback_later(max(deadline - started, 1e-3), exit=True, file=dump)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()


def main_thread_frames() -> str:
    """Where the main thread is, as the user's frames (innermost last), or a line saying so."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    lines = []
    for summary in traceback.extract_stack(frame) if frame is not None else []:
        if is_user_file(summary.filename):
            lines.append(frame_line(summary.filename, summary.lineno or "?", summary.name))
            if summary.line:
                lines.append(f"    {summary.line}")
    return "\n".join(lines) if lines else "  (no frame of the user's code on the stack)"


def stopped_after(failed: list[tuple[int, str]]) -> str:
    """Whose failure a watcher names when it stops its rank, from the failed peers' (rank,
    error kind): the first peer whose own error it was. A peer its watcher stopped only passed
    the failure on, and a third rank's watcher may read that peer's marker first."""
    causes = [rank for rank, kind in failed if kind != STOPPED]
    return f"rank {causes[0]} failed" if causes else f"rank {failed[0][0]} was stopped"


class PeerWatcher:
    """Ends this rank when a peer failed the job this rank is still running (see module doc).

    `begin` marks a job as running here, `publish` writes this rank's outcome (and ends the
    watch for it); the watcher thread, under the same lock, writes a STOPPED outcome instead
    when a peer's ``.failed`` marker for that job has been there `PEER_GRACE_S`, and ends the
    process. One daemon thread per rank, polling every 50 ms while a job runs.
    """

    def __init__(
        self,
        status_dir: str,
        rank: int,
        world_size: int,
        stopped: Callable[[str], RankOutcome],
    ) -> None:
        self.status_dir = status_dir
        self.rank = rank
        #: This rank's STOPPED outcome, from the message saying why and where.
        self.stopped = stopped
        self.peers = [r for r in range(world_size) if r != rank]
        self.lock = threading.Lock()
        self.index: int | None = None
        if self.peers:
            threading.Thread(
                target=self._watch, name="gradweight-peer-watcher", daemon=True
            ).start()

    def begin(self, index: int) -> None:
        with self.lock:
            self.index = index

    def publish(self, index: int, outcome: RankOutcome) -> None:
        with self.lock:
            self._write(index, outcome)
            self.index = None

    def _write(self, index: int, outcome: RankOutcome) -> None:
        write_pickle(outcome_path(self.status_dir, index, self.rank), outcome)
        if outcome.error:  # after the outcome: a peer that sees the marker can read it
            with open(failed_path(self.status_dir, index, self.rank), "w") as f:
                f.write(outcome.kind)

    def _failed_peers(self, index: int) -> list[tuple[int, str]]:
        """(rank, error kind) of every peer whose outcome of job `index` is an error; the kind
        is "" while its marker is being written."""
        failed = []
        for rank in self.peers:
            try:
                with open(failed_path(self.status_dir, index, rank)) as f:
                    failed.append((rank, f.read()))
            except FileNotFoundError:
                continue
        return failed

    def _watch(self) -> None:
        first_seen: tuple[int, float] | None = None  # (job, when a peer's failure was seen)
        while True:
            time.sleep(_WATCH_POLL_S)
            index = self.index
            failed = [] if index is None else self._failed_peers(index)
            if index is None or not failed:
                first_seen = None
                continue
            if first_seen is None or first_seen[0] != index:
                first_seen = (index, time.monotonic())
            if time.monotonic() - first_seen[1] < PEER_GRACE_S:
                continue
            with self.lock:
                if self.index != index:  # this rank's own outcome landed meanwhile
                    continue
                error = (
                    f"was stopped while still in the step, after {stopped_after(failed)}; "
                    f"it was at:\n{main_thread_frames()}"
                )
                self._write(index, self.stopped(error))
                # Ends the process holding the lock; the launch counts this rank as done.
                finish_rank(index + 1)


def wait_for_peers(
    status_dir: str, label: str, index: int, world_size: int, deadline: float
) -> list[RankOutcome]:
    """Every rank's outcome of job `index` (`label` names it), once all are written."""
    paths = [outcome_path(status_dir, index, r) for r in range(world_size)]
    while True:
        missing = [r for r, p in enumerate(paths) if not os.path.exists(p)]
        if not missing:
            break
        if time.monotonic() > deadline + _PEER_WAIT_GRACE_S:
            raise TimeoutError(
                f"{label}: rank(s) {', '.join(map(str, missing))} reported nothing by the deadline"
            )
        time.sleep(_POLL_S)
    outcomes = []
    for path in paths:
        with open(path, "rb") as f:
            outcomes.append(pickle.load(f))
    return outcomes


def agree_deadline(status_dir: str, rank: int, hard_deadline: float, budget_s: float) -> float:
    """One deadline on every rank: the latest rank's ready time plus the budget, capped.

    Agreed through a MAX all-reduce so that every rank's watchdog fires at the same moment:
    a rank whose watchdog fired first would bring the launch down before the others dumped
    where they were.
    """
    ready = torch.tensor([time.monotonic()], dtype=torch.float64)
    dist.all_reduce(ready, op=dist.ReduceOp.MAX)
    start = float(ready.item())
    if rank == 0:
        write_atomically(ready_path(status_dir), repr(start).encode())
    return min(hard_deadline, start + budget_s)
