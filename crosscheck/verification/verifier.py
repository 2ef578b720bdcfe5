"""Verify a user's training step: does it weight tokens the way the intended scheme says?

`verify` runs the step (see `crosscheck.verification.protocol` for what it is given and must return)
on several fixtures and layouts, in real processes, and judges every gradient against the
oracle's for the intended scheme at the precision the step's own numerics show
(``crosscheck.diagnosis.verdict``: float64-exact, float32-level, bf16-level; ``precision="float64"``
is the strict judgement). Several layouts by default, because one layout can hide a weighting
bug: a per-rank mean is exact whenever every rank holds the same number of tokens, a
per-microbatch mean is rank-mean at M = 1, and at R = M an extra factor R is an extra
factor M.

The result is a `crosscheck.verification.report.VerifyReport`, one `VerifyCase` per fixture
and layout: the name a failing step gets is the one that explains *every* case of the run
(``crosscheck.diagnosis.naming.headline``), never one case's best match.

``assert_weighting`` is the pytest-friendly form: it raises AssertionError whose message is
the diagnosis.

A ``--step`` that names a module or function that does not exist is a set-up error, not a
failing case: `check_step` (``crosscheck.verification.step_check``) finds it before any
process starts and `verify` raises `StepSetupError` (a ValueError) once, naming what is missing.

The intended scheme is resolved once (`resolve_scheme`: a `SchemeSpec` passes through as it
is, a name such as ``constant:4096`` is read) and that spec goes to every judgement and into
the report: no step of the path turns it back into a name, so ``Constant(C)`` keeps C.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Literal

from crosscheck.contract.layout import CONTEXT_ORDERS, Layout
from crosscheck.contract.schemes import is_v1_scheme, resolve_scheme
from crosscheck.contract.spec import SchemeSpec
from crosscheck.diagnosis.diagnose import diagnose
from crosscheck.diagnosis.verdict import PRECISIONS, coarsest_level
from crosscheck.fixtures.builtin import builtin_fixture
from crosscheck.launch.devices import (
    DeviceError,
    chosen_platform,
    jax_platform_problem,
    resolve_torch_device,
)
from crosscheck.run.implementations import not_installed
from crosscheck.verification.model_basis import ModelReference, model_reference
from crosscheck.verification.objective_model import (
    model_objective_problem,
    objective_model_reference,
)
from crosscheck.verification.objective_verify import (
    BF16_REFUSED,
    OBJECTIVE_FIXTURES,
    ObjectiveReport,
    judge_objective,
    resolve_objective,
)
from crosscheck.verification.protocol import StepError, VerifyJob, VerifyOutput
from crosscheck.verification.report import VerifyCase, VerifyReport
from crosscheck.verification.step_check import (
    STEP_CHECK_TIMEOUT_S,
    check_step,
    step_name,
)

# Re-exported: the public API finds it beside `verify`, which raises it.
from crosscheck.verification.step_check import StepSetupError as StepSetupError

#: How the set-up messages name the call that starts a verification.
Framework = Literal["torch", "jax"]
FRAMEWORKS = {
    "torch": "crosscheck.verification.torch_verify",
    "jax": "crosscheck.verification.jax_verify",
}
#: Two fixtures whose ranks and microbatches hold different token counts (so local means
#: differ from global ones) and one of them packed (so per-row is not per-sequence).
DEFAULT_FIXTURES: tuple[str, ...] = ("packed", "ragged")
#: A scheme spec is checked on v2's fixtures too: prompt groups and documents that span
#: ranks and microbatches, a fully masked row, signed row weights, a sample mask.
SPEC_FIXTURES: tuple[str, ...] = (*DEFAULT_FIXTURES, "rollouts", "continued-documents")
#: Ranks alone, accumulation alone, both with R = M, four ranks, and both with R != M (where
#: an extra factor R and an extra factor M differ).
DEFAULT_LAYOUTS: tuple[tuple[int, int], ...] = ((2, 1), (1, 2), (2, 2), (4, 1), (2, 4))
#: A context-parallel step's layouts (R, M, C, order) instead: C 2 and 4, R and M 1 and 2,
#: both orders, at most R C = 4 processes (a count that misses the context ranks differs from
#: one that holds them only where C > 1: C = 1 runs no split and shows none of them). C = 4
#: is contiguous: zigzag's 8 chunks of ragged's 24 positions cut its 144 rows into 213
#: (row, segment, context rank) groups, some so nearly spanned by the others that the fit's
#: standard error on one reached 0.9 and the sensitivity line promised only 1 + 8.6e-02
#: (contiguous: 176 groups, 1 + 1.0e-05 at float32-level, as at C = 1).
DEFAULT_CONTEXT_LAYOUTS: tuple[tuple[int, int, int, str], ...] = (
    (1, 1, 2, "zigzag"),
    (2, 1, 2, "contiguous"),
    (1, 2, 4, "contiguous"),
    (2, 2, 2, "zigzag"),
)
DEFAULT_TIMEOUT_S = 120.0
DTYPES: tuple[str, ...] = ("float64", "float32", "bfloat16")


def jobs_for(
    fixtures: Sequence[str] | None,
    world_sizes: Sequence[int] | None,
    accum_steps: Sequence[int] | None,
    dtype: str = "float64",
    row_fields: bool = False,
    context_sizes: Sequence[int] | None = None,
    context_orders: Sequence[str] | None = None,
    context_step: bool = False,
) -> list[VerifyJob]:
    """Every (fixture, R, M, C, order) asked for. A layout asked for explicitly that does not
    divide a fixture's rows (R x M) or positions (C, or 2 C for zigzag) is refused, naming
    both: a check that was asked for never silently drops. Default layouts are kept where they
    fit (each fixture keeps at least one): DEFAULT_LAYOUTS, or DEFAULT_CONTEXT_LAYOUTS for a
    `context_step` (one that declares ``context``). Given any of `world_sizes`, `accum_steps`,
    `context_sizes` and `context_orders`, the layouts are their product, the ones left out
    defaulting to (1, 2), (1, 2), (1,) (a context step: (2,)) and ("zigzag",)."""
    names = list(fixtures or DEFAULT_FIXTURES)
    explicit = any(x is not None for x in (world_sizes, accum_steps, context_sizes, context_orders))
    if explicit:
        layouts = [
            Layout(R, M, C, order if C > 1 else "contiguous")
            for R in world_sizes or (1, 2)
            for M in accum_steps or (1, 2)
            for C in context_sizes or ((2,) if context_step else (1,))
            for order in context_orders or ("zigzag",)
        ]
        layouts = list(dict.fromkeys(layouts))  # C = 1 is one layout whatever the order
    elif context_step:
        layouts = [Layout(*layout) for layout in DEFAULT_CONTEXT_LAYOUTS]
    else:
        layouts = [Layout(R, M) for R, M in DEFAULT_LAYOUTS]
    jobs = []
    for name in names:
        fixture = builtin_fixture(name)
        rows, width = fixture.num_rows, fixture.seq_len
        fit = {layout: layout.divides(rows) and layout.splits(width) for layout in layouts}
        fitting = [layout for layout in layouts if fit[layout]]
        misfits = [layout for layout in layouts if not fit[layout]]
        if (explicit and misfits) or not fitting:
            text = ", ".join(str(layout) for layout in misfits)
            rule = "R x M must divide the rows"
            if any(layout.context_size > 1 for layout in layouts):
                rule += f", and C (2 C for zigzag) its {width} positions"
            raise ValueError(
                f"fixture {name!r} has {rows} rows of {width} positions: no layout among "
                f"{text} divides them ({rule}); choose other layouts or other fixtures"
                if not fitting
                else f"fixture {name!r} has {rows} rows of {width} positions, which {text} does "
                f"not divide ({rule}); drop that layout or that fixture"
            )
        jobs += [
            VerifyJob(
                fixture=name,
                world_size=layout.world_size,
                accum_steps=layout.accum_steps,
                dtype=dtype,
                row_fields=row_fields,
                context_size=layout.context_size,
                context_order=layout.context_order,
            )
            for layout in fitting
        ]
    return jobs


def judge(
    job: VerifyJob,
    scheme: SchemeSpec,
    output: VerifyOutput | BaseException,
    precision: str = "auto",
    reference: ModelReference | None = None,
    framework: str | None = None,
) -> VerifyCase:
    """Diagnose one gradient at `precision`; the case passes when the intended scheme fits.
    `reference`: the user's model's group basis and intended gradient (``--model``);
    `framework`: the step's, whose terms the fix is said in."""
    if isinstance(output, BaseException):
        return VerifyCase(job, math.inf, False, None, f"{type(output).__name__}: {output}")
    fixture = builtin_fixture(job.fixture)
    try:
        d = diagnose(
            fixture,
            job.world_size,
            job.accum_steps,
            output.grads,
            scheme,
            # A gradient that came back coarser than the params handed over (a step that
            # casts its model to bf16 itself) is judged as the step's own precision.
            dtype=coarsest_level((job.dtype, output.returned_dtype)),
            precision=precision,
            logged_denominator=output.logged_denominator,
            basis=None if reference is None else reference.bases[job.fixture],
            intended_grads=None if reference is None else reference.intended[job],
            framework=framework,
            context_size=job.context_size,
            context_order=job.context_order,
        )
    except ValueError as error:  # wrong keys or shapes that got past the runner
        return VerifyCase(job, math.inf, False, None, f"StepError: {error}")
    return VerifyCase(
        job, d.intended_error, not d.detected, d, logged_denominator=output.logged_denominator
    )


def verify(
    step: str | Callable,
    *,
    framework: Framework,
    scheme: str | SchemeSpec | None = None,
    objective: str | Sequence[Mapping[str, Any]] | None = None,
    fixtures: Sequence[str] | None = None,
    world_sizes: Sequence[int] | None = None,
    accum_steps: Sequence[int] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    precision: str = "auto",
    dtype: str = "float64",
    device: str = "cpu",
    platform: str | None = None,
    run_jobs: Callable[[str, list[VerifyJob]], dict] | None = None,
    model: str | Callable | None = None,
    forward: str | Callable | None = None,
    context_sizes: Sequence[int] | None = None,
    context_orders: Sequence[str] | None = None,
) -> VerifyReport | ObjectiveReport:
    """Run `step` (see crosscheck.verification.protocol) on every fixture and layout and judge it.

    `scheme` is a `SchemeSpec` (``Constant(4096)`` keeps its C) or its dict, a name
    (``constant:4096`` reads as that; a trainer mode such as ``group_token_mean``), or
    ``module:object`` naming one (`resolve_scheme`); a scheme beyond contract v1's is checked
    on SPEC_FIXTURES. `objective` (instead of `scheme`) is a multi-term objective: a name of
    docs/objectives.md, ``module:object`` naming a list of terms, or the list; the step gets
    the params its terms read and the result is an `ObjectiveReport`, per term
    (`crosscheck.verification.objective_verify`), checked on OBJECTIVE_FIXTURES by default.
    Layouts default to DEFAULT_LAYOUTS; given `world_sizes` and/or
    `accum_steps`, their product (the missing one defaults to (1, 2)). `dtype` is the dtype
    of the model / params handed to the step. `precision` is "auto" (the finest level the
    step's noise allows: float64, float32, or bfloat16 when `dtype` is) or a level to judge
    at; "float64" is the strict float64 judgement. The report's `ok` is True only when the
    intended scheme fits every case. `device` (torch: auto, cpu, cuda) and `platform` (JAX:
    cpu, gpu, tpu) say where the step runs (`crosscheck.launch.devices`, docs/gpu.md).
    `run_jobs(step, jobs)`, when given, runs the jobs in place of the framework's own runner
    (inside a launcher's job: `crosscheck.verification.torch_launched`, `jax_launched`).

    `model` (``MODULE:FACTORY`` or the function) brings the user's own model: the step is
    handed it instead of the analytic one, and the reference is that model's intended
    gradient and group basis (`crosscheck.verification.model_basis`); `forward`
    (``MODULE:FN``) is how the reference gets its logits (docs/verify.md, "Bring your own
    model").

    A step that declares a ``context`` parameter is context-parallel (the protocol's "Context
    parallel"): it runs at DEFAULT_CONTEXT_LAYOUTS, or at `context_sizes` C x
    `context_orders` ("zigzag", "contiguous") with the other layout arguments.

    Raises ValueError for bad arguments, and `StepSetupError` (a ValueError) when `step`
    cannot run as given (`check_step`), before any process starts.
    """
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework must be one of {', '.join(FRAMEWORKS)}, got {framework!r}")
    if (scheme is None) == (objective is None):
        raise ValueError(
            "verify needs the intended scheme (--scheme) or the intended multi-term objective "
            "(--objective), one of the two"
        )
    intended = None if scheme is None else resolve_scheme(scheme)
    terms = None if objective is None else resolve_objective(objective)
    if terms is not None and model is not None:
        problem = model_objective_problem(terms)
        if problem:
            raise ValueError(problem)
    if terms is not None and "bfloat16" in (dtype, precision):
        raise ValueError(f"--objective with bfloat16: {BF16_REFUSED}")
    if fixtures is None:
        if terms is not None:
            fixtures = OBJECTIVE_FIXTURES
        elif not is_v1_scheme(intended):
            fixtures = SPEC_FIXTURES
    if intended is not None and not intended.intended:
        raise ValueError(f"verify checks an intended scheme; {intended.name!r} is accidental")
    if precision != "auto" and precision not in PRECISIONS:
        raise ValueError(f"precision must be auto or one of {', '.join(PRECISIONS)}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    missing = not_installed(framework)
    if missing:
        raise StepSetupError(missing)
    name = step_name(step)
    row_fields = intended is not None and not is_v1_scheme(intended)
    # Once, before any process starts: a step that does not exist is a set-up error (raised
    # here, exit 2 on the command line), never a failing case per fixture and layout.
    context_step = check_step(name, framework, timeout_s=min(timeout_s, STEP_CHECK_TIMEOUT_S))
    context_problem = _context_problem(
        name, context_step, context_sizes, context_orders, terms, model, run_jobs
    )
    if context_problem:
        raise StepSetupError(context_problem)
    jobs = jobs_for(
        fixtures,
        world_sizes,
        accum_steps,
        dtype,
        row_fields=row_fields,
        context_sizes=context_sizes,
        context_orders=context_orders,
        context_step=bool(context_step),
    )
    if terms is not None and model is None:  # the fixture model family's params
        jobs = [replace(job, objective_params=terms.param_names) for job in jobs]
    # Where the step runs: torch ranks on a device, JAX workers on a platform (docs/gpu.md); a
    # device that is not there is a set-up error (DeviceError, a ValueError).
    if run_jobs is not None:
        place = {}
    elif framework == "torch":
        ranks = max(job.processes for job in jobs)
        place = {"device": resolve_torch_device(device, ranks)}
    else:
        platform = platform or chosen_platform()  # cpu unless a run set one
        problem = jax_platform_problem(platform)
        if problem:
            raise DeviceError(problem)
        place = {"platform": platform}
    # torch: every rank of this verification (and the model's reference) forks from a zygote
    # that imported the user's modules once, instead of each rank importing them. Starting it
    # is the ranks' start-up, which the run's start-up allowance covers (`startup_spent_s`).
    preload_started = time.monotonic()
    with _preloading(framework, run_jobs, [name, model, forward], timeout_s):
        if framework == "torch":
            place["startup_spent_s"] = time.monotonic() - preload_started
        reference, model_name = None, ""
        if model is not None:
            if run_jobs is not None:
                raise ValueError(
                    "--model runs its reference in a process of its own, which a launcher's job "
                    "does not start: run `verify --model` without torchrun or a multi-host start"
                )
            model_name = step_name(model)
            forward_name = "" if forward is None else step_name(forward)
            for option, callable_name in (("--model", model_name), ("--forward", forward_name)):
                if callable_name:
                    check = min(timeout_s, STEP_CHECK_TIMEOUT_S)
                    check_step(callable_name, framework, timeout_s=check, option=option)
            if terms is not None:  # the model's own per-term gradients
                reference = objective_model_reference(
                    framework, model_name, forward_name, jobs, terms, timeout_s=timeout_s
                )
            else:
                reference = model_reference(
                    framework, model_name, forward_name, jobs, intended, timeout_s=timeout_s
                )
            if coarsest_level((dtype, reference.dtype)) != dtype:
                # The model's forward refuses float64: the step gets it in the reference's dtype
                # (it could not run it in float64 either), and is judged at that level.
                jobs = [replace(job, dtype=reference.dtype) for job in jobs]
                if terms is None:
                    reference = reference.at_dtype(reference.dtype)
        elif forward is not None:
            raise ValueError("forward is how the reference runs the user's model: give model too")
        if run_jobs is not None:  # inside a launcher's job, which placed this process itself
            outputs = run_jobs(name, jobs)
        else:
            runner = importlib.import_module(FRAMEWORKS[framework])
            extra = {"model": model_name} if model_name else {}
            outputs = runner.run(name, jobs, timeout_s=timeout_s, **place, **extra)
    if terms is not None:
        columns = None if reference is None else reference.columns
        return ObjectiveReport(
            framework=framework,
            step=name,
            objective=terms,
            precision=precision,
            cases=[
                judge_objective(
                    job, terms, outputs.get(job, _never_reported(job)), precision, columns
                )
                for job in jobs
            ],
            model=model_name,
            model_dtype="float64" if reference is None else reference.dtype,
            model_refused="" if reference is None else reference.refused,
        )
    cases = [
        judge(
            job,
            intended,
            outputs.get(job, _never_reported(job)),
            precision,
            reference,
            framework,
        )
        for job in jobs
    ]
    return VerifyReport(
        framework=framework,
        step=name,
        scheme=intended,
        precision=precision,
        cases=cases,
        model=model_name,
        model_dtype="float64" if reference is None else reference.dtype,
        model_refused="" if reference is None else reference.refused,
    )


#: How long a torch verification waits for the zygote that imports the user's modules for its
#: ranks: at most a quarter of --timeout and 15 s (transformers' models take 1.4 s). Past it
#: the ranks import the modules themselves, as without the zygote, and an import that hangs is
#: reported by the run; the wait is taken from the run's start-up allowance
#: (`torch_verify.run`'s `startup_spent_s`), so the run's bound holds from before it.
PRELOAD_SHARE = 0.25
PRELOAD_WAIT_S = 15.0


def _preloading(
    framework: str, run_jobs: Any, callables: Sequence[str | Callable | None], timeout_s: float
) -> contextlib.AbstractContextManager:
    """`torch_impl.harness.launcher.preloading` of the modules of `callables` (the step, the
    model, its forward) for a torch verification that starts its own ranks; nothing
    otherwise. torch is imported here only then, as by the torch runner."""
    if framework != "torch" or run_jobs is not None:
        return contextlib.nullcontext()
    from torch_impl.harness.launcher import preloading

    modules = [step_name(c).partition(":")[0] for c in callables if c is not None]
    return preloading(modules, timeout_s=min(timeout_s * PRELOAD_SHARE, PRELOAD_WAIT_S))


def _context_problem(
    name: str,
    context_step: bool | None,
    context_sizes: Sequence[int] | None,
    context_orders: Sequence[str] | None,
    terms: Any,
    model: Any,
    run_jobs: Any,
) -> str:
    """Why the context-parallel part of a verification cannot run as asked, or ''."""
    for size in context_sizes or ():
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            return f"context sizes are whole numbers >= 1, got {size!r}"
    for order in context_orders or ():
        if order not in CONTEXT_ORDERS:
            return f"context orders are {' and '.join(CONTEXT_ORDERS)}, got {order!r}"
    split = any(size > 1 for size in context_sizes or ())
    if split and context_step is False:
        sizes = ",".join(map(str, context_sizes or ()))
        return (
            f"--context-sizes {sizes}: the step {name} declares no `context` parameter, so it "
            "cannot know its context-parallel group; a context-parallel step takes "
            "context= beside its other arguments (docs/verify.md#context-parallel)"
        )
    if not (split or context_step):
        return ""
    for given, what in (
        (terms, "--objective"),
        (model, "--model"),
        (run_jobs, "a launcher's job (torchrun, --coordinator)"),
    ):
        if given is not None:
            return (
                f"the context-parallel step {name} cannot be verified with {what} yet: verify it "
                "on the analytic model with --scheme, in a run of its own"
            )
    return ""


def _never_reported(job: VerifyJob) -> StepError:
    return StepError(f"{job.describe()}: planned but never reported")


def assert_weighting(step: str | Callable, **kwargs: Any) -> VerifyReport | ObjectiveReport:
    """`verify(step, **kwargs)`, raising AssertionError with the diagnosis unless it matches."""
    report = verify(step, **kwargs)
    if not report.ok:
        raise AssertionError(report.message())
    return report
