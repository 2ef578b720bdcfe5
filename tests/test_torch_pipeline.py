"""Pipeline parallel in torch (torch_impl.pipeline) vs the oracle, float64, on gloo processes.

Two stages (``embed`` on stage 0; ``unembed``, the labels and the loss on stage 1), R = 1 and
2 data-parallel pipelines (2 and 4 processes), M = 2 microbatches, GPipe and 1F1B, precount
(D counted on the last stage and scaled into the loss before the backward) and postnorm (the
unnormalized backward, D sent from the last stage to the first, each stage dividing its own
gradient), every scheme of the catalogue on ``packed``, ``rollouts`` and
``continued-documents``: each stage's gradient against the oracle's for its parameter. The
count that reaches only the last stage (torchtitan#4194's shape) leaves the first stage's
gradient D times too big; the bug catalogue names it (docs/bugs.md).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from context_parallel_cases import FIELDS, FIXTURES, scheme_names

from crosscheck.contract.oracle import loss_and_grad
from crosscheck.fixtures.builtin import builtin_fixture
from torch_impl.batch import rank_microbatches
from torch_impl.harness.launcher import launch
from torch_impl.pipeline import (
    NUM_STAGES,
    SCHEDULES,
    STAGE_PARAMS,
    STRATEGIES,
    PipelinePosition,
    Stage,
    pipeline_update,
)

# float64 on both sides from the same exact counts; the stages' sums in another order.
RTOL = 1e-12
DENOMINATOR_RTOL = 1e-14
ACCUM_STEPS = 2
DATA_PARALLEL = (1, 2)
LAUNCH_TIMEOUT_S = 240.0


def _updates(process: int, processes: int) -> dict:
    """On each process: its stage's gradient for every fixture, scheme, schedule and strategy,
    and one postnorm update whose count never reaches stage 0."""
    torch.set_num_threads(1)
    position = PipelinePosition(process, processes // NUM_STAGES)
    R = position.data_parallel_size
    out = {}
    for fixture_name in FIXTURES:
        fixture = builtin_fixture(fixture_name)
        batch = {key: getattr(fixture, key) for key in FIELDS}
        microbatches = rank_microbatches(batch, position.data_rank, R, ACCUM_STEPS)
        name = STAGE_PARAMS[position.stage]
        stage = Stage(name, fixture.params()[name])
        cases = [(s, sch, st) for s in scheme_names() for sch in SCHEDULES for st in STRATEGIES]
        for scheme, schedule, strategy in cases:
            result = pipeline_update(
                stage, microbatches, scheme, position=position, schedule=schedule,
                strategy=strategy,
            )  # fmt: skip
            out[fixture_name, scheme, schedule, strategy] = result
        out[fixture_name, "count-on-last-stage-only"] = pipeline_update(
            stage,
            microbatches,
            "token_mean",
            position=position,
            strategy="postnorm",
            count_to_first_stage=False,
        )
    return out


@functools.cache
def launched(processes: int) -> list[dict]:
    return launch(_updates, processes, timeout_s=LAUNCH_TIMEOUT_S)


def rel_err(actual: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(actual - expected).max() / np.abs(expected).max())


@pytest.mark.parametrize("fixture_name", FIXTURES)
@pytest.mark.parametrize("R", DATA_PARALLEL)
def test_every_stage_holds_the_oracles_gradient(R: int, fixture_name: str) -> None:
    outputs = launched(R * NUM_STAGES)
    fixture = builtin_fixture(fixture_name)
    problems = []
    for scheme in scheme_names():
        expected = loss_and_grad(fixture, scheme, R, ACCUM_STEPS)
        for schedule in SCHEDULES:
            for strategy in STRATEGIES:
                for process, out in enumerate(outputs):
                    got = out[fixture_name, scheme, schedule, strategy]
                    error = rel_err(got.grad, expected.grads[got.name])
                    if not error <= RTOL:
                        problems.append(
                            f"{scheme} {schedule} {strategy} process {process} ({got.name}): "
                            f"{error:.2e}"
                        )
                    # The last stage always knows D; stage 0 only under postnorm.
                    knows = got.stage == NUM_STAGES - 1 or strategy == "postnorm"
                    # Counts are exact; a sum of powers (length_power's n^-alpha) is added in
                    # another order: an ulp or two.
                    off = abs(got.denominator - expected.denominator)
                    if knows and not off <= DENOMINATOR_RTOL * abs(expected.denominator):
                        problems.append(
                            f"{scheme} {schedule} {strategy} process {process}: D "
                            f"{got.denominator} vs the oracle's {expected.denominator}"
                        )
    assert not problems, f"{len(problems)} problem(s):\n" + "\n".join(problems[:30])


@pytest.mark.parametrize("R", DATA_PARALLEL)
def test_a_count_that_reaches_the_last_stage_only_inflates_the_first(R: int) -> None:
    """postnorm without the count sent down: unembed is right, embed is D times too big."""
    outputs = launched(R * NUM_STAGES)
    for fixture_name in FIXTURES:
        expected = loss_and_grad(builtin_fixture(fixture_name), "token_mean", R, ACCUM_STEPS)
        D = expected.denominator
        for out in outputs:
            got = out[fixture_name, "count-on-last-stage-only"]
            factor = D if got.name == "embed" else 1.0
            assert rel_err(got.grad, factor * expected.grads[got.name]) <= RTOL, got.name


def test_bad_schedule_or_strategy_is_refused_before_any_communication() -> None:
    stage = Stage("embed", np.zeros((4, 2)))
    position = PipelinePosition(0, 1)
    with pytest.raises(ValueError, match="schedule must be one of"):
        pipeline_update(stage, [], "token_mean", position=position, schedule="interleaved")
    with pytest.raises(ValueError, match="postnorm's bug"):
        pipeline_update(stage, [], "token_mean", position=position, count_to_first_stage=False)
