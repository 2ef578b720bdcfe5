"""Why a plan is refused: the one line that names the first value running in no case.

`refusal` is `Plan.build`'s last step: a plan that runs nothing, or a value of a list the user
named explicitly that runs in no case, is refused with the reason the runners gave for it
(most frequent first), or with the layouts that divide none of a fixture's rows.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

from crosscheck.contract.cases import Case, SkippedCase
from crosscheck.fixtures.builtin import builtin_fixture

if TYPE_CHECKING:
    from crosscheck.run.plan import Plan

#: Layouts of the same global batch with R x M = 4: losing half the ranks and doubling the
#: accumulation must not change an intended scheme's update.
WORLD_SIZE_CHANGE_FAMILY: tuple[tuple[int, int], ...] = ((1, 4), (2, 2), (4, 1))

#: The plan's lists a user can name, in the order a refusal reports them: list -> (the
#: attribute of a case that holds one of its values, how a message names a value).
DIMENSIONS: dict[str, tuple[str, str]] = {
    "fixtures": ("fixture", "fixture {}"),
    "impls": ("impl", "{}"),
    "dtypes": ("dtype", "dtype {}"),
    "strategies": ("strategy", "strategy {}"),
    "schemes": ("scheme", "scheme {}"),
    "world_sizes": ("world_size", "world size {}"),
    "accum_steps": ("accum_steps", "accumulation steps {}"),
}


def layout_reason(fixture: str, num_rows: int) -> str:
    """Why a layout does not run on a fixture; one sentence per fixture, so skips group."""
    return f"{fixture} has {num_rows} rows, not divisible by R x M"


def refusal(plan: Plan, ran: list[Case], skipped: list[SkippedCase], resumes: bool) -> str:
    """'' when the plan may run, else the one line that says why not.

    Refused: a plan that runs nothing (explained by the first of its values that runs in
    no case), and a value of an explicit list that runs in no case."""
    problems = _values_in_no_case(plan, ran, skipped, plan.explicit)
    if ran and not problems:
        return ""
    if not problems:
        # Nothing runs and nothing named explicitly explains it: the first value of the
        # plan's own lists that runs nowhere does (every value runs nowhere).
        problems = _values_in_no_case(plan, ran, skipped, DIMENSIONS)[:1]
    message = problems[0][1]
    if len(problems) > 1:
        message += f" (also in no case: {', '.join(named for named, _ in problems[1:])})"
    if ran:
        return message
    return f"{'only resume rows' if resumes else 'nothing'} to run: {message}"


def _values_in_no_case(
    plan: Plan, ran: list[Case], skipped: list[SkippedCase], names: Iterable[str]
) -> list[tuple[str, str]]:
    """(the value as named, why) for each value of the lists `names` that runs nowhere."""
    problems = []
    for name, (attribute, label) in DIMENSIONS.items():
        if name not in names:
            continue
        present = {getattr(case, attribute) for case in ran}
        for value in getattr(plan, name):
            if value not in present:
                named = label.format(value)
                problems.append((named, _never_runs(plan, name, value, named, skipped)))
    return problems


def _never_runs(
    plan: Plan, name: str, value: object, named: str, skipped: list[SkippedCase]
) -> str:
    """Why `value` of the list `name` runs in no case: the runners' reasons (most frequent
    first) where some layout divides its fixture, else the layouts that divide none."""
    attribute = DIMENSIONS[name][0]
    mine = [s for s in skipped if s.check != "resume" and getattr(s, attribute) == value]
    by_layout = [s for s in mine if _is_layout_skip(s)]
    runner_reasons = Counter(s.reason for s in mine if not _is_layout_skip(s))
    layout_reasons = Counter(s.reason for s in by_layout)
    if name == "fixtures" and mine and len(by_layout) == len(mine):
        return _no_layout_divides(plan, str(value))
    # Where a layout divides, the runners' reasons are what keeps the value out; the
    # layouts that divide nothing would not let it in either.
    reasons = [r for r, _ in (runner_reasons or layout_reasons).most_common()]
    if not reasons:
        if name == "strategies":
            reasons = [
                "a strategy applies to an intended scheme on a torch or JAX implementation, "
                f"and this plan has none (impls {', '.join(plan.impls)}; "
                f"schemes {', '.join(plan.schemes)})"
            ]
        elif name == "dtypes" and set(plan.impls) == {"oracle"}:
            reasons = ["the oracle runs in float64 only"]
        else:
            reasons = [f"no implementation of the plan runs it ({', '.join(plan.impls)})"]
    return f"{named} runs in no case of this plan: {_join_reasons(reasons)}"


def _no_layout_divides(plan: Plan, fixture: str) -> str:
    """A fixture none of whose asked-for layouts divides its rows: which, and the layouts."""
    num_rows = builtin_fixture(fixture).num_rows
    asked = ", ".join(f"{R} x {M}" for R in plan.world_sizes for M in plan.accum_steps)
    message = (
        f"fixture {fixture} has {num_rows} rows, which none of the layouts asked for "
        f"divides: R x M = {asked} (world sizes {', '.join(map(str, plan.world_sizes))}; "
        f"accum steps {', '.join(map(str, plan.accum_steps))})"
    )
    family_used = plan.world_size_change and set(plan.impls) != {"oracle"}
    if family_used and all(num_rows % (R * M) for R, M in WORLD_SIZE_CHANGE_FAMILY):
        family = ", ".join(f"{R} x {M}" for R, M in WORLD_SIZE_CHANGE_FAMILY)
        message += f", nor the world-size-change layouts {family}"
    return message


def _is_layout_skip(skip: SkippedCase) -> bool:
    return skip.reason == layout_reason(skip.fixture, builtin_fixture(skip.fixture).num_rows)


def _join_reasons(reasons: list[str], most: int = 3) -> str:
    text = "; ".join(reasons[:most])
    if len(reasons) > most:
        text += f"; and {len(reasons) - most} more"
    return text
