"""A user's JAX step in its own process.

Run as ``python -m crosscheck.verification.jax_verify_worker JOB``.

Started by `crosscheck.verification.jax_verify` with eight fake CPU devices, x64 and the caller's
working directory (where the user's module lives). Reads a pickled job ``{"step":
"MODULE:FUNCTION", "jobs": [VerifyJob...], "cwd": str, "progress": str}``, imports the step
once and calls it for every job in turn, so that one JAX start-up serves them all and jobs of
one shape can reuse the user's compiled code.

Results go to the progress folder as they come, never at the end only: the harness kills this
process when it outlives the time limit, and the jobs that finished before the hang must keep
their results. ``current`` names what the worker is doing ("import" or a job's index);
``<index>.pkl`` holds a finished job's ``("ok", ({name: float64 array}, logged
denominator or None, returned dtype))`` or ``("error", message)``; ``import-error`` holds the
message when the step could not be imported. Every file is written under a temporary name and
renamed, so the harness never reads half of one.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import pickle
import sys
import sysconfig
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from crosscheck.contract.fixture import Fixture
from crosscheck.contract.objective_terms import FROZEN_PARAMS
from crosscheck.contract.row_fields import ROW_FIELD_KEYS
from crosscheck.diagnosis.verdict import level_of_dtypes
from crosscheck.launch.workers import write_atomically
from crosscheck.verification.protocol import ContextAxis, VerifyJob, take_logged_denominator
from crosscheck.verification.step_check import takes_context, takes_optimizer

PARAM_NAMES = ("embed", "unembed")
_LIBRARY_DIRS = tuple(
    str(Path(p).resolve())
    for p in {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
)


def _user_frames(error: BaseException, module_file: str | None, fallback: bool) -> str:
    """The traceback frames of the user's code: neither this worker, nor a library, nor the
    standard library (JAX's own frames say nothing about the user's bug). With `fallback`,
    the innermost frames when none is left, so a step's error always shows where it was."""
    frames = traceback.extract_tb(error.__traceback__)
    this_file = str(Path(__file__).resolve())

    def is_user(frame: traceback.FrameSummary) -> bool:
        path = str(Path(frame.filename).resolve())
        if module_file is not None and path == module_file:
            return True
        return path != this_file and not path.startswith(_LIBRARY_DIRS) and "<" not in path

    kept = [frame for frame in frames if is_user(frame)] or (frames[-3:] if fallback else [])
    return "".join(traceback.format_list(kept)).rstrip()


def describe_error(error: BaseException, module_file: str | None, fallback: bool = True) -> str:
    """``Type: message``, its cause if any, and the user's traceback frames."""
    lines = [f"{type(error).__name__}: {error}"]
    cause = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
    if cause is not None:
        lines.append(f"  (caused by {type(cause).__name__}: {cause})")
    frames = _user_frames(error, module_file, fallback)
    if frames:
        lines.append("Traceback (the step's own frames):\n" + frames)
    return "\n".join(lines)


def import_step(spec: str, cwd: str) -> Callable[..., Any]:
    """The callable ``MODULE:FUNCTION`` names, importable from `cwd` as from the user's shell."""
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    module_name, _, function_name = spec.partition(":")
    module = importlib.import_module(module_name)
    step = module
    for part in function_name.split("."):  # also Class.method or an attribute path
        step = getattr(step, part)
    if not callable(step):
        raise TypeError(f"{spec} is not callable: it is {type(step).__name__} {step!r:.80}")
    return step


def _asks_for(step: Callable[..., Any], rule: Callable[[inspect.Signature], bool]) -> bool:
    """Whether the step asks for an optimizer or a context (`step_check.takes_optimizer`,
    `takes_context`: the rules the up-front check binds it by); a builtin or C callable
    without a signature asks for neither."""
    try:
        return rule(inspect.signature(step))
    except (TypeError, ValueError):
        return False


@functools.cache
def _fixture(name: str) -> Fixture:
    """A built-in fixture by name, or a fixture .npz by path."""
    from crosscheck.fixtures.builtin import builtin_fixture

    if name.endswith(".npz") or os.sep in name:
        return Fixture.load(name)
    return builtin_fixture(name)


# One apply_fn per model shape, one mesh per R and one optimizer per worker: a step that jits
# with them as static arguments (or caches on them) then reuses its compiled code across jobs.
@functools.cache
def _apply_fn(vocab_size: int, hidden_size: int) -> Callable[[Any, Any], Any]:
    from jax_impl.model import BilinearLM

    module = BilinearLM(vocab_size=vocab_size, hidden_size=hidden_size)

    def apply_fn(params: Mapping[str, Any], inputs: Any) -> Any:
        """logits [..., V] = embed[inputs] @ unembed, with params as the plain dict."""
        return module.apply({"params": params}, inputs)

    return apply_fn


def objective_apply(params: Mapping[str, Any], inputs: Any, head: str = "unembed") -> Any:
    """The multi-term family's logits (docs/objectives.md): ``embed[inputs] @ params[head]``
    [..., out] for a head (``unembed``, ``mtp_unembed``, ``router``), and for ``"ref"`` the
    frozen reference's ``ref_embed[inputs] @ ref_unembed``."""
    import jax.numpy as jnp

    if head == "ref":
        return jnp.take(params["ref_embed"], inputs, axis=0) @ params["ref_unembed"]
    return jnp.take(params["embed"], inputs, axis=0) @ params[head]


@functools.cache
def _mesh(world_size: int) -> Any:
    from jax_impl.shard_map_step import data_mesh

    return data_mesh(world_size, "data")


@functools.cache
def _context_mesh(world_size: int, context_size: int) -> Any:
    from jax_impl.context_parallel import context_mesh

    return context_mesh(world_size, context_size)


def _split_context(batch: dict[str, np.ndarray], job: VerifyJob) -> tuple[dict, ContextAxis]:
    """The [R, M, B, T] batch as a context-parallel step gets it: every token field [R, C, M, B,
    T/C] (context rank c's positions at [:, c]), every row field [R, C, M, B]; and its
    `ContextAxis`. The positions and the split are JAX's own reading of the layout
    (``jax_impl.context_parallel``), as its context-parallel step lays a batch out."""
    from jax_impl.context_parallel import context_positions, split_over_context

    C = job.context_size
    positions = context_positions(batch["targets"].shape[-1], C, job.context_order)
    split = {key: split_over_context(value, positions) for key, value in batch.items()}
    return split, ContextAxis(size=C, order=job.context_order, positions=positions)


@functools.cache
def _optimizer() -> Any:
    import optax

    return optax.sgd(1.0)


def _arguments(
    job: VerifyJob,
    mesh: Any = None,
    user_model: tuple[Callable[..., Any], Any] | None = None,
) -> tuple[Any, Any, dict[str, np.ndarray], Any]:
    """(params, apply_fn, batch, mesh) for one job; raises naming what cannot be laid out.
    `mesh`: the mesh to hand over (a multi-host job's, over every process); None: R devices.
    `user_model`: the user's (apply_fn, params) (``verify --model``), else the analytic one."""
    import jax.numpy as jnp

    from jax_impl.model import params_from_numpy

    fixture = _fixture(job.fixture)
    laid_out = fixture.layout(job.world_size, job.accum_steps)
    # Writable copies: a step that edits its batch in place must neither fail on the
    # fixture's read-only arrays nor change what the next job sees.
    batch = {
        "inputs": np.array(laid_out.inputs),
        "targets": np.array(laid_out.targets),
        "segment_ids": np.array(laid_out.segment_ids),
        "weights": np.array(laid_out.weights, dtype=np.float64),
    }
    # Contract v2's fields where the fixture gives them, or all four (defaults where it gives
    # none) for a spec scheme: [R, M, B] per row, [R, M, B, T] document ids.
    for key in ROW_FIELD_KEYS if job.row_fields else fixture.explicit_row_fields:
        batch[key] = np.array(getattr(laid_out, key))
    # Fresh: a step may donate them. float64 unless the job hands the step another dtype.
    if job.objective_params:  # the multi-term family's params, and y' for an mtp term
        from crosscheck.verification.objective_verify import objective_arrays

        arrays, extra = objective_arrays(job.fixture, job.objective_params)
        for key, value in extra.items():
            batch[key] = np.array(value.reshape(laid_out.targets.shape))
        params = {k: jnp.asarray(v, dtype=jnp.dtype(job.dtype)) for k, v in arrays.items()}
        return params, objective_apply, batch, mesh or _mesh(job.world_size)
    if user_model is not None:
        from jax_impl.harness.model_reference import with_dtype

        apply_fn, user_params = user_model
        mesh = mesh or _mesh(job.world_size)
        return with_dtype(user_params, jnp.dtype(job.dtype)), apply_fn, batch, mesh
    params = params_from_numpy(fixture.params(), jnp.dtype(job.dtype))
    return params, _apply_fn(*fixture.embed.shape), batch, mesh or _mesh(job.world_size)


def _context_arguments(
    job: VerifyJob, user_model: tuple[Callable[..., Any], Any] | None = None
) -> tuple[Any, Any, dict[str, np.ndarray], Any, ContextAxis]:
    """(params, apply_fn, batch, mesh, context) for a context-parallel step's job: the
    batch split over the context ranks, the ("data", "context") mesh of R x C devices."""
    params, apply_fn, batch, _ = _arguments(job, None, user_model)
    batch, context = _split_context(batch, job)
    return params, apply_fn, batch, _context_mesh(job.world_size, job.context_size), context


def read_gradient(
    out: Any, expected: Mapping[str, tuple[int, ...]], world_size: int
) -> dict[str, np.ndarray]:
    """The step's returned tree as float64 numpy, or ValueError naming the leaf that is wrong.

    A leaf of shape [R, *expected] (pmap's replicated output) is accepted when every replica
    equals replica 0 exactly: replicas that differ mean the gradient was not synchronized.
    """
    import jax

    if not isinstance(out, Mapping):
        raise ValueError(f"is a {type(out).__name__}; expected a dict with keys {sorted(expected)}")
    if set(out) != set(expected):
        missing = sorted(set(expected) - set(out))
        extra = sorted(map(str, set(out) - set(expected)))
        hint = " (a Flax variables dict? return its 'params' entry)" if extra == ["params"] else ""
        raise ValueError(
            f"has keys {sorted(map(str, out))}, expected {sorted(expected)} "
            f"(missing {missing}, unexpected {extra}){hint}"
        )
    grads = {}
    for name in sorted(expected):
        try:
            leaf = np.asarray(jax.device_get(out[name]), dtype=np.float64)
        except Exception as error:
            raise ValueError(
                f"[{name!r}] is a {type(out[name]).__name__} that is not a float array: {error}"
            ) from error
        want = tuple(expected[name])
        if leaf.shape == (world_size, *want):
            for replica in range(1, world_size):
                if not np.array_equal(leaf[replica], leaf[0], equal_nan=True):
                    diff = np.nanmax(np.abs(leaf[replica] - leaf[0]))
                    raise ValueError(
                        f"[{name!r}] has a leading device axis of {world_size} replicas but "
                        f"replica {replica} differs from replica 0 (max |difference| {diff:.3g}):"
                        " the gradient was not synchronized across devices"
                    )
            leaf = leaf[0]
        elif leaf.shape != want:
            raise ValueError(
                f"[{name!r}] has shape {leaf.shape}, expected {want} "
                f"(or {(world_size, *want)} with a leading device axis)"
            )
        grads[name] = np.ascontiguousarray(leaf)
    return grads


def _named_tree(params: Any, out: Any) -> tuple[dict[str, tuple[int, ...]], dict[str, Any]]:
    """The user's params' leaf shapes and the step's returned tree, both by pytree path."""
    from jax_impl.harness.model_reference import named_leaves

    expected = {name: tuple(np.shape(leaf)) for name, leaf in named_leaves(params).items()}
    return expected, named_leaves(out)


def run_job(
    step: Callable[..., Any],
    spec: str,
    job: VerifyJob,
    module_file: str | None,
    mesh: Any = None,
    user_model: tuple[Callable[..., Any], Any] | None = None,
) -> tuple:
    """One call of the step: ("ok", (grads, logged D, returned dtype)) or ("error", a message
    naming the job and cause)."""
    where = f"{job.describe()}: step {spec}"
    with_context = _asks_for(step, takes_context)
    if job.context_size > 1 and not with_context:
        return "error", (
            f"{where}: a context-parallel layout (C={job.context_size}) needs a step that "
            "declares a `context` parameter, to know its mesh axis (docs/verify.md#context-"
            "parallel)"
        )
    kwargs: dict[str, Any] = {}
    try:
        if with_context:
            params, apply_fn, batch, mesh, kwargs["context"] = _context_arguments(job, user_model)
        else:
            params, apply_fn, batch, mesh = _arguments(job, mesh, user_model)
    except Exception as error:
        return "error", f"{where}: cannot set up the job: {type(error).__name__}: {error}"
    with_optimizer = _asks_for(step, takes_optimizer)
    if with_optimizer:
        kwargs["optimizer"] = _optimizer()
    take_logged_denominator()  # forget what an earlier job logged
    try:
        out = step(params, apply_fn, batch, mesh, **kwargs)
    except (Exception, SystemExit) as error:  # sys.exit in a step is the step's failure too
        return "error", f"{where} raised {describe_error(error, module_file)}"
    what = "optax updates" if with_optimizer else "gradient"
    try:
        if user_model is not None:  # any pytree: its leaves by path (model_reference.named_leaves)
            expected, out = _named_tree(params, out)
        elif job.objective_params:
            # The trained params only: a frozen reference's gradient, if returned, is ignored.
            expected = {n: tuple(np.shape(params[n])) for n in params if n not in FROZEN_PARAMS}
            if isinstance(out, Mapping):
                out = {k: v for k, v in out.items() if k not in FROZEN_PARAMS}
        else:
            expected = {name: tuple(np.shape(params[name])) for name in PARAM_NAMES}
        grads = read_gradient(out, expected, job.processes)
        returned = level_of_dtypes(str(getattr(out[name], "dtype", "")) for name in expected)
    except ValueError as error:
        return "error", f"{where}: the returned {what} {error}"
    except Exception as error:  # computing a lazy result can raise too (e.g. an XLA error)
        return "error", f"{where}: reading its result raised {describe_error(error, module_file)}"
    if with_optimizer:  # optax.sgd(1.0): updates = -gradient
        grads = {name: -value for name, value in grads.items()}
    return "ok", (grads, take_logged_denominator(), returned)


def main(argv: Sequence[str]) -> int:
    job = pickle.loads(Path(argv[0]).read_bytes())
    progress = Path(job["progress"])
    spec, jobs = job["step"], job["jobs"]
    write_atomically(progress / "current", b"import")
    import jax

    jax.config.update("jax_enable_x64", True)
    try:
        step = import_step(spec, job["cwd"])
    except (Exception, SystemExit) as error:
        # No fallback frames: importlib's own say nothing; a module that failed while being
        # executed (a SyntaxError, an error at import time) shows its own frames.
        message = f"cannot import step {spec}: {describe_error(error, None, fallback=False)}"
        write_atomically(progress / "import-error", message.encode())
        return 0
    user_model = None
    if job.get("model"):
        from jax_impl.harness.model_reference import fresh_model, load_callable

        try:
            factory = load_callable(job["model"], job["cwd"], "model factory")
            user_model = fresh_model(factory, job["model"])
        except Exception as error:
            message = f"cannot build the model {job['model']}: {describe_error(error, None)}"
            write_atomically(progress / "import-error", message.encode())
            return 0
    module = sys.modules.get(spec.partition(":")[0])
    module_file = getattr(module, "__file__", None)
    module_file = str(Path(module_file).resolve()) if module_file else None
    for index, verify_job in enumerate(jobs):
        write_atomically(progress / "current", str(index).encode())
        result = run_job(step, spec, verify_job, module_file, user_model=user_model)
        write_atomically(progress / f"{index}.pkl", pickle.dumps(result))
    write_atomically(progress / "current", b"done")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
