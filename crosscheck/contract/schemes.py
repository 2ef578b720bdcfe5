r"""The named schemes of contract v1, as scheme specs, and the one lookup of a scheme a user names.

Every scheme is a `crosscheck.contract.spec.SchemeSpec`: a token weight :math:`a_t`, a
denominator :math:`D_u` per unit of a scope, and the objective

.. math::

    L = \frac{1}{K} \sum_u \frac{\sum_{t \in u} a_t\, l_t}{D_u}

(docs/schemes-as-data.md). The eight names of contract v1 are catalogue entries
(`crosscheck.contract.spec_catalogue.NAMED_SPECS`): six intended schemes over the whole update
and the two accidental ones, ``rank_mean`` and ``microbatch_mean``, the same token mean taken
per rank or per microbatch and averaged, which is what frameworks produce when each rank or
microbatch takes its own mean. They exist so a gradient can be compared with them and the bug
named. `TokenMean()`, ..., `Constant(C)` build them; `DEFINITIONS` states each in words, as the
exported vectors' manifest carries it.

`resolve_scheme` reads whatever a user names as the intended scheme: a v1 name, a trainer
mode (``group_token_mean``, ``length_power:0.5``), a spec dict, a `SchemeSpec`, or
``MODULE:OBJECT`` naming one of those in the user's own code.

This is the numpy side. ``jax_impl`` and ``torch_impl`` read the same specs with their own code
on purpose: sharing it would hide a shared bug.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import replace
from typing import Any

import numpy as np

from crosscheck.contract.layout import LaidOutBatch
from crosscheck.contract.spec import SchemeSpec, get_spec
from crosscheck.contract.spec_catalogue import NAMED_SPECS, known_spec_names

#: Each v1 scheme in words, with its (a_t, d) of contract v1: d is a microbatch's share of an
#: update-scope D, summed over the update's microbatches (the manifest's "definition").
DEFINITIONS: dict[str, str] = {
    "token_mean": (
        "Global token mean: every valid token of the update weighs the same.\n\n"
        r":math:`a_t = v_t`, :math:`d = \sum_{t \in mb} v_t`, so "
        r":math:`L = \sum_t v_t l_t / \sum_t v_t`"
        "\nover the whole global batch (torchtitan's ``global_valid_tokens``)."
    ),
    "sequence_mean": (
        "Mean over sequences (packed documents) of each sequence's token mean.\n\n"
        "A sequence is a (row, segment id) pair with segment id > 0; segment 0 is padding.\n"
        r":math:`a_t = v_t / n_{seg}(t)`, :math:`d` = number of segments with "
        r":math:`n_{seg} > 0`."
    ),
    "row_mean": (
        "Mean over rows (examples) of each row's token mean.\n\n"
        r":math:`a_t = v_t / n_{row}(t)`, :math:`d` = number of rows with :math:`n_{row} > 0`."
    ),
    "weighted_mean": (
        r"Mean weighted by per-token soft weights :math:`w_t \ge 0`."
        "\n\n"
        r":math:`a_t = w_t v_t`, :math:`d = \sum_{t \in mb} w_t v_t`."
    ),
    "constant": (
        "Sum of valid-token losses over a normalizer fixed before the batch is seen.\n\n"
        r":math:`a_t = v_t`. By default :math:`d = B \cdot T`, every target slot of the "
        "microbatch,\npadding included, so "
        r":math:`D = N \cdot T` (T5X's ``NUM_TOTAL_TARGET_TOKENS``). With an"
        "\nexplicit ``normalizer`` C, :math:`D = C` for the update."
    ),
    "sum": r"Plain sum of valid-token losses: :math:`a_t = v_t`, :math:`D = 1`.",
    "rank_mean": (
        "Accidental: each rank takes its own token mean, the all-reduce averages the ranks.\n\n"
        r"Token t on rank r weighs :math:`v_t / (R\, n_r)` with :math:`n_r` the valid tokens "
        "of rank\nr over all its microbatches. A rank with :math:`n_r = 0` contributes "
        "nothing here (a real\nframework computes 0/0 = NaN there). This is the seed "
        "example's 9x. Its weight\n:math:`a_t = v_t / n_r` is rank-local, not "
        r"microbatch-local (:math:`d = 1` per rank)."
    ),
    "microbatch_mean": (
        "Accidental: each microbatch takes its own token mean; microbatches and ranks "
        "averaged.\n\n"
        r"Token t on rank r, microbatch m weighs :math:`v_t / (R\, M\, n_{rm})` (nanoGPT-style "
        "loops,\noptax.MultiSteps with a mean loss, transformers#34191). It happens to be of "
        "the local form,\n"
        r":math:`a_t = v_t / n_{rm}` and :math:`d = 1` for every microbatch, empty ones "
        "included\n(they add 1 to D and nothing to the numerator), so :math:`D = R M`. What "
        "makes it\naccidental is that D counts microbatches, which depends on the layout, "
        "not the data."
    ),
}


def TokenMean() -> SchemeSpec:  # noqa: N802 - the public constructor of contract v1's name
    r"""Every valid token of the update weighs the same: :math:`c_t = v_t / \sum_t v_t`."""
    return get_spec("token_mean")


def SequenceMean() -> SchemeSpec:  # noqa: N802
    r"""Mean over (row, segment) sequences of each one's token mean: :math:`a_t = v_t /
    n_{seg}(t)`, D the sequences with a valid token."""
    return get_spec("sequence_mean")


def RowMean() -> SchemeSpec:  # noqa: N802
    r"""Mean over rows of each row's token mean: :math:`a_t = v_t / n_{row}(t)`, D the rows
    with a valid token."""
    return get_spec("row_mean")


def WeightedMean() -> SchemeSpec:  # noqa: N802
    r""":math:`a_t = w_t v_t` over :math:`D = \sum_t w_t v_t`."""
    return get_spec("weighted_mean")


def Constant(normalizer: float | None = None) -> SchemeSpec:  # noqa: N802
    r""":math:`a_t = v_t` over every target slot of the update (:math:`D = N T`), or over a
    normalizer C fixed before the batch is seen (:math:`D = C`, ``constant:C``)."""
    if normalizer is None:
        return get_spec("constant")
    if not normalizer > 0:
        raise ValueError(f"constant normalizer must be > 0, got {normalizer!r}")
    return get_spec(f"constant:{normalizer:.17g}")


def Sum() -> SchemeSpec:  # noqa: N802
    r"""The plain sum of valid-token losses: :math:`a_t = v_t`, :math:`D = 1`."""
    return get_spec("sum")


def RankMean() -> SchemeSpec:  # noqa: N802
    r"""Accidental: each rank's own token mean, the ranks averaged: :math:`c_t = v_t /
    (R\, n_r)`."""
    return get_spec("rank_mean")


def MicrobatchMean() -> SchemeSpec:  # noqa: N802
    r"""Accidental: each microbatch's own token mean, all R M averaged: :math:`c_t = v_t /
    (R\, M\, n_{rm})`."""
    return get_spec("microbatch_mean")


#: v1's eight names, in contract order (the six intended, then the two accidental ones).
SCHEMES: dict[str, SchemeSpec] = {name: get_spec(name) for name in NAMED_SPECS}
INTENDED_SCHEMES: tuple[str, ...] = tuple(n for n, s in SCHEMES.items() if s.intended)
ACCIDENTAL_SCHEMES: tuple[str, ...] = tuple(n for n, s in SCHEMES.items() if not s.intended)
#: Schemes whose effective weights sum to 1 over a batch with at least one valid token
#: (the accidental ones only when no rank / microbatch is empty).
MEAN_SCHEMES: tuple[str, ...] = (
    "token_mean",
    "sequence_mean",
    "row_mean",
    "weighted_mean",
    "rank_mean",
    "microbatch_mean",
)


def get_scheme(scheme: str | SchemeSpec) -> SchemeSpec:
    """One of v1's names (or ``constant:C``, the constant scheme with the explicit normalizer C)
    as its spec; a `SchemeSpec` passes through unchanged."""
    if isinstance(scheme, SchemeSpec):
        return scheme
    name, sep, _ = str(scheme).partition(":")
    if sep and name != "constant":
        raise ValueError(
            f"only constant takes a parameter (constant:C), got {scheme!r}; known schemes: "
            f"{', '.join(SCHEMES)}"
        )
    if not sep and name not in SCHEMES:
        raise ValueError(
            f"unknown scheme {scheme!r}; known schemes: {', '.join(SCHEMES)} "
            "(and constant:C for an explicit normalizer C)"
        )
    try:
        return get_spec(str(scheme))
    except ValueError:
        raise ValueError(f"constant:C needs a finite number C > 0, got {scheme!r}") from None


def is_v1_scheme(scheme: SchemeSpec) -> bool:
    """Whether `scheme` is one of contract v1's, by name and content (`SCHEMES`, ``constant:C``).

    Such a scheme is judged on v1's fixtures by default (``crosscheck verify``, where another
    spec also gets contract v2's fixtures). Both frameworks compute every scheme, v1's
    included, as a spec; the matrix runs v1's in every dtype and the other specs in float64."""
    try:
        return get_scheme(scheme.name) == scheme
    except ValueError:
        return False


def effective_weights(scheme: str | SchemeSpec, batch: LaidOutBatch) -> np.ndarray:
    """Every token's effective weight in the global [N, T] order for a laid-out batch."""
    return batch.to_global(resolve_scheme(scheme).effective_weights(batch))


def resolve_scheme(scheme: str | dict[str, Any] | SchemeSpec) -> SchemeSpec:
    """The spec of whatever names the intended scheme.

    A name of the catalogue (v1's, a trainer mode's, ``constant:C``, ``length_power:0.5``), a
    spec dict, a `SchemeSpec`, or ``MODULE:OBJECT`` whose first part is no scheme's name: a
    user's own scheme, the module imported (from the current directory first, as
    ``verify --step`` is) and the object, a `SchemeSpec` or its dict, read; a spec left
    unnamed takes the reference as its name.
    """
    if isinstance(scheme, SchemeSpec):
        return scheme
    if isinstance(scheme, str) and (scheme in SCHEMES or scheme.startswith("constant:")):
        return get_scheme(scheme)
    if isinstance(scheme, str) and _is_reference(scheme):
        return _load_reference(scheme)
    return get_spec(scheme)


def _is_reference(text: str) -> bool:
    name, sep, attribute = text.partition(":")
    return bool(sep) and name not in known_spec_names() and attribute.isidentifier()


def load_reference(reference: str, what: str) -> Any:
    """The object ``MODULE:OBJECT`` names, the module imported from the current directory
    first (as ``verify --step`` is); ValueError naming `what` when it cannot be found."""
    module_name, _, attribute = reference.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"{what} {reference!r}: cannot import {module_name!r}: {error}") from None
    if not hasattr(module, attribute):
        raise ValueError(f"{what} {reference!r}: module {module_name!r} has no {attribute!r}")
    return getattr(module, attribute)


def _load_reference(reference: str) -> SchemeSpec:
    value = load_reference(reference, "scheme")
    if not isinstance(value, SchemeSpec | dict):
        raise ValueError(
            f"scheme {reference!r} is a {type(value).__name__}; a scheme is a SchemeSpec or "
            "its dict"
        )
    spec = get_spec(value)
    return replace(spec, name=reference) if spec.name == "custom" else spec
