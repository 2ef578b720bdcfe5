"""One process group per world size for the torch tests: every case of that size, run once.

Spawning R processes and joining them into a gloo group costs seconds on a 2-core machine, so
the tests do not launch per case. `world_results(R)` builds every case that needs R ranks
(the full matrix of fixtures x layouts x schemes x strategies x dtypes, the plain mean-loss
loop, FSDP2, a wrong-s precount, an empty update), runs them all in one launch and caches the
per-rank outputs for the session; the test modules then compare them with the oracle.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import numpy as np

from crosscheck import (
    BUILTIN_FIXTURES,
    INTENDED_SCHEMES,
    AdamWConfig,
    Fixture,
    SGDConfig,
    builtin_fixture,
)
from crosscheck.contract.layout import IGNORE_INDEX
from crosscheck.contract.optimizers import OptimizerConfig, UpdateRecord, train
from torch_impl.harness.cases import RankOutput, UpdateCase, run_cases
from torch_impl.harness.launcher import launch
from torch_impl.optimizers import OptimizerSpec

WORLD_SIZES = (1, 2, 3, 4)
ACCUM_STEPS = (1, 2, 4)
STRATEGIES = ("precount", "postnorm")
DTYPES = ("float64", "float32")
NUM_UPDATES = 2
ADAMW = AdamWConfig()
SGD = SGDConfig()
# Between the mean schemes' gradient norms (0.04 to 0.6 on the built-in fixtures) so that
# clipping is active for some cases (every `sum`, several `sequence_mean`) and not for others.
MAX_GRAD_NORM = 0.3
#: Every launch must finish within this: the largest (R = 4) runs in well under a minute.
LAUNCH_TIMEOUT_S = 240.0


@functools.cache
def oracle_updates(
    fixture: str,
    scheme: str,
    world_size: int,
    accum_steps: int,
    num_updates: int = NUM_UPDATES,
    optimizer: OptimizerConfig = ADAMW,
    max_grad_norm: float = MAX_GRAD_NORM,
) -> list[UpdateRecord]:
    """The oracle's `num_updates` updates of a built-in fixture, clipped the way torch's
    clip_grad_norm_ clips (AdamW and MAX_GRAD_NORM unless told otherwise)."""
    return train(
        builtin_fixture(fixture),
        scheme,
        world_size,
        accum_steps,
        num_updates=num_updates,
        optimizer=optimizer,
        max_grad_norm=max_grad_norm,
        clip_convention="torch",
    )


def adamw_spec(config: AdamWConfig = ADAMW) -> OptimizerSpec:
    return OptimizerSpec(
        name="adamw",
        learning_rate=config.learning_rate,
        b1=config.b1,
        b2=config.b2,
        eps=config.eps,
        weight_decay=config.weight_decay,
    )


def sgd_spec(config: SGDConfig = SGD) -> OptimizerSpec:
    return OptimizerSpec(name="sgd", learning_rate=config.learning_rate)


@dataclass(frozen=True, slots=True)
class MatrixCase:
    """A point of the acceptance grid (the test id is its label)."""

    fixture: str
    world_size: int
    accum_steps: int
    scheme: str
    strategy: str
    dtype: str

    @property
    def label(self) -> str:
        return (
            f"{self.fixture}-R{self.world_size}-M{self.accum_steps}-{self.scheme}-"
            f"{self.strategy}-{self.dtype}"
        )


def layouts(fixture: Fixture, world_size: int) -> list[int]:
    """The accumulation steps of ACCUM_STEPS that lay `fixture` out over `world_size` ranks."""
    return [M for M in ACCUM_STEPS if fixture.num_rows % (world_size * M) == 0]


def matrix(world_size: int) -> list[MatrixCase]:
    """Every intended scheme x strategy x dtype on every fixture layout of this world size."""
    return [
        MatrixCase(name, world_size, M, scheme, strategy, dtype)
        for name in BUILTIN_FIXTURES
        for M in layouts(builtin_fixture(name), world_size)
        for scheme in INTENDED_SCHEMES
        for strategy in STRATEGIES
        for dtype in DTYPES
    ]


def mean_loss_matrix(world_size: int) -> list[tuple[str, int, str]]:
    """(fixture, M, dtype) for the plain reduction="mean" loop on every layout."""
    return [
        (name, M, dtype)
        for name in BUILTIN_FIXTURES
        for M in layouts(builtin_fixture(name), world_size)
        for dtype in DTYPES
    ]


def batch_of(fixture: Fixture) -> dict[str, np.ndarray]:
    return {k: getattr(fixture, k) for k in ("inputs", "targets", "segment_ids", "weights")}


@functools.cache
def no_loss_fixture() -> Fixture:
    """`ragged` with every target ignored: D = 0 for every mean scheme; the gradient is 0."""
    base = builtin_fixture("ragged")
    return replace(
        base,
        name="no-loss",
        description="no token carries a loss anywhere in the update",
        targets=np.full_like(base.targets, IGNORE_INDEX),
    )


def _case(fixture: Fixture, label: str, **kwargs) -> UpdateCase:
    kwargs.setdefault("optimizer", adamw_spec())
    kwargs.setdefault("num_updates", NUM_UPDATES)
    kwargs.setdefault("max_grad_norm", MAX_GRAD_NORM)
    return UpdateCase(label=label, batch=batch_of(fixture), params=fixture.params(), **kwargs)


def cases_for(world_size: int) -> list[UpdateCase]:
    """Everything the torch tests run at this world size, in one list."""
    cases = [
        _case(
            builtin_fixture(c.fixture),
            c.label,
            scheme=c.scheme,
            strategy=c.strategy,
            accum_steps=c.accum_steps,
            dtype=c.dtype,
        )
        for c in matrix(world_size)
    ]
    cases += [
        _case(
            builtin_fixture(name),
            f"mean_loss-{name}-R{world_size}-M{M}-{dtype}",
            scheme="token_mean",
            strategy="mean_loss",
            accum_steps=M,
            dtype=dtype,
            num_updates=1,
            max_grad_norm=None,
        )
        for name, M, dtype in mean_loss_matrix(world_size)
    ]
    ragged = builtin_fixture("ragged")
    for strategy in STRATEGIES:
        # SGD makes the updated params proportional to the clipped gradient, so a clipping
        # or scale error shows in the params too (AdamW's first steps are nearly sign(g)).
        cases.append(
            _case(
                ragged,
                f"sgd-{strategy}-R{world_size}",
                scheme="token_mean",
                strategy=strategy,
                accum_steps=2,
                optimizer=sgd_spec(),
                max_grad_norm=0.2,
            )
        )
        # Every mean scheme has D = 0 here: the update must be exactly zero, never NaN.
        cases.append(
            _case(
                no_loss_fixture(),
                f"no-loss-{strategy}-R{world_size}",
                scheme="token_mean",
                strategy=strategy,
                accum_steps=1,
                num_updates=1,
            )
        )
    for divide_factor in (None, 1.0):
        for dtype in DTYPES:
            cases.append(
                _case(
                    ragged,
                    f"fsdp2-divide{divide_factor}-R{world_size}-{dtype}",
                    scheme="sequence_mean",
                    strategy="precount",
                    accum_steps=2,
                    dtype=dtype,
                    front_end="fsdp2",
                    fsdp_divide_factor=divide_factor,
                )
            )
    # precount with s = 1 under DDP's averaging: the missing-world-size bug (transformers#37474).
    cases.append(
        _case(
            ragged,
            f"wrong-s-R{world_size}",
            scheme="token_mean",
            strategy="precount",
            accum_steps=1,
            num_updates=1,
            reduce_factor=1.0,
        )
    )
    return cases


@functools.cache
def world_results(world_size: int) -> dict[str, list[RankOutput]]:
    """label -> [rank 0's output, ..., rank R-1's], for every case of `cases_for(R)`."""
    cases = cases_for(world_size)
    per_rank = launch(run_cases, world_size, (cases,), timeout_s=LAUNCH_TIMEOUT_S)
    return {case.label: [outputs[i] for outputs in per_rank] for i, case in enumerate(cases)}
