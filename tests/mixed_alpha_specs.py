"""Power-sum specs whose weight and denominator exponents differ, read by tests/spec_reader.py.

Every named power-sum spec gives a_t and D the same alpha (length_power: n^-0.5 over the sum of
n^-0.5), so a reading that raises D's counts to the weight's alpha instead of the
denominator's own gives the same numbers on all of them and survives every cross-check. These
specs tell the two exponents apart; the numpy oracle (tests/test_spec.py), torch
(tests/test_torch_spec.py) and JAX (tests/jax_spec_oracle.py) are each held to the reader's
token weights on them. Only the specs are shared here: each side's reading is its own.
"""

from __future__ import annotations

import numpy as np
from spec_reader import spec_weights

from crosscheck.contract.fixture import Fixture
from crosscheck.contract.row_fields import ROW_FIELD_KEYS
from crosscheck.contract.spec import get_spec

MIXED_ALPHA_SPECS: dict[str, dict] = {
    # Groups weighted n^-0.5, D summing n^-2 over the groups of the update.
    "power_group_half_over_squares": {
        "weight": {"group": "group", "alpha": 0.5},
        "denominator": {"kind": "power_sum", "group": "group", "alpha": 2.0},
    },
    # Documents counted per rank, each 1/n, D the sum of n^-0.5 of those rank pieces.
    "power_document_rank_mean_over_roots": {
        "weight": {"group": "document", "count_scope": "rank"},
        "denominator": {"kind": "power_sum", "group": "document", "alpha": 0.5},
    },
    # Segments weighted n^-2, D per microbatch the number of its segments' n^-1 terms.
    "power_segment_squares_per_microbatch": {
        "weight": {"group": "segment", "alpha": 2.0},
        "denominator": {"kind": "power_sum", "group": "segment", "alpha": 1.0},
        "scope": "microbatch",
    },
}


def reader_weights(fixture: Fixture, spec: dict, R: int, M: int) -> np.ndarray:
    """c_t [N, T] of `spec` (its defaults filled in by the parser) as the reader computes it."""
    keys = ("inputs", "targets", "segment_ids", "weights", *ROW_FIELD_KEYS)
    arrays = {key: getattr(fixture, key) for key in keys}
    c, _ = spec_weights(arrays, get_spec(spec).to_dict(), R, M)
    return c
