"""What the context-parallel tests of both frameworks run: fixtures, fields and schemes."""

from __future__ import annotations

from crosscheck.contract.spec_catalogue import DEFAULT_PARAMETERS, known_spec_names

#: Segments cut by the context split (packed), prompt groups across ranks (rollouts),
#: documents across rows and ranks (continued-documents); one shape, 8 x 64.
FIXTURES = ("packed", "rollouts", "continued-documents")
#: The batch fields a scheme may read.
FIELDS = (
    "inputs",
    "targets",
    "segment_ids",
    "weights",
    "group_ids",
    "document_ids",
    "row_weights",
    "sample_mask",
)
STRATEGIES = ("precount", "postnorm")


def scheme_names() -> list[str]:
    """Every name of the catalogue, a parametric one with its default parameter."""
    return [
        f"{name}:{DEFAULT_PARAMETERS[name]:g}" if name in DEFAULT_PARAMETERS else name
        for name in known_spec_names()
    ]
