"""crosscheck: does a loss weight tokens the way it should under data parallelism?

The framework-neutral side of gradweight: the normalization contract (schemes), fixtures and
layouts, the float64 oracle with its update math, comparison, diagnosis of any gradient's
weighting, and the command line. The JAX and torch implementations live in `jax_impl` and
`torch_impl` and are imported only when run.
"""

import os as _os

# One BLAS thread unless the caller chose otherwise (numpy reads this when it is first
# imported): the oracle multiplies matrices of a few thousand by 40 entries, where extra
# OpenBLAS threads add nothing but spin, and a harness run shares its cores with the worker
# processes it starts (seen: 2x the CPU time for the same wall time on a 2-core machine).
_os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

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

# `verify` itself stays crosscheck.verify.verify: binding the function here would shadow the
# crosscheck.verify module for `import crosscheck.verify as ...` and for mock.patch paths.
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
