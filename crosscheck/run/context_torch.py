"""The torch side of the context-parallel rows: one launch per process count R C (gloo).

Every case of a process count runs in one launch (`torch_impl.harness.context_cases`): DDP
over all the processes or FSDP2 over the flattened dimensions of a 2-D ("dp", "cp")
DeviceMesh. The processes must hold the same gradient to the bit; the parent judges it with
every process's valid targets (`crosscheck.run.context_parallel`).
"""

from __future__ import annotations

import functools

import numpy as np

from crosscheck.contract.fixture import BATCH_KEYS, ROW_FIELD_KEYS
from crosscheck.fixtures.builtin import builtin_fixture
from crosscheck.launch.schedule import Job
from crosscheck.launch.workers import first_disagreeing_rank, report_launch_each
from crosscheck.run.context_parallel import (
    TORCH_WRAPPERS,
    ContextCase,
    ContextOutput,
    OnContext,
)

LAUNCH_TIMEOUT_S = 300.0
COLLECTIVE_TIMEOUT_S = 60.0


def _payload(case: ContextCase):
    from torch_impl.harness.context_cases import ContextCase as TorchCase

    fixture = builtin_fixture(case.fixture)
    R, M, C, order = case.layout
    return TorchCase(
        label=f"{case.impl} {case.scheme} {case.fixture} R={R},M={M},C={C} {order}",
        batch={key: np.asarray(getattr(fixture, key)) for key in (*BATCH_KEYS, *ROW_FIELD_KEYS)},
        params=fixture.params(),
        scheme=case.scheme,
        wrapper=TORCH_WRAPPERS[case.impl],
        world_size=R,
        accum_steps=M,
        context_size=C,
        context_order=order,
        vocab_size=fixture.vocab_size,
    )


def _judge(case: ContextCase, per_process: list) -> ContextOutput:
    process = first_disagreeing_rank(per_process)
    if process is not None:
        raise AssertionError(f"{per_process[0].label}: process {process} holds another gradient")
    return ContextOutput(per_process[0].grads, tuple(out.valid_tokens for out in per_process))


def _run(processes: int, cases: list[ContextCase], on_done: OnContext) -> None:
    from torch_impl.harness.context_cases import run_context_cases

    report_launch_each(
        run_context_cases,
        processes,
        cases,
        _payload,
        _judge,
        on_done,
        timeout_s=LAUNCH_TIMEOUT_S,
        collective_timeout_s=COLLECTIVE_TIMEOUT_S,
    )


def jobs(cases: list[ContextCase], on_done: OnContext) -> list[Job]:
    """One launch per process count R C of the torch context-parallel cases."""
    by_processes: dict[int, list[ContextCase]] = {}
    for case in cases:
        if case.impl in TORCH_WRAPPERS:
            by_processes.setdefault(case.world_size * case.context_size, []).append(case)
    return [
        Job(
            f"torch context-parallel rows R x C={P}",
            P,
            P * (1.0 + 0.02 * len(group)),
            functools.partial(_run, P, group, on_done),
        )
        for P, group in sorted(by_processes.items())
    ]
