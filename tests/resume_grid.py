"""The checkpoint-resume grid that both references are tested on, defined once.

tests/test_jax_resume.py and tests/test_torch_resume.py run the same 72 cases (2 fixtures x 3
schemes x 2 strategies x 6 scenarios), so where one reference resumes a case and the other
does not, the difference is in the references and never in two copies of the grid. Every case
runs NUM_UPDATES updates, stops after update 1 or inside update 2 after some of its
microbatches, saves a checkpoint and resumes it in a fresh process:

    (a) stop between updates at (R, M) = (2, 2), resume at (2, 2);
    (b) stop inside update 2 after 1 microbatch at (2, 2), and after 1 and after 3 at (1, 4);
        resume at the same layout;
    (c) stop between updates at (2, 2), resume at (4, 1) and at (1, 4) (same global batch).
"""

from __future__ import annotations

from crosscheck.contract.cases import ResumeCase

NUM_UPDATES = 3
FIXTURES = ("packed", "ragged")
SCHEMES = ("token_mean", "sequence_mean", "weighted_mean")
STRATEGIES = ("precount", "postnorm")
#: ((R, M) at the stop, microbatches of update 2 done at the stop, (R, M) of the resume)
Scenario = tuple[tuple[int, int], int, tuple[int, int]]
SCENARIOS: tuple[Scenario, ...] = (
    ((2, 2), 0, (2, 2)),
    ((2, 2), 1, (2, 2)),
    ((1, 4), 1, (1, 4)),
    ((1, 4), 3, (1, 4)),
    ((2, 2), 0, (4, 1)),
    ((2, 2), 0, (1, 4)),
)


def resume_case(
    impl: str, fixture: str, scheme: str, strategy: str, scenario: Scenario, dtype: str = "float64"
) -> ResumeCase:
    """One case of the grid (or like it, at another dtype): stop after update 1 and the
    scenario's microbatches of update 2, resume, run to NUM_UPDATES."""
    (R, M), done, (R2, M2) = scenario
    run = {"impl": impl, "fixture": fixture, "scheme": scheme, "strategy": strategy, "dtype": dtype}
    layouts = {"world_size": R, "accum_steps": M, "resume_world_size": R2, "resume_accum_steps": M2}
    stop = {"stop_after_updates": 1, "stop_after_microbatches": done, "num_updates": NUM_UPDATES}
    return ResumeCase(**run, **layouts, **stop)


def resume_grid(impl: str) -> list[ResumeCase]:
    """Every fixture x scheme x strategy x scenario for `impl`, in that nesting order."""
    return [
        resume_case(impl, fixture, scheme, strategy, scenario)
        for fixture in FIXTURES
        for scheme in SCHEMES
        for strategy in STRATEGIES
        for scenario in SCENARIOS
    ]
