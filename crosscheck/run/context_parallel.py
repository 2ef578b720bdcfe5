"""Context parallel in the main job: every intended scheme at DP x CP layouts, in each
implementation against the oracle, and the oracle's own invariance across (R, M, C).

Rows, as `crosscheck.contract.cases.CaseResult` (the layout's C and order in ``extra``):

* ``context-parallel`` (per implementation, fixture, scheme and layout): one precount update
  of the implementation, its gradient against the oracle's at the same layout (1e-12), and
  every process's valid targets equal to the oracle's. ``jax-shard_map`` and ``jax-jit`` run
  `jax_impl.context_parallel` on a ("data", "context") mesh, under shard_map and as one
  global-view jit, in one worker process (one program per layout and front-end holds every
  scheme); ``torch-ddp`` and ``torch-fsdp2`` run ``torch_impl.update`` on R C gloo processes,
  DDP over all of them or FSDP2 over the flattened dimensions of a 2-D ("dp", "cp")
  DeviceMesh, one launch per process count.
* ``cp-layout-invariance`` (oracle): each intended scheme's gradient at each layout against
  its gradient without any split (R = M = C = 1): the same global batch, the same update.

The runners are `crosscheck.run.context_jax` (one worker process) and
`crosscheck.run.context_torch` (one launch per process count).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from crosscheck.contract.cases import CaseResult
from crosscheck.contract.oracle import loss_and_grad
from crosscheck.contract.spec import get_spec
from crosscheck.contract.spec_catalogue import DEFAULT_PARAMETERS, known_spec_names
from crosscheck.fixtures.builtin import builtin_fixture
from crosscheck.judge.compare import FLOAT64_RTOL, tree_rel_err

#: Implementation -> how it runs a context-parallel update (its name in the main matrix).
JAX_FRONT_ENDS = {"jax-shard_map": "shard_map", "jax-jit": "jit"}
TORCH_WRAPPERS = {"torch-ddp": "ddp", "torch-fsdp2": "fsdp2"}
IMPLS: tuple[str, ...] = (*JAX_FRONT_ENDS, *TORCH_WRAPPERS)
#: Segments cut by the split (packed), prompt groups across ranks (rollouts); one shape.
CONTEXT_FIXTURES: tuple[str, ...] = ("packed", "rollouts")
#: (R, M, C, order): C in {2, 4}, R in {1, 2}, M in {1, 2}, both orders; R C <= 4 processes
#: (torch on the 2-core machines). C = 1 is every other row of the run.
CONTEXT_LAYOUTS: tuple[tuple[int, int, int, str], ...] = (
    (1, 1, 2, "zigzag"),
    (2, 1, 2, "contiguous"),
    (1, 2, 4, "zigzag"),
    (2, 2, 2, "zigzag"),
)


@functools.cache
def context_schemes() -> tuple[str, ...]:
    """Every intended scheme of the catalogue (a parametric one with its default)."""
    names = [
        f"{name}:{DEFAULT_PARAMETERS[name]:g}" if name in DEFAULT_PARAMETERS else name
        for name in known_spec_names()
    ]
    return tuple(name for name in names if get_spec(name).intended)


class ContextCase(NamedTuple):
    """One intended scheme computed by one implementation at one context-parallel layout."""

    impl: str
    fixture: str
    scheme: str
    world_size: int
    accum_steps: int
    context_size: int
    context_order: str

    @property
    def layout(self) -> tuple[int, int, int, str]:
        return self.world_size, self.accum_steps, self.context_size, self.context_order


class ContextOutput(NamedTuple):
    grads: dict[str, np.ndarray]
    #: Every process's valid targets, process r C + c at r C + c.
    valid_tokens: tuple[int, ...]


OnContext = Callable[[ContextCase, ContextOutput | BaseException], None]


def context_cases(impls: Sequence[str]) -> list[ContextCase]:
    """Every (impl, fixture, scheme, layout) of the main job."""
    return [
        ContextCase(impl, fixture, scheme, *layout)
        for impl in impls
        if impl in IMPLS
        for fixture in CONTEXT_FIXTURES
        for scheme in context_schemes()
        for layout in CONTEXT_LAYOUTS
    ]


def _row(case: ContextCase, check: str, impl: str, reference: str, **values) -> CaseResult:
    R, M, C, order = case.layout
    return CaseResult(
        check=check,
        fixture=case.fixture,
        scheme=case.scheme,
        impl=impl,
        strategy="precount" if check == "context-parallel" else "closed-form",
        world_size=R,
        accum_steps=M,
        dtype="float64",
        reference=reference,
        extra={"context_size": C, "context_order": order},
        **values,
    )


@functools.cache
def _oracle(fixture: str, scheme: str, R: int, M: int, C: int, order: str):
    """The oracle at a context-parallel layout (every implementation's rows share it)."""
    return loss_and_grad(
        builtin_fixture(fixture), scheme, R, M, context_size=C, context_order=order
    )


def compare_context(case: ContextCase, output: ContextOutput | BaseException) -> CaseResult:
    """The ``context-parallel`` row of one case."""
    if isinstance(output, BaseException):
        detail = f"{type(output).__name__}: {output}"
        return _row(
            case, "context-parallel", case.impl, "oracle",
            max_rel_err=math.inf, ok=False, detail=detail, not_run=True,
        )  # fmt: skip
    expected = _oracle(case.fixture, case.scheme, *case.layout)
    error = tree_rel_err(output.grads, expected.grads).max_rel_err
    counts_ok = list(output.valid_tokens) == expected.rank_valid_tokens.tolist()
    detail = "" if counts_ok else f"per-process valid targets {list(output.valid_tokens)}"
    # float64 on both sides, the same exact counts, sums in another order: FLOAT64_RTOL.
    return _row(
        case, "context-parallel", case.impl, "oracle",
        max_rel_err=error, ok=error <= FLOAT64_RTOL and counts_ok, detail=detail,
    )  # fmt: skip


def invariance_rows() -> list[CaseResult]:
    """``cp-layout-invariance``: each intended scheme's gradient at every layout vs (1, 1, 1)."""
    rows = []
    for fixture in CONTEXT_FIXTURES:
        fx = builtin_fixture(fixture)
        for scheme in context_schemes():
            reference = loss_and_grad(fx, scheme, 1, 1).grads
            for layout in CONTEXT_LAYOUTS:
                moved = tree_rel_err(_oracle(fixture, scheme, *layout).grads, reference)
                case = ContextCase("oracle", fixture, scheme, *layout)
                rows.append(
                    _row(
                        case,
                        "cp-layout-invariance",
                        "oracle",
                        "oracle R=1,M=1,C=1",
                        max_rel_err=moved.max_rel_err,
                        ok=moved.max_rel_err <= FLOAT64_RTOL,
                    )
                )
    return rows


def planned_rows(
    cases: Sequence[ContextCase], *, with_oracle: bool, detail: str
) -> list[CaseResult]:
    """The row of every planned case, and (`with_oracle`) of every oracle invariance row, as
    it reads when it never came back."""
    planned = [("context-parallel", case) for case in cases]
    if cases and with_oracle:
        planned += [
            ("cp-layout-invariance", ContextCase("oracle", fixture, scheme, *layout))
            for fixture in CONTEXT_FIXTURES
            for scheme in context_schemes()
            for layout in CONTEXT_LAYOUTS
        ]
    return [
        _row(
            case,
            check,
            case.impl,
            "oracle" if check == "context-parallel" else "oracle R=1,M=1,C=1",
            max_rel_err=math.inf,
            ok=False,
            detail=detail,
            not_run=True,
        )
        for check, case in planned
    ]
