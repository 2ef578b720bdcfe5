"""What a run checks: the plan of the main job, and everything of its product it leaves out.

A `Plan` names fixtures, schemes, implementations, layouts, strategies and dtypes; its
product is every case. `Plan.build` lists every combination that does not run, with the
reason (a layout that does not divide the fixture, a strategy an implementation has no way to
run), and refuses a plan that would run nothing at all, or in which a value the user named
explicitly (`Plan.explicit`) runs in no case: a run never passes having checked nothing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from crosscheck.contract.cases import (
    STRATEGIES,
    Case,
    ResumeCase,
    SkippedCase,
    TrainSettings,
    case_grid,
    oracle_case,
)
from crosscheck.contract.schemes import SCHEMES, is_v1_scheme, resolve_scheme
from crosscheck.contract.spec_catalogue import DEFAULT_PARAMETERS, MODE_SPECS
from crosscheck.fixtures.builtin import BUILTIN_FIXTURES, V2_FIXTURES, builtin_fixture
from crosscheck.run.implementations import (
    IMPLEMENTATIONS,
    framework_of,
    not_installed,
    why_unsupported,
)
from crosscheck.run.resume import RESUME_RUNNERS, default_cases, starting_cases

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


class PlanError(ValueError):
    """The plan would check nothing, or a value it names explicitly runs in no case."""


@dataclass(frozen=True)
class PlanBuild:
    """What a plan runs, and what of its product it does not run and why."""

    cases: list[Case]
    #: fixture -> the layouts of the oracle's own rows (layout invariance, clip placement).
    oracle_layouts: dict[str, list[tuple[int, int]]]
    resume_cases: list[ResumeCase]
    skipped: list[SkippedCase]


@dataclass(kw_only=True)
class Plan:
    """What to run; defaults are the default matrix of `python -m crosscheck run`."""

    fixtures: list[str] = field(default_factory=lambda: list(BUILTIN_FIXTURES))
    schemes: list[str] = field(default_factory=lambda: list(SCHEMES))
    impls: list[str] = field(default_factory=lambda: ["oracle", *IMPLEMENTATIONS])
    world_sizes: list[int] = field(default_factory=lambda: [1, 2, 4])
    accum_steps: list[int] = field(default_factory=lambda: [1, 2])
    strategies: list[str] = field(default_factory=lambda: list(STRATEGIES))
    dtypes: list[str] = field(default_factory=lambda: ["float64"])
    world_size_change: bool = True
    resume: bool = True
    #: Contract v2's trainer modes on v2's fixtures: a second product, spec_fixtures x
    #: spec_schemes, beside fixtures x schemes (off with `spec_modes=False`). v1's names are
    #: specs too and run once, in the first product.
    spec_schemes: list[str] = field(
        default_factory=lambda: [
            *MODE_SPECS,
            *(f"{name}:{value:g}" for name, value in DEFAULT_PARAMETERS.items()),
        ]
    )
    spec_fixtures: list[str] = field(default_factory=lambda: list(V2_FIXTURES))
    #: None: on exactly when `fixtures` and `schemes` are the defaults (a plan narrowed to
    #: some fixtures or schemes is about those).
    spec_modes: bool | None = None
    #: The multi-term objectives of `crosscheck.run.objectives` (their own fixtures and
    #: layouts, float64), by every implementation of `impls` that computes them; only when
    #: `dtypes` holds float64. None: as `spec_modes`.
    objectives: bool | None = None
    #: The context-parallel rows of `crosscheck.run.context_parallel` (every intended scheme
    #: at DP x CP layouts of their own fixtures, float64), by every implementation of `impls`
    #: that splits rows over context ranks; only when `dtypes` holds float64. None: as
    #: `spec_modes`.
    context_parallel: bool | None = None
    #: Schemes of the resume rows (each resume case costs two process starts per framework).
    resume_schemes: list[str] = field(default_factory=lambda: ["token_mean", "sequence_mean"])
    #: Fixtures of the resume rows (those also in `fixtures`): by default the four of shape
    #: (8, 64). What a resume can get wrong (partial window sums, optimizer state, the global
    #: denominator across a world-size change) shows on any of them, and one shape means one
    #: set of compiled JAX programs; ragged's 144 rows would add a third of the resume time
    #: and no new way to fail. `crosscheck run --fixtures` sets both lists.
    resume_fixtures: list[str] = field(
        default_factory=lambda: ["packed", "empty-rank", "multimodal", "soft-weights"]
    )
    settings: TrainSettings = field(default_factory=TrainSettings)
    #: The lists of DIMENSIONS the user named (the CLI sets it). A value of one of them that
    #: runs in no case is refused: the user asked for it. What the product of the lists
    #: leaves out (the default matrix's, or between two named lists) is listed, not refused.
    explicit: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        default = self.fixtures == list(BUILTIN_FIXTURES) and self.schemes == list(SCHEMES)
        if self.spec_modes is None:
            self.spec_modes = default
        if self.objectives is None:
            self.objectives = default
        if self.context_parallel is None:
            self.context_parallel = default

    def validate(self) -> None:
        """Raise ValueError naming the first unknown name or empty list."""
        for name in DIMENSIONS:
            if not getattr(self, name):
                raise ValueError(f"the plan names no {name.replace('_', ' ')}")
        unknown = sorted(set(self.explicit) - set(DIMENSIONS))
        if unknown:
            raise ValueError(f"explicit names unknown lists {unknown}; known: {list(DIMENSIONS)}")
        for name in [*self.fixtures, *self.resume_fixtures]:
            builtin_fixture(name)
        for name in [*self.schemes, *(self.spec_schemes if self.spec_modes else [])]:
            resolve_scheme(name)  # an unknown name: the message lists the known ones
            if name.startswith("constant:"):
                # v1's constant runs by name in every implementation; its C would be dropped
                # on the way, so it is refused, not lost (configured_rows_sum:C is the spec
                # form, with its parameter).
                raise ValueError(
                    f"the matrix runs constant by name; {name!r} carries a parameter the "
                    "implementations would not receive: check a fixed normalizer with verify or "
                    "diagnose, or run the spec configured_rows_sum:C"
                )
        for name in self.spec_fixtures if self.spec_modes else []:
            builtin_fixture(name)
        for impl in self.impls:
            if impl != "oracle":
                framework_of(impl)
        for strategy in self.strategies:
            if strategy not in STRATEGIES:
                raise ValueError(f"unknown strategy {strategy!r}; known: {', '.join(STRATEGIES)}")
        for dtype in self.dtypes:
            if dtype not in ("float64", "float32", "bfloat16"):
                raise ValueError(f"dtype must be float64, float32 or bfloat16, got {dtype!r}")

    def pairs(self) -> list[tuple[str, str]]:
        """Every (fixture, scheme) the plan runs: fixtures x schemes, then the spec product."""
        pairs = [(fixture, scheme) for fixture in self.fixtures for scheme in self.schemes]
        if self.spec_modes:
            pairs += [(f, s) for f in self.spec_fixtures for s in self.spec_schemes]
        return list(dict.fromkeys(pairs))

    def schemes_by_fixture(self) -> dict[str, list[str]]:
        """`pairs` grouped by fixture, in order."""
        grouped: dict[str, list[str]] = {}
        for fixture, scheme in self.pairs():
            grouped.setdefault(fixture, []).append(scheme)
        return grouped

    def wanted_layouts(self) -> list[tuple[int, int]]:
        """Every (R, M) the plan asks for, whether or not it divides a fixture."""
        wanted = {(R, M) for R in self.world_sizes for M in self.accum_steps}
        if self.world_size_change:
            wanted |= set(WORLD_SIZE_CHANGE_FAMILY)
        return sorted(wanted)

    def layouts(self, fixture: str) -> list[tuple[int, int]]:
        """The (R, M) of the plan that divide the fixture, plus the world-size-change family."""
        return [(R, M) for R, M in self.wanted_layouts() if builtin_fixture(fixture).fits(R, M)]

    def oracle_layouts(self, fixture: str) -> list[tuple[int, int]]:
        """The layouts of the oracle's own rows: world sizes x accum steps that divide."""
        fits = builtin_fixture(fixture).fits
        return sorted((R, M) for R in self.world_sizes for M in self.accum_steps if fits(R, M))

    def planned(self) -> Iterator[tuple[Case, str]]:
        """Every case of the plan's product, with '' when it runs, else why it does not."""
        for impl in self.impls:
            if impl == "oracle":
                continue
            for fixture, schemes in self.schemes_by_fixture().items():
                data = builtin_fixture(fixture)
                for R, M in self.wanted_layouts():
                    for scheme in schemes:
                        # An accidental v1 scheme has no strategy: it is the naive loop itself;
                        # a spec, local or not, is computed by both strategies' spec paths.
                        resolved = resolve_scheme(scheme)
                        spec = not is_v1_scheme(resolved)
                        strategies = self.strategies if resolved.intended or spec else ["naive"]
                        grid = case_grid(
                            [impl], [fixture], [(R, M)], [scheme], strategies, self.dtypes
                        )
                        for case in grid:
                            if not data.fits(R, M):
                                yield case, layout_reason(fixture, data.num_rows)
                            else:
                                yield case, why_unsupported(case)

    def cases(self) -> list[Case]:
        """The cases the runners run (see `build` for what is left out, and why)."""
        return [case for case, why in self.planned() if not why]

    def build(self) -> PlanBuild:
        """Everything the plan runs and everything it leaves out; PlanError (a ValueError,
        one line) when it would run nothing or a value the user named runs in no case."""
        self.validate()
        cases: list[Case] = []
        skipped: list[SkippedCase] = []
        for case, why in self.planned():
            if why:
                skipped.append(_skip("vs-oracle", case, why))
            else:
                cases.append(case)
        oracle_layouts: dict[str, list[tuple[int, int]]] = {}
        oracle_cases: list[Case] = []  # the oracle's rows as cases: what they exercise
        if "oracle" in self.impls:
            for fixture, schemes in self.schemes_by_fixture().items():
                oracle_layouts[fixture] = self.oracle_layouts(fixture)
                data = builtin_fixture(fixture)
                for R in self.world_sizes:
                    for M in self.accum_steps:
                        for scheme in schemes:
                            case = oracle_case(fixture, scheme, R, M)
                            if not data.fits(R, M):
                                why = layout_reason(fixture, data.num_rows)
                                skipped.append(_skip("layout-invariance", case, why))
                            else:
                                oracle_cases.append(case)
        resume_cases: list[ResumeCase] = []
        if self.resume:
            resume_cases = self._resume_cases(skipped)
        problem = refusal(self, [*cases, *oracle_cases], skipped, bool(resume_cases))
        if problem:
            raise PlanError(problem)
        return PlanBuild(
            cases=cases, oracle_layouts=oracle_layouts, resume_cases=resume_cases, skipped=skipped
        )

    def _resume_cases(self, skipped: list[SkippedCase]) -> list[ResumeCase]:
        """The resume cases; a fixture the resume layouts do not divide goes to `skipped`."""
        fixtures = [name for name in self.fixtures if name in self.resume_fixtures]
        schemes = [name for name in self.resume_schemes if name in self.schemes]
        cases: list[ResumeCase] = []
        for impl in self.impls:
            if impl not in RESUME_RUNNERS:
                continue  # resume is checked on one implementation per framework
            missing = not_installed(framework_of(impl))
            for fixture in fixtures:
                if missing:
                    for case in starting_cases([impl], [fixture], schemes, self.strategies):
                        skipped.append(_skip("resume", case, missing))
                    continue
                found = default_cases([impl], [fixture], schemes, self.strategies)
                cases += found
                if found:
                    continue
                num_rows = builtin_fixture(fixture).num_rows
                reason = (
                    f"{fixture} has {num_rows} rows; resume runs R x M = 4 "
                    "(2 x 2 resumed at 4 x 1 and 1 x 4)"
                )
                for case in starting_cases([impl], [fixture], schemes, self.strategies):
                    skipped.append(_skip("resume", case, reason))
        return cases


def _skip(check: str, case: Case, reason: str) -> SkippedCase:
    return SkippedCase(check=check, reason=reason, **case.coordinates())


# -- why a plan is refused -----------------------------------------------------------------
#
# `refusal` is `Plan.build`'s last step: a plan that runs nothing, or a value of a list the
# user named explicitly that runs in no case, is refused with the reason the runners gave for
# it (most frequent first), or with the layouts that divide none of a fixture's rows.


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
    data = builtin_fixture(fixture)
    num_rows = data.num_rows
    asked = ", ".join(f"{R} x {M}" for R in plan.world_sizes for M in plan.accum_steps)
    message = (
        f"fixture {fixture} has {num_rows} rows, which none of the layouts asked for "
        f"divides: R x M = {asked} (world sizes {', '.join(map(str, plan.world_sizes))}; "
        f"accum steps {', '.join(map(str, plan.accum_steps))})"
    )
    family_used = plan.world_size_change and set(plan.impls) != {"oracle"}
    if family_used and not any(data.fits(R, M) for R, M in WORLD_SIZE_CHANGE_FAMILY):
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
