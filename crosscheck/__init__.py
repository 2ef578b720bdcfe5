"""crosscheck: does a loss weight tokens the way it should under data parallelism?

The framework-neutral side of gradweight. Its subpackages follow the data flow, each importing
only those before it:

    contract      layout, schemes, fixture type, float64 oracle, optimizers, result rows
    fixtures      built-in fixtures, portable test vectors
    judge         tolerances and comparison, layout invariance, clipping placement
    diagnosis     the effective weighting of any gradient, and the name of what produced it
    launch        processes and jobs: scheduling, stopping everything on a signal
    run           `crosscheck run`: the matrix and its drivers
    bugs          `crosscheck bugs`: the bug catalogue run
    verification  `crosscheck verify`: a user's own step, judged
    cli           the command line and its reports

The public API is the names below. Verify a step::

    import crosscheck
    report = crosscheck.verify("my_pkg.train:step", framework="torch", scheme="token_mean")
    assert report.ok, report

or diagnose a gradient computed anywhere: ``crosscheck.diagnose(fixture, R, M, grads,
"token_mean")``. For a test suite, ``crosscheck.assert_weighting`` raises AssertionError with
the diagnosis, and the pytest plugin (`crosscheck.pytest_plugin`, registered on install) offers
it as the fixture ``gradweight``. `framework` is a `Framework`, ``"torch"`` or ``"jax"``.

``pip install gradweight`` brings numpy and rich: enough for the oracle, `diagnose` and
``crosscheck run --impls oracle``. Running a step (`verify`, the other implementations,
``crosscheck bugs``) needs its framework: the extra ``gradweight[torch]`` or
``gradweight[jax]``; ``gradweight[plot]`` adds matplotlib for ``crosscheck run --plot``. The
packages are typed (``py.typed``).

Importing `crosscheck` changes nothing global and imports nothing heavy: the names below are
loaded from their modules on first use (PEP 562 ``__getattr__``). That is what lets
``python -m crosscheck`` (whose package is imported before its ``__main__``) give the
command-line process a single BLAS thread before numpy loads, while a program that imports
crosscheck keeps its own environment (see `crosscheck.__main__`). The JAX and torch
implementations live in `jax_impl` and `torch_impl`, imported only when a step runs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: Public name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    # verify a training step
    "verify": "crosscheck.verification.verifier",
    "assert_weighting": "crosscheck.verification.verifier",
    "Framework": "crosscheck.verification.verifier",
    "VerifyReport": "crosscheck.verification.report",
    "VerifyCase": "crosscheck.verification.report",
    "StepSetupError": "crosscheck.verification.step_check",
    "StepError": "crosscheck.verification.protocol",
    "log_denominator": "crosscheck.verification.protocol",
    # diagnose any gradient
    "diagnose": "crosscheck.diagnosis.diagnose",
    "Diagnosis": "crosscheck.diagnosis.result",
    # diagnose a gradient of your own model: its group basis
    "GroupBasis": "crosscheck.diagnosis.group_basis",
    "torch_group_basis": "crosscheck.verification.model_basis",
    "jax_group_basis": "crosscheck.verification.model_basis",
    # the schemes: each a SchemeSpec, the normalization of an objective as data
    "SchemeSpec": "crosscheck.contract.spec",
    "get_spec": "crosscheck.contract.spec",
    "resolve_scheme": "crosscheck.contract.schemes",
    "TokenMean": "crosscheck.contract.schemes",
    "SequenceMean": "crosscheck.contract.schemes",
    "RowMean": "crosscheck.contract.schemes",
    "WeightedMean": "crosscheck.contract.schemes",
    "Constant": "crosscheck.contract.schemes",
    "Sum": "crosscheck.contract.schemes",
    "RankMean": "crosscheck.contract.schemes",
    "MicrobatchMean": "crosscheck.contract.schemes",
    "SCHEMES": "crosscheck.contract.schemes",
    "INTENDED_SCHEMES": "crosscheck.contract.schemes",
    "ACCIDENTAL_SCHEMES": "crosscheck.contract.schemes",
    "get_scheme": "crosscheck.contract.schemes",
    "effective_weights": "crosscheck.contract.schemes",
    # fixtures and layouts
    "Fixture": "crosscheck.contract.fixture",
    "FixtureError": "crosscheck.contract.fixture",
    "IGNORE_INDEX": "crosscheck.contract.layout",
    "LaidOutBatch": "crosscheck.contract.layout",
    "Layout": "crosscheck.contract.layout",
    "Microbatch": "crosscheck.contract.layout",
    "BUILTIN_FIXTURES": "crosscheck.fixtures.builtin",
    "builtin_fixture": "crosscheck.fixtures.builtin",
    "random_fixture": "crosscheck.fixtures.builtin",
    # the float64 oracle and its update
    "loss_and_grad": "crosscheck.contract.oracle",
    "OracleResult": "crosscheck.contract.oracle",
    "train": "crosscheck.contract.optimizers",
    "AdamWConfig": "crosscheck.contract.optimizers",
    "SGDConfig": "crosscheck.contract.optimizers",
    "clip_by_global_norm": "crosscheck.contract.optimizers",
    # comparison
    "tree_rel_err": "crosscheck.judge.compare",
    "assert_tree_close": "crosscheck.judge.compare",
    "FLOAT32_RTOL": "crosscheck.judge.compare",
    "FLOAT64_RTOL": "crosscheck.judge.compare",
}

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time `__getattr__` loads these
    from crosscheck.contract.fixture import Fixture, FixtureError
    from crosscheck.contract.layout import IGNORE_INDEX, LaidOutBatch, Layout, Microbatch
    from crosscheck.contract.optimizers import AdamWConfig, SGDConfig, clip_by_global_norm, train
    from crosscheck.contract.oracle import OracleResult, loss_and_grad
    from crosscheck.contract.schemes import (
        ACCIDENTAL_SCHEMES,
        INTENDED_SCHEMES,
        SCHEMES,
        Constant,
        MicrobatchMean,
        RankMean,
        RowMean,
        SequenceMean,
        Sum,
        TokenMean,
        WeightedMean,
        effective_weights,
        get_scheme,
        resolve_scheme,
    )
    from crosscheck.contract.spec import SchemeSpec, get_spec
    from crosscheck.diagnosis.diagnose import diagnose
    from crosscheck.diagnosis.group_basis import GroupBasis
    from crosscheck.diagnosis.result import Diagnosis
    from crosscheck.fixtures.builtin import BUILTIN_FIXTURES, builtin_fixture, random_fixture
    from crosscheck.judge.compare import FLOAT32_RTOL, FLOAT64_RTOL, assert_tree_close, tree_rel_err
    from crosscheck.verification.model_basis import jax_group_basis, torch_group_basis
    from crosscheck.verification.protocol import StepError, log_denominator
    from crosscheck.verification.report import VerifyCase, VerifyReport
    from crosscheck.verification.step_check import StepSetupError
    from crosscheck.verification.verifier import Framework, assert_weighting, verify

__all__ = [
    "ACCIDENTAL_SCHEMES",
    "BUILTIN_FIXTURES",
    "FLOAT32_RTOL",
    "FLOAT64_RTOL",
    "IGNORE_INDEX",
    "INTENDED_SCHEMES",
    "SCHEMES",
    "AdamWConfig",
    "Constant",
    "Diagnosis",
    "Fixture",
    "FixtureError",
    "Framework",
    "GroupBasis",
    "LaidOutBatch",
    "Layout",
    "Microbatch",
    "MicrobatchMean",
    "OracleResult",
    "RankMean",
    "RowMean",
    "SGDConfig",
    "SchemeSpec",
    "SequenceMean",
    "StepError",
    "StepSetupError",
    "Sum",
    "TokenMean",
    "VerifyCase",
    "VerifyReport",
    "WeightedMean",
    "assert_tree_close",
    "assert_weighting",
    "builtin_fixture",
    "clip_by_global_norm",
    "diagnose",
    "effective_weights",
    "get_scheme",
    "get_spec",
    "jax_group_basis",
    "log_denominator",
    "loss_and_grad",
    "random_fixture",
    "resolve_scheme",
    "torch_group_basis",
    "train",
    "tree_rel_err",
    "verify",
]


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
