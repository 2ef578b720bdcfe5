"""Turning implementation outputs into result rows: against the oracle and against each other.

Every case is compared with the oracle's run of the same scheme, layout and settings: the
first update's gradient and the params after the last update, by worst-leaf relative error,
with the tolerance of the case's dtype. An accidental scheme's row passes when the
implementation reproduces the accident exactly (the reference reproduces the bug it guards
against) and reports how far that is from the intended token mean. Rows across cases check
that implementations agree with each other and that intended schemes do not depend on the
layout (world-size change).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable
from functools import cache

import numpy as np

from crosscheck.contract.cases import Case, CaseOutput, CaseResult, Params, TrainSettings
from crosscheck.contract.optimizers import UpdateRecord, train
from crosscheck.contract.schemes import effective_weights, resolve_scheme
from crosscheck.diagnosis.diagnose import diagnose
from crosscheck.fixtures.builtin import builtin_fixture
from crosscheck.judge.compare import RTOL_BY_DTYPE, tree_rel_err
from crosscheck.judge.invariance import weight_ratio

#: How far a logged weighted_mean D may be from the oracle's exact sum: float64 rounding in a
#: float64 run; in float32 and bf16 runs D is accumulated in float32 at least (JAX without
#: x64) and rounded once at the end, so 4 float32 unit roundoffs (2^-22) hold it with room.
WEIGHT_SUM_RTOL: dict[str, float] = {
    "float64": RTOL_BY_DTYPE["float64"],
    "float32": 2.0**-22,
    "bfloat16": 2.0**-22,
}


def clip_convention(impl: str) -> str:
    """torch clips with an epsilon of 1e-6 on the norm; optax does not."""
    return "torch" if impl.startswith("torch") else "optax"


@cache
def oracle_records(
    fixture: str, scheme: str, R: int, M: int, settings: TrainSettings, convention: str
) -> tuple[UpdateRecord, ...]:
    """The oracle's run of `settings.num_updates` updates, cached: many cases share one."""
    return tuple(
        train(
            builtin_fixture(fixture),
            scheme,
            R,
            M,
            num_updates=settings.num_updates,
            optimizer=settings.optimizer,
            max_grad_norm=settings.max_grad_norm,
            clip_convention=convention,
        )
    )


def oracle_run(case: Case, settings: TrainSettings, scheme: str | None = None):
    """The oracle's records for the case (optionally under another scheme)."""
    return oracle_records(
        case.fixture,
        scheme or case.scheme,
        case.world_size,
        case.accum_steps,
        settings,
        clip_convention(case.impl),
    )


def _summed_denominator(scheme_name: str) -> bool:
    """Whether D is a rounded float sum (weights, |row weights|, powers), not a count."""
    kind = resolve_scheme(scheme_name).denominator.kind
    return kind in ("weight_sum", "abs_row_weight_sum", "power_sum")


def _metrics_problem(case: Case, output: CaseOutput, expected: tuple[UpdateRecord, ...]) -> str:
    """A message when the logged metrics disagree with the oracle's, else ''."""
    first = expected[0].result
    rtol = RTOL_BY_DTYPE[case.dtype]
    seen_ranks = sorted({m.rank for m in output.metrics if m.update == 0})
    if seen_ranks != list(range(case.world_size)):
        return f"metrics of update 0 came from ranks {seen_ranks}"
    for m in output.metrics:
        if m.update != 0:
            continue
        if m.valid_tokens != int(first.rank_valid_tokens[m.rank]):
            return (
                f"rank {m.rank} logged {m.valid_tokens} valid tokens, "
                f"expected {int(first.rank_valid_tokens[m.rank])}"
            )
        # Counts are exact integers whatever the dtype; weighted_mean's D is a float sum, held
        # to float64 in a float64 run and to float32 rounding otherwise (never the params'
        # dtype: a bf16 D would be 8 bits).
        d_rtol = 0.0 if not _summed_denominator(case.scheme) else WEIGHT_SUM_RTOL[case.dtype]
        if not abs(m.denominator - first.denominator) <= d_rtol * abs(first.denominator):
            return f"rank {m.rank} logged D = {m.denominator!r}, expected {first.denominator!r}"
        if not abs(m.objective - first.loss) <= rtol * max(abs(first.loss), 1e-300):
            return f"rank {m.rank} logged objective {m.objective!r}, expected {first.loss!r}"
    return ""


def _vs_oracle_row(case: Case, **judgement) -> CaseResult:
    """A vs-oracle row: the case's coordinates plus what was found."""
    return CaseResult(check="vs-oracle", **case.coordinates(), **judgement)


def _bf16_weighting_problem(case: Case, output: CaseOutput) -> str:
    """The precision-aware verdict on a bf16 case's gradient: '' when its weighting is the
    intended scheme's at bf16-level (crosscheck.diagnosis.verdict), else the diagnosis."""
    d = diagnose(
        builtin_fixture(case.fixture),
        case.world_size,
        case.accum_steps,
        output.grads,
        case.scheme,
        dtype="bfloat16",
        precision="bfloat16",
    )
    return f"gradient: {d.best_match}: {d.explanation}" if d.detected else ""


def compare_with_oracle(case: Case, output: CaseOutput, settings: TrainSettings) -> CaseResult:
    """One row: the case's gradient and final params against the oracle's.

    Worst-leaf relative errors at the dtype's tolerance; a bf16 case of an intended scheme
    must also pass the precision-aware weight test (its gradient's recovered weights within
    bf16 rounding of the intended ones at every rank, microbatch and document).
    """
    scheme = resolve_scheme(case.scheme)
    expected = oracle_run(case, settings)
    grad_err = tree_rel_err(output.grads, expected[0].result.grads)
    # A trainer-mode case is one update without an optimizer step: its gradient is judged.
    param_err = tree_rel_err(output.params[-1], expected[-1].params) if output.params else None
    worst = max(grad_err, param_err or grad_err, key=lambda e: e.max_rel_err)
    rtol = RTOL_BY_DTYPE[case.dtype]
    detail = "" if worst.max_rel_err <= rtol else worst.describe()
    # The accidental schemes have no global D of their own to log; their rows stand on the
    # gradient and params alone.
    problem = _metrics_problem(case, output, expected) if scheme.intended else ""
    if not problem and scheme.intended and case.dtype == "bfloat16":
        problem = _bf16_weighting_problem(case, output)
    deviation = None
    if not scheme.intended:
        intended = oracle_run(case, settings, scheme="token_mean")
        deviation = tree_rel_err(output.grads, intended[0].result.grads).max_rel_err
    fixture = builtin_fixture(case.fixture)
    return _vs_oracle_row(
        case,
        max_rel_err=worst.max_rel_err,
        ok=worst.max_rel_err <= rtol and not problem,
        reference=(
            f"oracle {case.scheme}, gradient and params after {settings.num_updates} updates"
            if output.params
            else f"oracle {case.scheme}, gradient of one update"
        ),
        weight_ratio=weight_ratio(expected[0].result.token_weights, fixture.valid),
        deviation=deviation,
        detail=problem or detail,
        extra={
            "grad_rel_err": grad_err.max_rel_err,
            "param_rel_err": None if param_err is None else param_err.max_rel_err,
        },
    )


def failed_case(case: Case, error: BaseException | str, not_run: bool = True) -> CaseResult:
    """A failing row for a case whose implementation raised or produced nothing (`not_run`),
    or, with ``not_run=False``, whose report broke the harness's bookkeeping."""
    return _vs_oracle_row(
        case,
        max_rel_err=float("inf"),
        ok=False,
        reference="oracle",
        detail=f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else error,
        not_run=not_run,
    )


def missing_rows(expected: Iterable[CaseResult], rows: Iterable[CaseResult]) -> list[CaseResult]:
    """The rows of `expected` that no row of `rows` answers, matched by `CaseResult.key` and
    counted (a key planned twice needs two rows). Every row family plans the same way: each
    planned item's row as it reads when the item never reported (failing, ``not_run``, the
    detail saying so), and those no runner answered stand in the run's rows by name."""
    got = Counter(row.key for row in rows)
    missing = []
    for row in expected:
        if got[row.key]:
            got[row.key] -= 1
        else:
            missing.append(row)
    return missing


@cache
def layouts_weight_ratio(fixture: str, scheme: str, layouts: tuple[tuple[int, int], ...]) -> float:
    """The scheme's weight ratio (largest over smallest effective per-token weight among the
    valid tokens) at the worst of `layouts`: what a row over several layouts reports, the
    same figure a row at one of them gives."""
    data = builtin_fixture(fixture)
    return max(
        weight_ratio(effective_weights(scheme, data.layout(R, M)), data.valid) for R, M in layouts
    )


def cross_implementation(outputs: dict[Case, CaseOutput]) -> list[CaseResult]:
    """Per fixture, scheme, layout and dtype: the largest disagreement between any two cases."""
    groups: dict[tuple, list[Case]] = {}
    # In case order, not the order the runs came back in: among pairs that disagree equally
    # the row names the same pair in every run.
    for case in sorted(outputs):
        key = (case.fixture, case.scheme, case.world_size, case.accum_steps, case.dtype)
        groups.setdefault(key, []).append(case)
    rows = []
    for (fixture, scheme, R, M, dtype), cases in sorted(groups.items()):
        if len(cases) < 2:
            continue
        worst, pair = 0.0, (cases[0], cases[1])
        for a, b in itertools.combinations(cases, 2):
            # Only same-convention pairs are comparable after clipping; gradients always are.
            err = tree_rel_err(outputs[a].grads, outputs[b].grads).max_rel_err
            if err >= worst:
                worst, pair = err, (a, b)
        # Each side is within rtol of the oracle, so two sides are within 2 rtol of each other.
        rtol = 2 * RTOL_BY_DTYPE[dtype]
        rows.append(
            CaseResult(
                check="cross-impl",
                fixture=fixture,
                scheme=scheme,
                impl="all",
                strategy="all",
                world_size=R,
                accum_steps=M,
                dtype=dtype,
                max_rel_err=worst,
                ok=worst <= rtol,
                weight_ratio=layouts_weight_ratio(fixture, scheme, ((R, M),)),
                reference=f"{len(cases)} runs against each other, gradients",
                detail=f"worst pair: {pair[0].describe()} vs {pair[1].describe()}",
                extra={"impls": sorted({c.impl for c in cases})},
            )
        )
    return rows


def _final_or_gradient(output: CaseOutput) -> Params:
    """The params after the last update, or the gradient of a case without an optimizer step."""
    return output.params[-1] if output.params else output.grads


def world_size_change(
    outputs: dict[Case, CaseOutput], families: Iterable[tuple[tuple[int, int], ...]]
) -> list[CaseResult]:
    """Same global batch, same implementation, layouts (R, M) with R M fixed: same update?

    Intended schemes must give the same params after every update; accidental ones are
    reported with their difference, which is the answer to "we doubled accumulation after
    losing GPUs: why did the recipe change?".
    """
    rows = []
    by_key: dict[tuple, dict[tuple[int, int], Case]] = {}
    for case in outputs:
        key = (case.impl, case.fixture, case.scheme, case.strategy, case.dtype)
        by_key.setdefault(key, {})[(case.world_size, case.accum_steps)] = case
    for family in families:
        for (impl, fixture, scheme, strategy, dtype), layouts in sorted(by_key.items()):
            present = [layout for layout in family if layout in layouts]
            if len(present) < 2:
                continue
            # A trainer-mode case is one update without a step: its gradient stands for it.
            judged = [_final_or_gradient(outputs[layouts[layout]]) for layout in present]
            base = judged[0]
            errs = {
                layout: tree_rel_err(tree, base).max_rel_err
                for layout, tree in zip(present[1:], judged[1:], strict=True)
            }
            worst = max(errs.values())
            intended = resolve_scheme(scheme).intended
            rtol = 2 * RTOL_BY_DTYPE[dtype]
            ok = worst <= rtol if intended else bool(np.isfinite(worst))
            rows.append(
                CaseResult(
                    check="world-size-change",
                    fixture=fixture,
                    scheme=scheme,
                    impl=impl,
                    strategy=strategy,
                    world_size=present[-1][0],
                    accum_steps=present[-1][1],
                    dtype=dtype,
                    max_rel_err=worst,
                    ok=ok,
                    weight_ratio=layouts_weight_ratio(fixture, scheme, tuple(present)),
                    reference=(
                        f"{'params' if outputs[layouts[present[0]]].params else 'gradient'} "
                        f"at R={present[0][0]},M={present[0][1]}"
                    ),
                    detail=" ".join(f"R={r},M={m}: {e:.2e}" for (r, m), e in errs.items()),
                    extra={"layouts": [list(layout) for layout in present]},
                )
            )
    return rows
