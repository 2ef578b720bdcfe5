"""Which name a gradient earns: on one case, and over every case of a run.

Several hypotheses can fit one gradient (``crosscheck.diagnosis.verdict`` decides what fits). A name
is given only when one explanation is *minimal*:

* the intended scheme, when it fits, is the answer;
* a bug pattern explains more than a plain scheme that predicts the same weights
  (packed-as-one is row_mean's weighting, named for why it happens);
* a family (``crosscheck.diagnosis.families``) is dropped when something it contains fits too: the
  scale family contains every scale pattern, rank-skew contains rank-mean and the scale
  family, microbatch-skew contains microbatch-mean, microstep-mean,
  clip-per-microbatch and rank-skew;
* a pattern whose signature is a reweighting (rank-mean, microbatch-mean, ...) is *not*
  contained in the scale family: where a plain scale fits as well, the layout did not show
  the reweighting, and the case is ambiguous rather than confidently named.

What is left: one name, or several (ambiguous, each named), or none (unknown).

Over a run (``verify``), the headline is what explains *every* case: the names that fit each
case, counting those that coincide with another by construction at that layout (rank-mean at
R = 1 is the intended scheme), intersected over the cases, and then made minimal the same way.
One case never decides a name: at R = M an extra factor R and an extra factor M are the same.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from crosscheck.diagnosis.families import FAMILIES
from crosscheck.diagnosis.patterns import PATTERNS

UNKNOWN = "unknown"
AMBIGUOUS = "ambiguous"

#: What a family allows, as a signature.
FAMILY_SIGNATURE: dict[str, str] = {
    "scale": "scale",
    "rank-skew": "rank",
    "microbatch-skew": "microbatch",
}
#: Signatures from the most to the least constrained.
_SIGNATURE_ORDER: dict[str, int] = {"scale": 0, "rank": 1, "microbatch": 2, "other": 3}
#: Schemes whose a_t is v_t: their weights are each other's up to one factor.
_COUNTING_SCHEMES = frozenset({"token_mean", "constant", "sum"})


def kind_of(name: str, intended: str) -> str:
    """ "intended", "pattern", "family" or "scheme"."""
    if name == intended:
        return "intended"
    if name in PATTERNS:
        return "pattern"
    if name in FAMILIES:
        return "family"
    return "scheme"


def signature_of(name: str, intended: str) -> str:
    """The shape of `name`'s weights against the intended scheme's (see the module docstring)."""
    kind = kind_of(name, intended)
    if kind == "intended":
        return "scale"
    if kind == "pattern":
        return PATTERNS[name].signature
    if kind == "family":
        return FAMILY_SIGNATURE[name]
    return "scale" if {name, intended} <= _COUNTING_SCHEMES else "other"


def minimal(names: Iterable[str], intended: str) -> list[str]:
    """The minimal explanations among `names`, in their given order."""
    names = list(dict.fromkeys(names))
    if intended in names:
        return [intended]
    kinds = {n: kind_of(n, intended) for n in names}
    if any(k == "pattern" for k in kinds.values()):
        names = [n for n in names if kinds[n] != "scheme"]
    order = {n: _SIGNATURE_ORDER[signature_of(n, intended)] for n in names}
    return [
        n
        for n in names
        if kinds[n] != "family" or not any(m != n and order[m] <= order[n] for m in names)
    ]


def logged_agrees(logged_by_candidate: float | None, logged: float | None, rtol: float) -> bool:
    """Whether a candidate's logged denominator is consistent with what the step logged."""
    if logged is None or logged_by_candidate is None:
        return True
    return math.isclose(logged_by_candidate, logged, rel_tol=max(rtol, 1e-9))


def name_of(explanations: Sequence[str]) -> str:
    """One name, "ambiguous" or "unknown" for a list of minimal explanations."""
    if not explanations:
        return UNKNOWN
    return explanations[0] if len(explanations) == 1 else AMBIGUOUS


def headline(fits_per_case: Sequence[Iterable[str]], intended: str) -> list[str]:
    """The minimal names that fit every case, the intended scheme left out when any case
    fails it (it then explains nothing); [] when no name fits them all."""
    sets = [set(fits) for fits in fits_per_case]
    if not sets:
        return []
    common = set.intersection(*sets)
    if not all(intended in s for s in sets):
        common.discard(intended)
    ordered = sorted(common, key=lambda n: (_KIND_ORDER[kind_of(n, intended)], n))
    return minimal(ordered, intended)


_KIND_ORDER = {"intended": 0, "pattern": 1, "scheme": 2, "family": 3}
