"""One case of the experiment, spelled once for the tests that build a Case, a SkippedCase or
a CaseResult.

A test names only the fields its point depends on; every other field is this plain default
(torch DDP on `packed`, token_mean, precount, R = M = 2, float64), so that what a test varies
stands out.
"""

from __future__ import annotations

from typing import Any

from crosscheck.contract.cases import Case

DEFAULT_CASE: dict[str, Any] = {
    "impl": "torch-ddp",
    "fixture": "packed",
    "scheme": "token_mean",
    "strategy": "precount",
    "world_size": 2,
    "accum_steps": 2,
    "dtype": "float64",
}


def case_fields(**overrides: Any) -> dict[str, Any]:
    """The default case's fields, with `overrides` (which must name fields of a case)."""
    unknown = set(overrides) - set(DEFAULT_CASE)
    assert not unknown, f"not fields of a case: {sorted(unknown)}"
    return DEFAULT_CASE | overrides


def make_case(**overrides: Any) -> Case:
    """The default case with `overrides`."""
    return Case(**case_fields(**overrides))
