"""The versioned expectations of `crosscheck conformance`, read from ``expectations.toml``.

Each entry names a framework (its distribution), a setting, the versions it holds for
(``">=1.16,<1.17"``: comma-separated clauses of ``>=``, ``>``, ``<=``, ``<``, ``==``, ``!=``),
the verdict (``pass``, the pattern that explains every case, e.g. ``rank-mean``, or the names
the setting's layouts cannot tell apart, ``microbatch-mean or microstep-mean``) and, for
every expected failure, its evidence: the upstream issue, or the documentation sentence the
behaviour agrees with or contradicts. A setting run at a version no entry covers has no
expectation: the row differs until the file records what that version does.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from importlib import resources

#: The verdict of a row that passes: the intended scheme explains every case.
PASS = "pass"
_CLAUSE = re.compile(r"^\s*(>=|<=|==|!=|>|<)\s*([0-9][0-9.]*)\s*$")
_RELEASE = re.compile(r"^[0-9]+(\.[0-9]+)*")


class ExpectationsError(ValueError):
    """The expectations file is malformed: which entry, which field, and why."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Expectation:
    framework: str
    setting: str
    versions: str
    verdict: str
    #: Why a failure is expected: "issue: trl#5619", "documented: ...", "contradicts: ...".
    evidence: str = ""

    def covers(self, version: str) -> bool:
        return version_in(version, self.versions)


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: ``"2.13.0+cpu"`` -> (2, 13, 0)."""
    found = _RELEASE.match(version.strip())
    if found is None:
        raise ValueError(f"{version!r} has no numeric release")
    return tuple(int(part) for part in found.group(0).split("."))


def _compare(left: tuple[int, ...], right: tuple[int, ...]) -> int:
    width = max(len(left), len(right))
    a, b = left + (0,) * (width - len(left)), right + (0,) * (width - len(right))
    return (a > b) - (a < b)


def version_in(version: str, versions: str) -> bool:
    """Whether `version` satisfies every clause of the range `versions`."""
    have = release(version)
    for clause in versions.split(","):
        found = _CLAUSE.match(clause)
        if found is None:
            raise ValueError(f"version clause {clause!r} is not OP VERSION (e.g. '>=1.16')")
        op, bound = found.groups()
        order = _compare(have, release(bound))
        held = {
            ">=": order >= 0,
            ">": order > 0,
            "<=": order <= 0,
            "<": order < 0,
            "==": order == 0,
            "!=": order != 0,
        }[op]
        if not held:
            return False
    return True


def _entry(index: int, raw: dict) -> Expectation:
    where = f"expectations.toml, entry {index + 1}"
    fields = {"framework", "setting", "versions", "verdict", "evidence"}
    unknown = set(raw) - fields
    if unknown:
        raise ExpectationsError(f"{where}: unknown field(s) {sorted(unknown)}")
    missing = [key for key in ("framework", "setting", "versions", "verdict") if key not in raw]
    if missing:
        raise ExpectationsError(f"{where}: missing {', '.join(missing)}")
    expectation = Expectation(**{key: str(value) for key, value in raw.items()})
    try:
        version_in("0", expectation.versions)
    except ValueError as error:
        raise ExpectationsError(f"{where} ({expectation.setting}): {error}") from None
    if expectation.verdict != PASS and not expectation.evidence:
        raise ExpectationsError(
            f"{where} ({expectation.framework} {expectation.setting}): an expected failure "
            f"({expectation.verdict}) needs its evidence (an upstream issue or the docs)"
        )
    return expectation


def load_expectations(text: str | None = None) -> list[Expectation]:
    """Every entry of the packaged file (or of `text`, TOML with ``[[expect]]`` tables)."""
    if text is None:
        text = resources.files(__package__).joinpath("expectations.toml").read_text()
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ExpectationsError(f"expectations.toml: {error}") from None
    return [_entry(i, raw) for i, raw in enumerate(data.get("expect", []))]


def expectation_for(
    expectations: list[Expectation], framework: str, setting: str, version: str
) -> Expectation | None:
    """The entry for this framework, setting and installed version, or None."""
    matching = (e for e in expectations if (e.framework, e.setting) == (framework, setting))
    return next((e for e in matching if e.covers(version)), None)
