r"""The reference of ``verify --model --objective``: a user's model's per-term gradients.

A model that adds its own auxiliary loss (a Hugging Face MoE model's router load-balancing
loss) is verified against an objective of two terms: the cross-entropy of its logits
(``ce``, any scheme spec whose weight is constant on each (row, segment) group) and the
model's own router loss (``moe_lb``), both with their coefficients,

.. math::

    \text{total} = \lambda_{ce} \sum_t w_t l_t + \lambda_{lb} \frac{1}{R M} \sum_{u} A(u),

A(u) the model's auxiliary loss of one forward over microbatch u's rows: the per-forward mean
the model defines (``moe_lb`` at ``microbatch`` scope). torch: ``model(input_ids=inputs,
output_router_logits=True).aux_loss`` (a Hugging Face MoE model); JAX: ``apply_fn(params,
inputs)`` returns ``(logits, aux_loss)``. Its gradient splits over the terms and
microbatches as the oracle's does (`crosscheck.diagnosis.objective_diagnosis`), each piece
from the model's own backward passes, at its initial weights, in one process of its framework
(`torch_impl.harness.model_reference`):

* :math:`G_{ce,u} = \lambda_{ce} \sum_{g \in u} c_g b_g`, the group basis b_g of the
  cross-entropy (`crosscheck.verification.model_basis`) and c_g the intended weight of group
  g; the basis serves every layout;
* :math:`G_{lb,u} = \frac{\lambda_{lb}}{R M} \nabla A(u)`: one backward of the model's router
  loss per distinct row slice a layout's microbatch takes.

A step's gradient is then fitted on these columns, and the patterns a per-forward term can
suffer are scales of its columns: ``aux-world-size-factor`` (x R), ``aux-coefficient-twice``
(x λ) and ``aux-summed-over-microbatches`` (x R M, the Trainer's arrangement). Global-batch
balancing (``moe_lb`` at ``update`` scope) needs the router's statistics over the whole
update, which a model's own loss of one forward does not give: it is refused, as are the other
kinds, whose per-token losses a user's model does not define.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from crosscheck.diagnosis.group_basis import DEAD_LEAF, GroupBasis
from crosscheck.diagnosis.judgement import per_group_weights
from crosscheck.diagnosis.objective_candidates import Candidate
from crosscheck.fixtures.builtin import builtin_fixture
from crosscheck.verification.model_basis import reference_request, run_reference
from crosscheck.verification.objective_verify import Objective, ObjectiveColumns
from crosscheck.verification.protocol import VerifyJob

#: The patterns of a per-forward term, each a factor on its columns: name -> factor(R, M, λ).
_SCALES = {
    "aux-world-size-factor": lambda R, M, lam: (f"x R = {R}", R),
    "aux-coefficient-twice": lambda R, M, lam: (f"x lambda = {lam:g}", lam),
    "aux-summed-over-microbatches": lambda R, M, lam: (f"x R M = {R * M}", R * M),
}


def model_objective_problem(objective: Objective) -> str:
    """Why `objective` cannot be verified on a user's own model, or ""."""
    kinds = [term.kind for term in objective.terms]
    if kinds[0] != "ce" or kinds.count("ce") != 1 or set(kinds) - {"ce", "moe_lb"}:
        return (
            f"with --model, an objective is its cross-entropy first (kind ce) and the model's "
            f"own router loss (kind moe_lb), got the kinds {kinds}: the other kinds' per-token "
            "losses are the fixture model family's"
        )
    for term in objective.terms:
        if term.kind == "moe_lb" and term.scope != "microbatch":
            return (
                f"with --model, term {term.name!r} is the model's own router loss of one forward: "
                "its scope is microbatch (the per-forward mean); global-batch balancing needs the "
                "router's statistics over the whole update, which the model's loss does not give"
            )
    return ""


@dataclass(frozen=True, slots=True)
class ObjectiveModelReference:
    """Per fixture the cross-entropy's group basis and the router loss's gradient per slice."""

    objective: Objective
    bases: dict[str, GroupBasis]
    group_of: dict[str, np.ndarray]
    units: dict[str, np.ndarray]
    aux: dict[str, dict[tuple[int, int], np.ndarray]]
    dtype: str = "float64"
    refused: str = ""

    def columns(self, job: VerifyJob) -> ObjectiveColumns:
        """The per-term, per-microbatch gradients of `job`'s layout, rank-major."""
        fixture = builtin_fixture(job.fixture)
        R, M = job.world_size, job.accum_steps
        basis_matrix = self.bases[job.fixture].matrix
        shapes = self.bases[job.fixture].shapes
        rows_per_unit = fixture.num_rows // (R * M)
        ce, *aux_terms = self.objective.terms
        layout = fixture.layout(R, M)
        weights = layout.to_global(ce.spec.effective_weights(layout))
        group_of = self.group_of[job.fixture]
        per_group = per_group_weights(weights, group_of, self.units[job.fixture])
        if per_group is None:
            raise ValueError(
                f"term {ce.name!r}: its scheme's weights vary inside a (row, segment) group, "
                "which the model's group basis cannot predict"
            )
        # Each group's microbatch: its row's, rank-major (rows [u B, (u + 1) B) are unit u).
        unit_of = self.bases[job.fixture].groups[:, 0] // rows_per_unit
        ce_columns = np.zeros((R * M, basis_matrix.shape[1]))
        np.add.at(ce_columns, unit_of, ce.coefficient * per_group[:, None] * basis_matrix)
        basis = {ce.name: ce_columns}
        for term in aux_terms:
            slices = _unit_slices(fixture.num_rows, R, M)
            own = np.stack([self.aux[job.fixture][s] for s in slices])
            basis[term.name] = term.coefficient / (R * M) * own
        intended = sum(columns.sum(axis=0) for columns in basis.values())
        found = []
        for term in aux_terms:
            own = basis[term.name].sum(axis=0)
            for pattern, scale in _SCALES.items():
                variant, factor = scale(R, M, term.coefficient)
                prediction = intended - own + factor * own
                found.append(Candidate(pattern, term.name, variant, prediction))
        # Parameters no term gives a gradient (an attention key bias: softmax ignores a constant
        # added to every score) hold rounding on both sides: as for one scheme
        # (`group_basis.dead_leaves`), the worst-leaf error is taken over the others, while
        # the fit keeps them, so that a step putting weight there leaves the columns' span.
        top = max(float(np.max(np.abs(c), initial=0.0)) for c in basis.values())
        dead, start = [], 0
        for index, (_, shape) in enumerate(shapes):
            part = slice(start, start + int(np.prod(shape)))
            start = part.stop
            reach = max(float(np.max(np.abs(c[:, part]), initial=0.0)) for c in basis.values())
            if reach <= DEAD_LEAF * top:
                dead.append(index)
        names = tuple(name for name, _ in shapes)
        sizes = tuple(int(np.prod(shape)) for _, shape in shapes)
        return ObjectiveColumns(names, sizes, basis, intended, found, tuple(dead))


def _unit_slices(num_rows: int, R: int, M: int) -> list[tuple[int, int]]:
    """The row slice of every microbatch of layout (R, M), rank-major."""
    rows = num_rows // (R * M)
    return [(u * rows, (u + 1) * rows) for u in range(R * M)]


def objective_model_reference(
    framework: str,
    model: str,
    forward: str,
    jobs: Sequence[VerifyJob],
    objective: Objective,
    *,
    timeout_s: float,
) -> ObjectiveModelReference:
    """The user's model's columns for every job, computed in one process of `framework`;
    StepSetupError when they cannot be (as `crosscheck.verification.model_basis`)."""
    ce = objective.terms[0]
    request, _, keys = reference_request(model, forward, jobs, ce.spec)
    request["weightings"] = []  # the intended gradient is built from the columns here
    slices: dict[str, set[tuple[int, int]]] = {}
    for job in jobs:
        rows = builtin_fixture(job.fixture).num_rows
        slices.setdefault(job.fixture, set()).update(
            _unit_slices(rows, job.world_size, job.accum_steps)
        )
    request["aux_slices"] = {name: sorted(found) for name, found in slices.items()}
    result = run_reference(framework, model, request, timeout_s)
    bases = {
        name: GroupBasis(name, np.asarray(matrix, dtype=np.float64), tuple(shapes), keys[name])
        for name, (matrix, shapes) in result["bases"].items()
    }
    aux = {
        name: dict(zip(request["aux_slices"][name], grads, strict=True))
        for name, grads in result.get("aux", {}).items()
    }
    fixtures: dict[str, Any] = request["fixtures"]
    return ObjectiveModelReference(
        objective,
        bases,
        {name: value[1] for name, value in fixtures.items()},
        {name: value[2] for name, value in fixtures.items()},
        aux,
        result.get("dtype", "float64"),
        result.get("refused", ""),
    )
