"""The torch side of the objective rows: one launch per world size (DDP on gloo).

Every objective case of a world size runs in one launch of R ranks
(`torch_impl.harness.objective_cases`); the ranks must agree to the bit, and rank 0's
gradient and update log are judged by the parent (`crosscheck.run.objectives`).
"""

from __future__ import annotations

import functools

import numpy as np

from crosscheck.contract.fixture import BATCH_KEYS
from crosscheck.fixtures.builtin import builtin_fixture
from crosscheck.fixtures.objective_params import objective_params
from crosscheck.launch.schedule import Job
from crosscheck.launch.workers import first_disagreeing_rank, report_launch_each
from crosscheck.run.objectives import (
    OBJECTIVES,
    ObjectiveCase,
    ObjectiveOutput,
    OnObjective,
    TermOutput,
)

IMPL = "torch-ddp"
LAUNCH_TIMEOUT_S = 300.0
COLLECTIVE_TIMEOUT_S = 60.0


def _payload(case: ObjectiveCase):
    from torch_impl.harness.objective_cases import ObjectiveCase as TorchCase

    fixture = builtin_fixture(case.fixture)
    return TorchCase(
        label=f"{case.objective} {case.fixture} R={case.world_size},M={case.accum_steps}",
        batch={k: np.asarray(getattr(fixture, k)) for k in BATCH_KEYS},
        params=objective_params(fixture),
        terms=OBJECTIVES[case.objective],
        accum_steps=case.accum_steps,
        vocab_size=fixture.vocab_size,
    )


def _judge(case: ObjectiveCase, per_rank: list) -> ObjectiveOutput:
    first = per_rank[0]
    rank = first_disagreeing_rank(per_rank)
    if rank is None:
        rank = next((r for r, out in enumerate(per_rank) if out.log != first.log), None)
    if rank is not None:
        raise AssertionError(f"{first.label}: rank {rank} ended with another gradient or log")
    return ObjectiveOutput(
        grads=first.grads,
        loss=first.log.loss,
        terms=tuple(
            TermOutput(t.name, t.loss, t.count, tuple(t.denominators)) for t in first.log.terms
        ),
    )


def _run(world_size: int, cases: list[ObjectiveCase], on_done: OnObjective) -> None:
    from torch_impl.harness.objective_cases import run_objective_cases

    report_launch_each(
        run_objective_cases,
        world_size,
        cases,
        _payload,
        _judge,
        on_done,
        timeout_s=LAUNCH_TIMEOUT_S,
        collective_timeout_s=COLLECTIVE_TIMEOUT_S,
    )


def jobs(cases: list[ObjectiveCase], on_done: OnObjective) -> list[Job]:
    """One launch per world size of the torch objective cases."""
    by_size: dict[int, list[ObjectiveCase]] = {}
    for case in cases:
        by_size.setdefault(case.world_size, []).append(case)
    return [
        Job(
            f"{IMPL} objectives R={R}",
            R,
            R * (1.0 + 0.1 * len(group)),
            functools.partial(_run, R, group, on_done),
        )
        for R, group in sorted(by_size.items())
    ]
