"""The global batch a buggy step is given: the fixture's token arrays and its v2 row fields.

A buggy loop receives the batch as plain [N, T] numpy arrays (``BATCH_KEYS``), the way a
launch sends them (`crosscheck.launch.workers.launch_arrays`). Contract v2's patterns need more
than the tokens: ``local-group-count`` reads each row's prompt group. So the batch carries
every array the fixture's file holds (`Fixture.npz_arrays`) except the params: the v2 fields
(``group_ids``, ``document_ids``, ``row_weights``, ``sample_mask``) only where the fixture
gives them, so a v1 fixture's batch is exactly what it was.
"""

from __future__ import annotations

import numpy as np

from crosscheck.contract.fixture import PARAM_KEYS
from crosscheck.fixtures.builtin import builtin_fixture
from crosscheck.launch.workers import launch_arrays


def bug_batch(fixture_name: str) -> dict[str, np.ndarray]:
    """The fixture's batch arrays, read-only and shared (not copied), v2 fields included."""
    fixture = builtin_fixture(fixture_name)
    return {
        key: np.asarray(array)
        for key, array in fixture.npz_arrays().items()
        if key not in PARAM_KEYS
    }


def bug_arrays(fixture_name: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(batch, params) as a launch sends them: `launch_arrays` with the v2 fields added."""
    _, params = launch_arrays(fixture_name)
    return bug_batch(fixture_name), params
