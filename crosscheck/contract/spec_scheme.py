"""A scheme spec seen as a `Scheme`, so every judge of v1 (oracle, verify, diagnose) reads it.

`resolve_scheme` is the one lookup of a scheme given by a user: a v1 name returns v1's own
`Scheme` object, unchanged (its numbers, and the exported vectors, stay what they were); a
trainer mode's name (``group_token_mean``, ``length_power:0.5``), a spec dict or a
`SchemeSpec` returns a `SpecScheme`.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import replace
from typing import Any

import numpy as np

from crosscheck.contract.layout import LaidOutBatch
from crosscheck.contract.schemes import SCHEMES, Scheme, get_scheme
from crosscheck.contract.spec import SchemeSpec, get_spec
from crosscheck.contract.spec_catalogue import known_spec_names

#: The prefix that asks for a named scheme's spec form (``spec:token_mean``).
SPEC_PREFIX = "spec:"


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
    """v1's `Scheme` for a v1 name or object, else a `SpecScheme` (see the module docstring).

    A string ``module:object`` whose first part is no scheme's name is a user's own scheme:
    the module is imported (from the current directory first, as ``verify --step`` is) and
    the object, a `SchemeSpec`, its dict or a `Scheme`, is read; a spec left unnamed takes
    the reference as its name. ``spec:NAME`` is any named scheme as a spec
    (``spec:token_mean``): the same weights, computed by every implementation's spec path.
    """
    if isinstance(scheme, Scheme):
        return scheme
    if isinstance(scheme, str) and scheme.startswith(SPEC_PREFIX):
        # v1's scheme through the spec (its spec form, computed by the spec paths).
        spec = get_spec(scheme.removeprefix(SPEC_PREFIX))
        return SpecScheme(replace(spec, name=scheme))
    if isinstance(scheme, str) and (scheme in SCHEMES or scheme.startswith("constant:")):
        return get_scheme(scheme)
    if isinstance(scheme, str) and _is_reference(scheme):
        return _load_reference(scheme)
    return SpecScheme(get_spec(scheme))


def _is_reference(text: str) -> bool:
    name, sep, attribute = text.partition(":")
    return bool(sep) and name not in known_spec_names() and attribute.isidentifier()


def _load_reference(reference: str) -> Scheme:
    module_name, _, attribute = reference.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"scheme {reference!r}: cannot import {module_name!r}: {error}") from None
    if not hasattr(module, attribute):
        raise ValueError(f"scheme {reference!r}: module {module_name!r} has no {attribute!r}")
    value = getattr(module, attribute)
    if isinstance(value, Scheme):
        return value
    if not isinstance(value, SchemeSpec | dict):
        raise ValueError(
            f"scheme {reference!r} is a {type(value).__name__}; a scheme is a SchemeSpec, its "
            "dict, or a crosscheck Scheme"
        )
    spec = get_spec(value)
    return SpecScheme(replace(spec, name=reference) if spec.name == "custom" else spec)
