"""``verify --model`` and ``diagnose(basis=...)``: a user's own model, not the analytic one.

A tiny Hugging Face Llama (``examples/torch_hf_model.py``, built from a config, no download)
trained through its own loss path, ``model(input_ids, labels, num_items_in_batch)`` in the HF
Trainer's accumulation loop, and a small Flax causal LM (``examples/jax_flax_model.py``) in a
pmap step. The correct steps pass (float32-level for HF, whose loss upcasts the logits to
float32; float64-exact for the Flax model in float64), the misuses are named. The three torch
steps take the protocol's three forms with the user's model: DDP-wrapped with an optimizer to
step (the update is read back by parameter name), DDP-wrapped, and a ``model_factory`` step
that wraps the model itself.

Time: every verify call here runs one fixture at one layout, ``packed`` at (R, M) = (2, 2):
one reference process and one launch of the step. That layout still names each bug alone:
at R = M = 2 with ranks and microbatches of unequal token counts, rank-mean and
microbatch-mean predict different weights (the run's own diagnosis says "Explains every case"
with that one name), and the verdict's precision shows in every case.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from child_env import ROOT

from crosscheck.contract.schemes import get_scheme
from crosscheck.diagnosis.diagnose import diagnose
from crosscheck.fixtures.builtin import builtin_fixture
from crosscheck.verification.verifier import StepSetupError, verify

ONE_LAYOUT = {"fixtures": ["packed"], "world_sizes": [2], "accum_steps": [2]}
TORCH_MODEL = "examples.torch_hf_model:model"
JAX_MODEL = "examples.jax_flax_model:model"
#: float32-level (crosscheck.diagnosis.verdict): HF's loss is float32 (``logits.float()``); its
#: gradient's worst-leaf error against the float64 reference is about 1e-7 (one rounding of
#: float32 logits), two orders below this.
FLOAT32_TOLERANCE = 1e-5
#: float64-exact: the Flax step computes in float64 throughout; measured 1e-15.
FLOAT64_TOLERANCE = 1e-12


def _cli(
    framework: str, step: str, model: str, json_path, *extra: str
) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "crosscheck",
        "verify",
        "--framework",
        framework,
        "--model",
        model,
        "--step",
        step,
        "--scheme",
        "token_mean",
        "--fixtures",
        "packed",
        "--world-sizes",
        "2",
        "--accum-steps",
        "2",
        "--json",
        str(json_path),
        *extra,
    ]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_hf_model_through_its_own_loss_passes_at_float32_level():
    report = verify(
        "examples.torch_hf_model:step",
        framework="torch",
        scheme="token_mean",
        model=TORCH_MODEL,
        **ONE_LAYOUT,
    )
    message = report.message()
    assert not [case.error for case in report.cases if case.error], message
    assert report.ok, message
    assert report.level == "float32", message
    assert report.max_rel_err < FLOAT32_TOLERANCE, message  # NaN fails too
    assert report.model == TORCH_MODEL and report.to_json()["model"] == TORCH_MODEL
    assert "matches token_mean" in message and "float32-level" in message


def test_hf_model_without_num_items_in_batch_is_microbatch_mean():
    report = verify(
        "examples.torch_hf_model:step_microbatch_mean",
        framework="torch",
        scheme="token_mean",
        model=TORCH_MODEL,
        **ONE_LAYOUT,
    )
    message = report.message()
    assert not report.ok, message
    assert report.best_match == "microbatch-mean", message
    assert report.level == "float32", message
    assert "Explains every case: microbatch-mean." in message


MOE_MODEL = "examples.torch_hf_model:moe_model"


def test_a_moe_model_whose_kernels_refuse_float64_is_verified_at_float32_level():
    """transformers' default Mixtral runs its experts through grouped_mm, which refuses
    float64: the reference and the step run in float32, the report says so, the Trainer's
    loop passes and its microbatch-mean twin is named. The step reads back the update its
    optimizer applied: exactly (its .grad), not as before - after, whose float32 rounding
    alone is 4e-4 of an expert's small gradient."""
    good = verify(
        "examples.torch_hf_model:step",
        framework="torch", scheme="token_mean", model=MOE_MODEL, **ONE_LAYOUT,
    )  # fmt: skip
    bad = verify(
        "examples.torch_hf_model:step_microbatch_mean",
        framework="torch", scheme="token_mean", model=MOE_MODEL, **ONE_LAYOUT,
    )  # fmt: skip
    message = good.message()
    assert good.ok and good.level == "float32", message
    assert good.max_rel_err < FLOAT32_TOLERANCE, message  # NaN fails too
    assert good.model_dtype == "float32" and good.to_json()["model_dtype"] == "float32"
    assert "The model's forward refuses float64 (Expected mat_a to be Float32" in message
    assert all(case.job.dtype == "float32" for case in good.cases)
    assert not bad.ok and bad.best_match == "microbatch-mean", bad.message()


def test_hf_model_with_a_rank_local_count_is_rank_mean_through_the_cli(tmp_path):
    path = tmp_path / "verify.json"
    # With the forward written out (the default's logits, given by name): the option reaches
    # the reference process.
    forward = ("--forward", "examples.torch_hf_model:logits")
    proc = _cli("torch", "examples.torch_hf_model:step_rank_count", TORCH_MODEL, path, *forward)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(path.read_text())
    assert data["model"] == TORCH_MODEL
    assert data["diagnosis"]["best_match"] == "rank-mean"
    assert data["precision"] == "float32"
    assert "Explains every case: rank-mean." in proc.stdout


def test_flax_model_step_passes_through_the_cli(tmp_path):
    path = tmp_path / "verify.json"
    forward = ("--forward", "examples.jax_flax_model:logits")  # reaches the JAX reference
    proc = _cli("jax", "examples.jax_flax_model:step", JAX_MODEL, path, *forward)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(path.read_text())
    assert data["ok"] is True and data["precision"] == "float64"
    assert data["max_rel_err"] < FLOAT64_TOLERANCE
    # The attention's key bias gets no gradient (softmax ignores a shift of every score):
    # it is left out of the worst-leaf error, and said so.
    notes = data["cases"][0]["diagnosis"]["notes"]
    assert "key']['bias']" in notes["group basis"]


def test_flax_model_device_mean_is_rank_mean():
    report = verify(
        "examples.jax_flax_model:step_device_mean",
        framework="jax",
        scheme="token_mean",
        model=JAX_MODEL,
        **ONE_LAYOUT,
    )
    message = report.message()
    assert not report.ok, message
    assert report.best_match == "rank-mean", message
    assert report.level == "float64", message


def test_a_model_factory_that_is_not_repeatable_is_a_setup_error():
    """Refused before any step runs: a factory that is not there (found without a process),
    and one whose two calls give different weights (found by the reference's own check, run
    here in this process as the reference process runs it: a launch would only add time)."""
    with pytest.raises(StepSetupError, match=r"--model examples\.torch_hf_model:modle: .*model"):
        verify(
            "examples.torch_hf_model:step",
            framework="torch",
            scheme="token_mean",
            model="examples.torch_hf_model:modle",
            **ONE_LAYOUT,
        )
    from crosscheck.verification.model_basis import reference_request
    from crosscheck.verification.verifier import jobs_for
    from torch_impl.harness.model_reference import compute_reference

    jobs = jobs_for(**ONE_LAYOUT)
    for factory, refused in (("model_unseeded", True), ("model", False)):
        request, _, _ = reference_request(
            f"examples.torch_hf_model:{factory}", "", jobs, get_scheme("token_mean")
        )
        request["fixtures"], request["weightings"] = {}, []  # the check alone: nothing to compute
        answer = compute_reference(0, 1, request)
        if refused:
            assert "different values of" in answer["setup_error"]
            assert "seed it" in answer["setup_error"]
        else:
            assert "setup_error" not in answer and "error" not in answer, answer


def test_diagnose_a_gradient_of_your_own_model_on_its_group_basis():
    """In this process: the HF model's group basis, and gradients the model itself gives for
    the token mean and for the per-rank mean at R = 2; the diagnosis names each."""
    import torch

    from crosscheck.verification.model_basis import torch_group_basis
    from examples.torch_hf_model import model as hf_model
    from torch_impl.harness.model_reference import default_forward, intended_gradient

    fixture = builtin_fixture("packed")
    llama = hf_model().to(torch.float64)
    basis = torch_group_basis(llama, fixture, "token_mean")
    arrays = {key: np.asarray(getattr(fixture, key)) for key in ("inputs", "targets")}
    batch = fixture.layout(2, 2)
    for scheme, named in (("token_mean", "token_mean"), ("rank_mean", "rank-mean")):
        weights = batch.to_global(get_scheme(scheme).effective_weights(batch))
        grads = intended_gradient(llama, default_forward, arrays, weights)
        result = diagnose(fixture, 2, 2, grads, "token_mean", basis=basis)
        assert result.best_match == named, result.explanation
        # float32-level, not float64: Llama computes its rotary cos / sin in float32 even in a
        # float64 model, and a float32 cos of a whole batch differs from a row's by an ulp
        # (vectorized loops): the basis (row by row) and the gradient (the batch) differ by
        # about 6e-8, rounding that the float64 judgement rightly does not call exact.
        assert result.precision == "float32" and result.residual < FLOAT32_TOLERANCE
    with pytest.raises(ValueError, match="computed for fixture 'packed'"):
        diagnose(builtin_fixture("ragged"), 2, 2, grads, "token_mean", basis=basis)


@pytest.mark.parametrize("scheme", ["token_mean", "weighted_mean"])
def test_a_group_basis_of_the_analytic_model_diagnoses_as_its_jacobian_does(scheme):
    """The oracle's own group basis (its Jacobian summed per group) through ``basis=``: the
    same names, fits and weights as the Jacobian path, for the intended gradient and two
    bugs, so the basis path changes nothing but where B comes from."""
    from crosscheck.contract.oracle import token_jacobian
    from crosscheck.diagnosis.group_basis import GroupBasis, token_groups, token_units
    from crosscheck.diagnosis.verdict import jacobian_group_basis

    fixture = builtin_fixture("ragged")
    params = fixture.params()
    units = token_units(fixture, get_scheme(scheme))
    group_of, keys = token_groups(fixture, 1, 1, units)
    jacobian = token_jacobian(params, fixture.inputs, fixture.targets)
    valid = fixture.valid
    matrix, _ = jacobian_group_basis(jacobian, group_of[valid], units[valid], len(keys))
    shapes = tuple((name, np.shape(params[name])) for name in sorted(params))
    groups = np.array([(key.row, key.segment) for key in keys]).reshape(-1, 2)
    basis = GroupBasis("ragged", matrix, shapes, groups)
    batch = fixture.layout(2, 2)
    for produced in (scheme, "rank_mean", "microbatch_mean"):
        weights = batch.to_global(get_scheme(produced).effective_weights(batch))
        flat, grads, start = weights[valid] @ jacobian, {}, 0
        for name, shape in shapes:
            grads[name] = flat[start : start + int(np.prod(shape))].reshape(shape)
            start += int(np.prod(shape))
        by_jacobian = diagnose(fixture, 2, 2, grads, scheme)
        by_basis = diagnose(fixture, 2, 2, grads, scheme, basis=basis)
        assert by_basis.best_match == by_jacobian.best_match, produced
        assert by_basis.detected is by_jacobian.detected is (produced != scheme)
        assert set(by_basis.fits) <= set(by_jacobian.fits), produced
        # The same least squares on the same B: equal weights up to float64 rounding.
        recovered = np.array([g.weight for g in by_basis.groups])
        expected = np.array([g.weight for g in by_jacobian.groups])
        assert np.max(np.abs(recovered - expected)) <= 1e-12 * np.max(np.abs(expected))
    # NaN never passes, on a basis as on the Jacobian.
    grads["embed"][0, 0] = np.nan
    broken = diagnose(fixture, 2, 2, grads, scheme, basis=basis)
    assert broken.detected and "NaN in embed[0, 0]" in broken.unusable


def test_the_update_an_optimizer_applied_is_read_exactly():
    """In-process, a float32 parameter of 1e3 with a gradient of 1e-4 stepped by SGD(lr=1):
    before - after carries float32's rounding of 1e3 (6e-5 absolute, over half the
    gradient); the .grad left in place is what SGD applied and is read instead, exactly. A
    .grad changed after the step is not what was applied: then the difference is read."""
    import torch

    from torch_impl.harness.step_gradient import _applied_update

    param = torch.nn.Parameter(torch.full((4,), 1000.0, dtype=torch.float32))
    before = param.detach().to(torch.float64).numpy().copy()
    param.grad = torch.full((4,), 1e-4, dtype=torch.float32)
    torch.optim.SGD([param], lr=1.0).step()
    read = _applied_update(param, before)
    assert np.array_equal(read, param.grad.to(torch.float64).numpy())
    difference = before - param.detach().to(torch.float64).numpy()
    assert not np.allclose(difference, read, rtol=1e-3)  # the rounding the exact read avoids
    param.grad.mul_(3.0)  # changed after stepping: no longer what SGD applied
    assert np.array_equal(_applied_update(param, before), difference)
