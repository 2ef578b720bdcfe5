"""Checkpoint resume on JAX (pmap): stop, save with orbax, restore in a fresh process, continue.

Two worker processes serve every case, one after the other, each with eight fake CPU devices
(x64 when the cases are float64): phase 1 runs every case to its stop and saves a checkpoint,
and also runs the uninterrupted baselines with the reference pmap step
(`jax_impl.make_pmap_sweep`, no stop); phase 2 restores every checkpoint at the case's resume
layout and continues to `case.num_updates`. Different dtypes need different processes (x64 is
global), so a run mixing float32 and float64 cases starts two processes per phase. Every wait
is bounded by `crosscheck.launch.worker_processes.run_workers`.

Run as a module (``python -m crosscheck.run.jax_resume PHASE JOB OUT``) it is the worker.
"""

from __future__ import annotations

import functools
import pickle
import sys
import tempfile
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from crosscheck.contract.cases import STRATEGIES, ResumeCase, ResumeOutput, TrainSettings
from crosscheck.contract.fixture import BATCH_KEYS
from crosscheck.fixtures.builtin import builtin_fixture
from crosscheck.launch.worker_processes import run_workers
from crosscheck.launch.workers import (
    jax_worker_env,
    launchable,
    serve_job,
    worker_zygote,
)
from crosscheck.run.jax_worker import id_space

OnResumeDone = Callable[[ResumeCase, ResumeOutput | BaseException], None]

SUPPORTED_IMPLS = ("jax-pmap",)
INTENDED = ("token_mean", "sequence_mean", "row_mean", "weighted_mean", "constant", "sum")
PHASE_TIMEOUT_S = 300.0
#: precount reduces with pmean (s = R, as DDP does), postnorm with psum.
COLLECTIVE = {"precount": "pmean", "postnorm": "psum"}


class JaxResumeError(RuntimeError):
    """A resume case the JAX worker could not run; the message carries its traceback."""


def resume_problem(case: ResumeCase) -> str:
    """Why the JAX resume runner cannot run `case`, or ''."""
    if case.impl not in SUPPORTED_IMPLS:
        return (
            f"{case.describe()}: JAX checkpoint resume runs under pmap only (impl "
            f"{', '.join(SUPPORTED_IMPLS)}), not {case.impl!r}"
        )
    if case.scheme not in INTENDED or case.strategy not in STRATEGIES:
        return f"{case.describe()}: resume runs intended schemes with precount or postnorm"
    if case.dtype not in ("float64", "float32", "bfloat16"):
        return f"{case.describe()}: dtype {case.dtype!r} is not float64, float32 or bfloat16"
    if max(case.world_size, case.resume_world_size) > 8:
        return f"{case.describe()}: the worker has 8 devices"
    return ""


def run_resume(cases: list[ResumeCase], settings: TrainSettings, on_done: OnResumeDone) -> None:
    """Stop, checkpoint, resume in a fresh process; report each case through `on_done`.

    Each case gets ResumeOutput(resumed=params after case.num_updates of the resumed run,
    uninterrupted=params after case.num_updates of the reference pmap step without a stop),
    or the exception that prevented it.
    """
    runnable = launchable(cases, resume_problem, on_done)
    if not runnable:
        return
    with tempfile.TemporaryDirectory(prefix="gradweight-jax-resume-") as tmp:
        work = Path(tmp)
        dtypes = sorted({case.dtype for case in runnable})
        jobs = {}
        for dtype in dtypes:
            group = sorted(case for case in runnable if case.dtype == dtype)
            jobs[dtype] = work / f"job-{dtype}.pkl"
            jobs[dtype].write_bytes(
                pickle.dumps(
                    {
                        "cases": group,
                        "settings": settings,
                        "dtype": dtype,
                        "root": str(work),
                        "space": id_space([case.fixture for case in group]),
                    }
                )
            )
        results: dict[ResumeCase, dict] = {case: {} for case in runnable}
        for phase in ("stop", "resume"):
            commands = [
                [sys.executable, "-m", __name__, phase, str(jobs[d]), str(work / f"{phase}-{d}")]
                for d in dtypes
            ]
            try:
                run_workers(
                    commands,
                    timeout_s=PHASE_TIMEOUT_S,
                    log_dir=work / f"logs-{phase}",
                    env=jax_worker_env(),
                    zygote=worker_zygote(),
                )
            except Exception as error:
                for case in runnable:
                    if case in results:
                        on_done(case, error)
                return
            for dtype in dtypes:
                out = pickle.loads((work / f"{phase}-{dtype}").read_bytes())
                for case in [c for c in results if c.dtype == dtype]:
                    value = out.get(case, f"{phase}: the worker produced no result")
                    if isinstance(value, str):
                        on_done(case, JaxResumeError(value))
                        del results[case]
                    else:
                        results[case][phase] = value
        for case, parts in results.items():
            on_done(case, ResumeOutput(resumed=parts["resume"], uninterrupted=parts["stop"]))


# ---- the worker ------------------------------------------------------------------------------


def _optimizer(settings: TrainSettings):
    import optax

    spec = settings.optimizer_spec()
    if spec.pop("name") == "sgd":
        return optax.sgd(**spec)
    return optax.adamw(**spec)


def _config(scheme: str, strategy: str, settings: TrainSettings, optimizer):
    import jax_impl

    return jax_impl.StepConfig(
        optimizer=optimizer,
        scheme=scheme,
        strategy=strategy,
        collective=COLLECTIVE[strategy],
        max_grad_norm=settings.max_grad_norm,
    )


def _problem(fixture_name: str, R: int, M: int, dtype: str, space: dict[str, int] | None = None):
    """(laid-out batch, initial params, fingerprint) of a fixture at (R, M), its ids laid
    out in the job's id space (`space`, `crosscheck.run.jax_worker.id_space`; None: the
    fixture's own): the number of group and document ids is static in a compiled program, so
    fixtures of one shape share the programs of a layout only when they share it."""
    import jax_impl
    from jax_impl.checkpoint import batch_fingerprint

    fixture = builtin_fixture(fixture_name)
    global_batch = {k: np.asarray(getattr(fixture, k)) for k in BATCH_KEYS}
    # The weights in the denominator dtype (the default), not the params' `dtype`.
    laid_out = jax_impl.lay_out_global_batch(
        global_batch, R, M, vocab_size=fixture.vocab_size, **(space or id_space([fixture_name]))
    )
    params = jax_impl.params_from_numpy(fixture.params(), dtype)
    return laid_out, params, batch_fingerprint(global_batch)


def _numpy(params) -> dict[str, np.ndarray]:
    """Params as numpy; bfloat16 widened to float32 (exact), so that the parent needs no
    bfloat16 type to read them."""
    arrays = {k: np.asarray(v) for k, v in params.items()}
    return {k: v.astype(np.float32) if v.dtype.name == "bfloat16" else v for k, v in arrays.items()}


def _checkpoint_dir(root: str, index: int) -> Path:
    return Path(root) / "checkpoints" / f"case-{index:04d}"


def _baselines(
    cases: Sequence[ResumeCase], settings: TrainSettings, dtype: str, space: dict[str, int]
) -> dict:
    """Uninterrupted runs with the reference pmap step: per world size, every scheme and
    strategy of its cases side by side in one sweep."""
    import jax

    import jax_impl

    optimizer = _optimizer(settings)
    finals = {}
    for R in sorted({c.world_size for c in cases}):
        keys = [
            (scheme, strategy)
            for scheme in sorted({c.scheme for c in cases if c.world_size == R})
            for strategy in STRATEGIES
        ]
        configs = [_config(scheme, strategy, settings, optimizer) for scheme, strategy in keys]
        sweep = jax_impl.make_pmap_sweep(configs, R)
        runs = sorted(
            {(c.fixture, c.accum_steps, c.num_updates) for c in cases if c.world_size == R}
        )
        for fixture, M, n in runs:
            batch, params0, _ = _problem(fixture, R, M, dtype, space)
            params0 = jax.device_put(params0, jax_impl.require_devices(R)[0])
            params = [params0] * len(configs)
            states = [jax_impl.init_opt_state(optimizer, params0)] * len(configs)
            for _ in range(n):
                reduced = sweep(params, batch)
                for v, config in enumerate(configs):
                    out = jax_impl.apply_optimizer(reduced[v], params[v], states[v], config)
                    params[v], states[v] = out.params, out.opt_state
            for v, (scheme, strategy) in enumerate(keys):
                finals[(fixture, scheme, strategy, R, M, n)] = _numpy(params[v])
    return finals


def _loops(settings: TrainSettings):
    """A cache of ResumableLoop by (scheme, strategy, R, M): each compiles its programs once."""
    from jax_impl.resume import ResumableLoop

    optimizer, loops = _optimizer(settings), {}

    def get(scheme: str, strategy: str, R: int, M: int) -> ResumableLoop:
        key = (scheme, strategy, R, M)
        if key not in loops:
            loops[key] = ResumableLoop(_config(scheme, strategy, settings, optimizer), R, M)
        return loops[key]

    return get


def _stop(case: ResumeCase, index: int, job: dict, loop_for) -> None:
    """Phase 1 of one case: run to the stop and checkpoint."""
    from jax_impl.resume import save_train_state

    loop = loop_for(case.scheme, case.strategy, case.world_size, case.accum_steps)
    batch, params0, fingerprint = _problem(
        case.fixture, case.world_size, case.accum_steps, job["dtype"], job["space"]
    )
    state = loop.run(
        loop.init(params0),
        batch,
        until_updates=case.stop_after_updates,
        then_microbatches=case.stop_after_microbatches,
    )
    save_train_state(_checkpoint_dir(job["root"], index), loop, state, fingerprint)


def _resume(case: ResumeCase, index: int, job: dict, loop_for) -> dict[str, np.ndarray]:
    """Phase 2 of one case: restore at the resume layout, continue; returns final params."""
    from jax_impl.resume import restore_train_state

    R, M = case.resume_world_size, case.resume_accum_steps
    loop = loop_for(case.scheme, case.strategy, R, M)
    batch, params0, fingerprint = _problem(case.fixture, R, M, job["dtype"], job["space"])
    state = restore_train_state(_checkpoint_dir(job["root"], index), loop, params0, fingerprint)
    state = loop.run(state, batch, until_updates=case.num_updates)
    return _numpy(state.params)


def run_phase(phase: str, job: dict) -> dict[ResumeCase, object]:
    """One phase ("stop" or "resume") of every case of the job; a failed case gets its
    traceback."""
    cases: list[ResumeCase] = job["cases"]
    results: dict[ResumeCase, object] = {}
    loop_for = _loops(job["settings"])
    baselines: dict = {}
    if phase == "stop":
        try:
            baselines = _baselines(cases, job["settings"], job["dtype"], job["space"])
        except Exception:
            results = {case: "baseline: " + traceback.format_exc(limit=8) for case in cases}
    for index, case in enumerate(cases):
        if case in results:
            continue
        try:
            if phase == "stop":
                _stop(case, index, job, loop_for)
                key = (case.fixture, case.scheme, case.strategy, case.world_size,
                       case.accum_steps, case.num_updates)  # fmt: skip
                results[case] = baselines[key]
            else:
                results[case] = _resume(case, index, job, loop_for)
        except Exception:  # one failed case fails by name, the others still run
            results[case] = traceback.format_exc(limit=8)
    return results


def main(argv: Sequence[str]) -> int:
    """``PHASE JOB OUT``."""
    return serve_job(argv[1:], functools.partial(run_phase, argv[0]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
