"""No false alarm: every correct path of both frameworks is diagnosed as its intended scheme.

Runs the real implementations (torch DDP and FSDP2 processes; JAX pmap, shard_map, global jit
and jax.distributed processes), both strategies, every intended scheme, on a packed and a
ragged fixture at 2 ranks x 2 microbatches, and diagnoses each first-update gradient.
"""

from __future__ import annotations

import pytest

from crosscheck.contract.schemes import INTENDED_SCHEMES
from crosscheck.diagnosis.diagnose import diagnose
from crosscheck.fixtures.builtin import builtin_fixture
from crosscheck.judge.compare import RTOL_BY_DTYPE
from crosscheck.run.implementations import IMPLEMENTATIONS
from crosscheck.run.matrix import run_matrix
from crosscheck.run.plan import Plan


@pytest.fixture(scope="module")
def outputs():
    plan = Plan(
        fixtures=["packed", "ragged"],
        schemes=list(INTENDED_SCHEMES),
        impls=list(IMPLEMENTATIONS),
        world_sizes=[2],
        accum_steps=[2],
        world_size_change=False,
        resume=False,
    )
    run = run_matrix(plan)
    failed = [row for row in run.rows if not row.ok]
    assert not failed, failed[:3]
    return run.outputs


def test_every_correct_path_ran(outputs):
    impls = {case.impl for case in outputs}
    strategies = {(case.impl, case.strategy) for case in outputs}
    assert impls == set(IMPLEMENTATIONS)
    assert ("torch-ddp", "postnorm") in strategies and ("jax-pmap", "postnorm") in strategies
    assert {case.scheme for case in outputs} == set(INTENDED_SCHEMES)


def test_every_correct_path_is_its_intended_scheme(outputs):
    for case, output in sorted(outputs.items()):
        fixture = builtin_fixture(case.fixture)
        d = diagnose(
            fixture, case.world_size, case.accum_steps, output.grads, case.scheme, dtype=case.dtype
        )
        where = case.describe()
        assert d.best_match == case.scheme, (where, d.explanation)
        assert not d.detected, where
        # Scale: the least-squares factor on the intended gradient, 1 up to the tolerance.
        assert abs(d.scale - 1.0) <= RTOL_BY_DTYPE[case.dtype], (where, d.scale)
        assert d.precision == case.dtype, (where, d.residual)
        # The weight ratio is against the intended weights: 1 for a correct step. 1e-9: the
        # recovered weights of a float64 gradient are exact to ~1e-14 (condition number < 10).
        assert abs(d.weight_ratio - 1.0) <= 1e-9, where
