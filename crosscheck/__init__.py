"""crosscheck: does a loss weight tokens the way it should under data parallelism?

The framework-neutral side of gradweight: the normalization contract (schemes), fixtures and
layouts, the float64 oracle with its update math, comparison, diagnosis of any gradient's
weighting, and the command line. The JAX and torch implementations live in `jax_impl` and
`torch_impl` and are imported only when run.

Importing `crosscheck` changes nothing global and imports nothing heavy: the names below are
loaded from their modules on first use (PEP 562 ``__getattr__``). That is what lets
``python -m crosscheck`` (whose package is imported before its ``__main__``) give the
command-line process a single BLAS thread before numpy loads, while a program that imports
crosscheck keeps its own environment (see `crosscheck.__main__`).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

#: Public name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    "BUILTIN_FIXTURES": "crosscheck.catalogue",
    "builtin_fixture": "crosscheck.catalogue",
    "random_fixture": "crosscheck.catalogue",
    "FLOAT32_RTOL": "crosscheck.compare",
    "FLOAT64_RTOL": "crosscheck.compare",
    "assert_tree_close": "crosscheck.compare",
    "tree_rel_err": "crosscheck.compare",
    "Diagnosis": "crosscheck.diagnose",
    "diagnose": "crosscheck.diagnose",
    "Fixture": "crosscheck.fixtures",
    "FixtureError": "crosscheck.fixtures",
    "IGNORE_INDEX": "crosscheck.layout",
    "LaidOutBatch": "crosscheck.layout",
    "Layout": "crosscheck.layout",
    "Microbatch": "crosscheck.layout",
    "AdamWConfig": "crosscheck.optimizers",
    "SGDConfig": "crosscheck.optimizers",
    "clip_by_global_norm": "crosscheck.optimizers",
    "train": "crosscheck.optimizers",
    "OracleResult": "crosscheck.oracle",
    "loss_and_grad": "crosscheck.oracle",
    "log_denominator": "crosscheck.protocol",
    "ACCIDENTAL_SCHEMES": "crosscheck.schemes",
    "INTENDED_SCHEMES": "crosscheck.schemes",
    "SCHEMES": "crosscheck.schemes",
    "Scheme": "crosscheck.schemes",
    "effective_weights": "crosscheck.schemes",
    "get_scheme": "crosscheck.schemes",
    # `verify` itself stays crosscheck.verify.verify: binding the function here would shadow
    # the crosscheck.verify module for `import crosscheck.verify as ...` and for mock.patch.
    "VerifyReport": "crosscheck.verify",
    "assert_weighting": "crosscheck.verify",
}

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time `__getattr__` loads these
    from crosscheck.catalogue import BUILTIN_FIXTURES, builtin_fixture, random_fixture
    from crosscheck.compare import FLOAT32_RTOL, FLOAT64_RTOL, assert_tree_close, tree_rel_err
    from crosscheck.diagnose import Diagnosis, diagnose
    from crosscheck.fixtures import Fixture, FixtureError
    from crosscheck.layout import IGNORE_INDEX, LaidOutBatch, Layout, Microbatch
    from crosscheck.optimizers import AdamWConfig, SGDConfig, clip_by_global_norm, train
    from crosscheck.oracle import OracleResult, loss_and_grad
    from crosscheck.protocol import log_denominator
    from crosscheck.schemes import (
        ACCIDENTAL_SCHEMES,
        INTENDED_SCHEMES,
        SCHEMES,
        Scheme,
        effective_weights,
        get_scheme,
    )
    from crosscheck.verify import VerifyReport, assert_weighting

__all__ = [
    "ACCIDENTAL_SCHEMES",
    "BUILTIN_FIXTURES",
    "FLOAT32_RTOL",
    "FLOAT64_RTOL",
    "IGNORE_INDEX",
    "INTENDED_SCHEMES",
    "SCHEMES",
    "AdamWConfig",
    "Diagnosis",
    "Fixture",
    "FixtureError",
    "LaidOutBatch",
    "Layout",
    "Microbatch",
    "OracleResult",
    "SGDConfig",
    "Scheme",
    "VerifyReport",
    "assert_tree_close",
    "assert_weighting",
    "builtin_fixture",
    "clip_by_global_norm",
    "diagnose",
    "effective_weights",
    "get_scheme",
    "log_denominator",
    "loss_and_grad",
    "random_fixture",
    "train",
    "tree_rel_err",
]


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use; or a submodule, imported (as the
    eager imports of earlier versions made ``crosscheck.verify`` and the like available)."""
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value  # later look-ups are plain attribute reads
        return value
    if not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


class _Package(types.ModuleType):
    """The package module: a submodule bound as an attribute keeps an exported name.

    The import system sets ``crosscheck.diagnose`` to the submodule once crosscheck.diagnose
    is imported; the exported name is the function, as it was when this package imported it
    eagerly. Whatever imports the submodule first, the function stays the attribute.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _EXPORTS.get(name) == value.__name__:
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
