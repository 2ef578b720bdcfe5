"""What the harness runs and what comes back: cases, their outputs, and result rows.

A case is one training run of one implementation: fixture x scheme x strategy x layout x dtype,
`num_updates` consecutive AdamW updates on the same global batch. An implementation returns the
first update's fully reduced gradient (before clipping), the params after every update, and
per-rank metrics of every update. The harness turns outputs into result rows by comparing them
with the oracle and with each other.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, NamedTuple

import numpy as np

from crosscheck.contract.optimizers import AdamWConfig, SGDConfig

Params = dict[str, np.ndarray]

STRATEGIES: tuple[str, ...] = ("precount", "postnorm")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainSettings:
    """Shared by every case of a run, so every implementation solves the same problem."""

    num_updates: int = 2
    optimizer: AdamWConfig | SGDConfig = field(default_factory=AdamWConfig)
    #: Clip by global norm after accumulation and reduction; None: no clipping. 0.3 lies
    #: between the mean schemes' update norms on the built-in fixtures (0.2 to 0.6), so
    #: clipping acts in some cases (and in every `sum` case) and not in others.
    max_grad_norm: float | None = 0.3

    def optimizer_spec(self) -> dict[str, float | str]:
        """The optimizer by name with every hyperparameter, as each runner builds it."""
        c = self.optimizer
        if isinstance(c, SGDConfig):
            return {"name": "sgd", "learning_rate": c.learning_rate}
        return {
            "name": "adamw",
            "learning_rate": c.learning_rate,
            "b1": c.b1,
            "b2": c.b2,
            "eps": c.eps,
            "weight_decay": c.weight_decay,
        }

    def for_dtype(self, dtype: str) -> TrainSettings:
        """The settings a run of `dtype` trains with.

        bfloat16 trains with SGD at the same clipping: AdamW's direction m / (sqrt(v) + eps)
        is a sign for gradient entries far below its scale, and a bf16 gradient entry below
        bf16's noise (a few 1e-3 of the largest) has no determined sign, so after AdamW the
        params of a correct bf16 step differ from the oracle's by up to 2 lr per update in
        those entries (measured: 2.4e-2 of max |param| after two updates on ragged at R = 4,
        M = 2). SGD's update error is lr times the gradient's, which the verdict bounds; the
        AdamW update math is checked at float64 and float32.
        """
        if dtype == "bfloat16" and isinstance(self.optimizer, AdamWConfig):
            return replace(self, optimizer=SGDConfig())
        return self


@dataclass(frozen=True, kw_only=True, slots=True)
class CaseCoordinates:
    """Where a run stands: one implementation on one fixture and scheme, with one strategy, at
    one layout (world_size ranks x accum_steps microbatches). A case, a resume case and a
    skipped combination are each these coordinates plus a dtype and fields of their own."""

    impl: str
    fixture: str
    scheme: str
    strategy: str
    world_size: int
    accum_steps: int

    def coordinates(self) -> dict[str, Any]:
        """These fields and the dtype, by name: what a result row or a skipped combination
        copies from its case (every kind of case has a dtype)."""
        names = [f.name for f in fields(CaseCoordinates)]
        return {name: getattr(self, name) for name in [*names, "dtype"]}


@dataclass(frozen=True, kw_only=True, slots=True, order=True)
class Case(CaseCoordinates):
    """One run of one implementation on one fixture, scheme, strategy, layout and dtype."""

    dtype: str = "float64"

    def describe(self) -> str:
        return (
            f"{self.impl} {self.fixture}/{self.scheme} {self.strategy} "
            f"R={self.world_size} M={self.accum_steps} {self.dtype}"
        )


def case_grid(
    impls: Iterable[str],
    fixtures: Iterable[str],
    layouts: Iterable[tuple[int, int]],
    schemes: Iterable[str],
    strategies: Iterable[str],
    dtypes: Iterable[str] = ("float64",),
) -> list[Case]:
    """Every case of the product of the lists, nested in this order (dtypes vary fastest);
    a layout is (world_size, accum_steps)."""
    product = itertools.product(impls, fixtures, layouts, schemes, strategies, dtypes)
    return [
        Case(
            impl=impl,
            fixture=fixture,
            scheme=scheme,
            strategy=strategy,
            world_size=R,
            accum_steps=M,
            dtype=dtype,
        )
        for impl, fixture, (R, M), scheme, strategy, dtype in product
    ]


def oracle_case(fixture: str, scheme: str, world_size: int, accum_steps: int) -> Case:
    """The oracle's own run at a layout: its closed form, in float64."""
    (case,) = case_grid(
        ["oracle"], [fixture], [(world_size, accum_steps)], [scheme], ["closed-form"]
    )
    return case


class RankMetrics(NamedTuple):
    """What one rank logs for one optimizer update (the seed's advice: log every update)."""

    rank: int
    update: int
    valid_tokens: int
    loss_sum: float  # sum of a_t l_t over this rank's microbatches, unnormalized
    denominator: float  # the global D of the update
    objective: float  # L = sum over all ranks of loss sums / D
    grad_norm: float  # global norm of the reduced gradient, before clipping
    clipped_grad_norm: float


class CaseOutput(NamedTuple):
    grads: Params  # the first update's reduced gradient, before clipping
    params: list[Params]  # params after each update
    metrics: list[RankMetrics]


@dataclass(frozen=True, kw_only=True, slots=True)
class CaseResult:
    """One row of a run. `ok` says whether the row is what the contract expects."""

    check: str  # "vs-oracle", "layout-invariance", "world-size-change", "resume", "clipping"
    fixture: str
    scheme: str
    impl: str
    strategy: str
    world_size: int
    accum_steps: int
    dtype: str
    #: Worst-leaf relative error against `reference` (inf when non-finite or missing).
    max_rel_err: float
    ok: bool
    reference: str
    #: The largest over the smallest effective per-token weight among valid tokens.
    weight_ratio: float = 1.0
    #: For accidental schemes: how far the gradient is from the intended token_mean one.
    deviation: float | None = None
    detail: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    #: The row holds no measurement: what it checks raised, timed out, or came back with
    #: nothing that could be compared (``ok`` is then False and ``detail`` says why). `run`
    #: exits 3, not 1, when every failing row is one of these (crosscheck.exit_codes).
    not_run: bool = False

    @property
    def key(self) -> tuple:
        """What the row is about, not what it found: its check and case coordinates, and a
        context-parallel layout's C and order (``extra``). Each planned item of a run has one
        row of its key (`crosscheck.run.rows.missing_rows` counts them)."""
        return (
            self.check, self.impl, self.fixture, self.scheme, self.strategy, self.world_size,
            self.accum_steps, self.dtype, self.extra.get("context_size", 1),
            self.extra.get("context_order", "contiguous"),
        )  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        record = asdict(self)
        for key in ("max_rel_err", "deviation", "weight_ratio"):
            value = record[key]
            if isinstance(value, float) and not math.isfinite(value):
                record[key] = None  # JSON has no inf; null means non-finite / not produced
        return record


@dataclass(frozen=True, kw_only=True, slots=True, order=True)
class ResumeCase(CaseCoordinates):
    """Stop a run, checkpoint, restart in fresh processes, continue to `num_updates`.

    The stop comes after `stop_after_updates` complete updates, and when
    `stop_after_microbatches` > 0, inside the next update after that many of its M
    microbatches (mid-accumulation: the partial gradient and denominator sums are part of the
    checkpoint). A stop between updates may resume at another layout of the same global batch
    (`resume_world_size` x `resume_accum_steps`); a mid-accumulation stop resumes at its own.
    """

    resume_world_size: int
    resume_accum_steps: int
    stop_after_updates: int = 1
    stop_after_microbatches: int = 0
    num_updates: int = 3
    dtype: str = "float64"

    def __post_init__(self) -> None:
        if self.stop_after_microbatches and (
            (self.resume_world_size, self.resume_accum_steps) != (self.world_size, self.accum_steps)
        ):
            raise ValueError(f"{self.describe()}: a mid-accumulation resume keeps its layout")
        if not 0 <= self.stop_after_microbatches < self.accum_steps:
            raise ValueError(
                f"{self.describe()}: stop_after_microbatches must be in [0, {self.accum_steps})"
            )
        if not 0 < self.stop_after_updates < self.num_updates:
            raise ValueError(f"{self.describe()}: the stop must fall inside the run")

    def describe(self) -> str:
        where = f"after update {self.stop_after_updates}"
        if self.stop_after_microbatches:
            where += f" + {self.stop_after_microbatches} microbatch(es)"
        return (
            f"{self.impl} {self.fixture}/{self.scheme} {self.strategy} "
            f"R={self.world_size},M={self.accum_steps} -> stop {where} -> "
            f"R={self.resume_world_size},M={self.resume_accum_steps} {self.dtype}"
        )


@dataclass(frozen=True, kw_only=True, slots=True, order=True)
class SkippedCase(CaseCoordinates):
    """A combination the plan's product names but that does not run, and why.

    The default matrix crosses every implementation with every strategy, scheme, layout and
    dtype; a few products do not exist (FSDP2 has no comm hook, so no postnorm; a layout must
    divide the fixture's rows). They are listed in the summary and the JSON, never dropped.
    """

    #: The kind of row the combination would have produced: "vs-oracle", "layout-invariance"
    #: (the oracle's own rows) or "resume".
    check: str
    dtype: str
    #: One sentence, the same for every combination skipped for the same reason, so that
    #: the summary can count them by it.
    reason: str

    def describe(self) -> str:
        return (
            f"{self.check} {self.impl} {self.fixture}/{self.scheme} {self.strategy} "
            f"R={self.world_size} M={self.accum_steps} {self.dtype}"
        )

    def to_json(self) -> dict[str, Any]:
        # The check first, then the coordinates (the order the JSON has always had).
        return {"check": self.check, **asdict(self)}


class ResumeOutput(NamedTuple):
    """Final params of the resumed run and of the same implementation run without a stop."""

    resumed: Params
    uninterrupted: Params
