"""A scheme spec seen as a `Scheme`, so every judge of v1 (oracle, verify, diagnose) reads it.

`resolve_scheme` is the one lookup of a scheme given by a user: a v1 name returns v1's own
`Scheme` object, unchanged (its numbers, and the exported vectors, stay what they were); a
trainer mode's name (``group_token_mean``, ``length_power:0.5``), a spec dict or a
`SchemeSpec` returns a `SpecScheme`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from crosscheck.contract.layout import LaidOutBatch
from crosscheck.contract.schemes import SCHEMES, Scheme, get_scheme
from crosscheck.contract.spec import SchemeSpec, get_spec


class SpecScheme(Scheme):
    """A `SchemeSpec` behind the `Scheme` interface: c_t = a_t / D_u / K from the spec.

    Intended exactly when the spec is layout invariant (`SchemeSpec.layout_invariant`). Its
    `global_denominator` is D for a spec over the whole update, and for a local scope the
    number of units K, as v1's accidental schemes report R or R M.
    """

    def __init__(self, scheme_spec: SchemeSpec) -> None:
        self.scheme_spec = scheme_spec
        self.name = scheme_spec.name  # type: ignore[misc]  # per instance, not per class
        self.intended = scheme_spec.layout_invariant  # type: ignore[misc]

    def effective_weights(self, batch: LaidOutBatch) -> np.ndarray:
        return self.scheme_spec.effective_weights(batch)

    def global_denominator(self, batch: LaidOutBatch) -> float:
        denominators = self.scheme_spec.unit_denominators(batch)
        return denominators[0] if len(denominators) == 1 else float(len(denominators))

    @property
    def spec(self) -> str:
        return self.name


def resolve_scheme(scheme: str | dict[str, Any] | Scheme | SchemeSpec) -> Scheme:
    """v1's `Scheme` for a v1 name or object, else a `SpecScheme` (see the module docstring)."""
    if isinstance(scheme, Scheme):
        return scheme
    if isinstance(scheme, str) and (scheme in SCHEMES or scheme.startswith("constant:")):
        return get_scheme(scheme)
    return SpecScheme(get_spec(scheme))
