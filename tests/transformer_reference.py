"""The intended objective's token weights for the transformer checks (numpy only).

c_t = a_t / D [N, T] of a built-in fixture's global batch, from the numpy oracle's scheme
objects (`crosscheck.contract` schemes and specs): the single-process reference of
tests/test_transformer_torch.py and tests/transformer_jax_runner.py is sum_t c_t l_t.
"""

from __future__ import annotations

import numpy as np

from crosscheck import builtin_fixture
from crosscheck.contract.schemes import resolve_scheme


def intended_weights(fixture_name: str, scheme: str) -> np.ndarray:
    """c_t [N, T] float64; an intended scheme's weights do not depend on the layout, so
    (1, 1) gives every layout's (the oracle's own tests check that invariance)."""
    laid_out = builtin_fixture(fixture_name).layout(1, 1)
    return laid_out.to_global(resolve_scheme(scheme).effective_weights(laid_out))
