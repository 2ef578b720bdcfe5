"""The reference of ``verify --model``: the intended gradient and group basis of a user's model.

With the analytic model the oracle gives both in closed form. With the user's own model
(``MODULE:FACTORY``; docs/verify.md, "Bring your own model") they are computed by that model,
at its initial weights, in float64 where it allows, in one extra process of the step's framework
(this process imports neither torch nor JAX), before the step runs:

* per fixture, the group basis B [K, P] (`crosscheck.diagnosis.group_basis`: one backward per
  (row, segment) group, under the intended scheme's units), which serves every layout;
* per distinct intended weighting w_t = a_t / D of a job (`SchemeSpec.effective_weights` on the
  job's layout), the intended gradient: one backward of sum_t w_t l_t over the global batch.

The math is the framework's own (`torch_impl.harness.model_reference`,
`jax_impl.harness.model_reference`). A factory that cannot be imported or called, returns the
wrong thing or different weights on two calls, or a reference that fails, is a `StepSetupError`:
the set-up is wrong, and no case is run.

`torch_group_basis` and `jax_group_basis` compute a `GroupBasis` in the caller's process, for
``crosscheck.diagnose(..., basis=...)`` on a gradient the caller's own model produced.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from crosscheck.contract.fixture import Fixture
from crosscheck.contract.schemes import resolve_scheme
from crosscheck.contract.spec import SchemeSpec
from crosscheck.diagnosis.group_basis import GroupBasis, token_groups, token_units
from crosscheck.fixtures.builtin import builtin_fixture
from crosscheck.verification.protocol import VerifyJob
from crosscheck.verification.step_check import StepSetupError

#: The arrays of the global batch a forward is handed (every fixture has them).
BATCH_KEYS: tuple[str, ...] = ("inputs", "targets", "segment_ids", "weights")
JAX_WORKER = "crosscheck.verification.jax_model_worker"


@dataclass(frozen=True, slots=True)
class ModelReference:
    """Per fixture its group basis, per job the intended gradient, both from the user's model."""

    bases: dict[str, GroupBasis]
    intended: dict[VerifyJob, dict[str, np.ndarray]]
    #: The dtype the reference ran in: float64, or float32 for a model whose forward refuses
    #: float64 (`refused` says how); the step then gets the model in that dtype too.
    dtype: str = "float64"
    refused: str = ""

    def at_dtype(self, dtype: str) -> ModelReference:
        """The same reference with its jobs handed the model in `dtype`."""
        intended = {replace(job, dtype=dtype): grads for job, grads in self.intended.items()}
        return replace(self, intended=intended)


def _batch(fixture: Fixture) -> dict[str, np.ndarray]:
    return {key: np.asarray(getattr(fixture, key)) for key in BATCH_KEYS}


def _groups(fixture: Fixture, scheme: SchemeSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(group id per token, units u_t, each group's (row, segment)), all layout-free."""
    units = token_units(fixture, scheme)
    group_of, described = token_groups(fixture, 1, 1, units)
    keys = np.array([(key.row, key.segment) for key in described], dtype=np.int64)
    return group_of, units, keys.reshape(-1, 2)


def reference_request(
    model: str, forward: str, jobs: Sequence[VerifyJob], scheme: SchemeSpec
) -> tuple[dict[str, Any], dict[VerifyJob, int], dict[str, np.ndarray]]:
    """(the request for the reference process, each job's weighting index, each fixture's
    group keys). Jobs whose intended weights are bit-identical share one weighting."""
    fixtures: dict[str, Any] = {}
    keys: dict[str, np.ndarray] = {}
    weightings: list[tuple[str, np.ndarray]] = []
    seen: dict[tuple[str, bytes], int] = {}
    index_of: dict[VerifyJob, int] = {}
    for job in jobs:
        fixture = builtin_fixture(job.fixture)
        if job.fixture not in fixtures:
            group_of, units, keys[job.fixture] = _groups(fixture, scheme)
            fixtures[job.fixture] = (_batch(fixture), group_of, units)
        batch = fixture.layout(job.world_size, job.accum_steps)
        weights = np.ascontiguousarray(batch.to_global(scheme.effective_weights(batch)))
        key = (job.fixture, weights.tobytes())
        if key not in seen:
            seen[key] = len(weightings)
            weightings.append((job.fixture, weights))
        index_of[job] = seen[key]
    request = {
        "model": model,
        "forward": forward,
        "cwd": os.getcwd(),
        "fixtures": fixtures,
        "weightings": weightings,
    }
    return request, index_of, keys


def _run_torch(request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    from torch_impl.harness.launcher import launch
    from torch_impl.harness.model_reference import compute_reference

    # One process (a group of one): the reference needs no collective.
    [result] = launch(compute_reference, 1, (request,), timeout_s=timeout_s)
    return result


def _run_jax(request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    from crosscheck.launch.workers import run_jax_job

    with tempfile.TemporaryDirectory(prefix="gradweight-model-reference-") as tmp:
        # "dtype": float64 turns x64 on in the worker (crosscheck.launch.workers.serve_job).
        job = {"dtype": "float64", "request": request}
        return run_jax_job(JAX_WORKER, job, Path(tmp), timeout_s=timeout_s)


def run_reference(
    framework: str, model: str, request: dict[str, Any], timeout_s: float
) -> dict[str, Any]:
    """The reference process's result for `request`; StepSetupError when it has none."""
    run = _run_torch if framework == "torch" else _run_jax
    try:
        result = run(request, timeout_s)
    except Exception as error:  # the launch failed or timed out: the model cannot be used
        raise StepSetupError(
            f"--model {model}: its reference gradient could not be computed: {str(error).strip()}"
        ) from None
    if "setup_error" in result:
        raise StepSetupError(f"--model {model}: {result['setup_error']}")
    if "error" in result:
        raise StepSetupError(f"--model {model}: {result['error']}")
    return result


def model_reference(
    framework: str,
    model: str,
    forward: str,
    jobs: Sequence[VerifyJob],
    scheme: SchemeSpec,
    *,
    timeout_s: float,
) -> ModelReference:
    """Every fixture's group basis and every job's intended gradient from the user's model,
    computed in one process of `framework` within `timeout_s`; StepSetupError when it cannot.
    Measured on two shared cores, a factory that hangs under ``--timeout 10``: the CLI exits 2
    after 11.5 s (torch) and 10.2 s (JAX), nothing left running."""
    request, index_of, keys = reference_request(model, forward, jobs, scheme)
    result = run_reference(framework, model, request, timeout_s)
    bases = {
        name: GroupBasis(name, np.asarray(matrix, dtype=np.float64), tuple(shapes), keys[name])
        for name, (matrix, shapes) in result["bases"].items()
    }
    intended = {job: result["intended"][index] for job, index in index_of.items()}
    return ModelReference(
        bases, intended, result.get("dtype", "float64"), result.get("refused", "")
    )


def torch_group_basis(
    model: Any,
    fixture: Fixture,
    scheme: str | SchemeSpec,
    forward: Callable[..., Any] | None = None,
) -> GroupBasis:
    """The `GroupBasis` of `fixture` under `scheme`'s units, computed by the torch `model` (an
    unwrapped ``nn.Module`` at the weights the gradient was taken at, in the dtype it has:
    ``model.to(torch.float64)`` for a float64 basis) in this process. `forward(model,
    microbatch)` returns logits [B, T, V] (default: ``model(inputs)``, its ``.logits`` if any);
    parameters are named as ``model.named_parameters()`` names them."""
    from torch_impl.harness.model_reference import default_forward, group_basis

    group_of, units, keys = _groups(fixture, resolve_scheme(scheme))
    matrix, shapes = group_basis(
        model, forward or default_forward, _batch(fixture), group_of, units
    )
    return GroupBasis(fixture.name, matrix, shapes, keys)


def jax_group_basis(
    apply_fn: Callable[..., Any],
    params: Any,
    fixture: Fixture,
    scheme: str | SchemeSpec,
    forward: Callable[..., Any] | None = None,
) -> GroupBasis:
    """`torch_group_basis` for a JAX model: ``apply_fn(params, inputs)`` returns logits (or
    `forward(apply_fn, params, microbatch)` does); parameters are named by their pytree path
    (``jax.tree_util.keystr``). Enable ``jax_enable_x64`` for a float64 basis."""
    from jax_impl.harness.model_reference import default_forward, group_basis

    group_of, units, keys = _groups(fixture, resolve_scheme(scheme))
    matrix, shapes = group_basis(
        apply_fn, params, forward or default_forward, _batch(fixture), group_of, units
    )
    return GroupBasis(fixture.name, matrix, shapes, keys)
