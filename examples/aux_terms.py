"""Why an auxiliary term needs its own denominator and scope, in numbers from a fixture.

``python examples/aux_terms.py`` prints the table of the README's worked example: the
float64 oracle (`crosscheck.contract.objective`) on the ``packed`` fixture with the extra
heads of docs/objectives.md (`crosscheck.fixtures.objective_params`):

* the multi-token-prediction head's shifted mask holds fewer tokens than the main
  cross-entropy's; divided by the main count (Megatron-LM#2417) its gradient shrinks;
* an entropy bonus averaged per microbatch weighs tokens by their microbatch's size;
* load balancing over the global batch is the same at every layout, over each microbatch it
  is not: a choice of objective that the layout silently changes.
"""

from __future__ import annotations

import numpy as np

from crosscheck.contract.objective import objective_loss_and_grad
from crosscheck.fixtures.builtin import builtin_fixture
from crosscheck.fixtures.objective_params import TOP_K, objective_params

LAYOUTS = ((1, 1), (2, 1), (2, 2), (4, 2))


def _term(params, fixture, R, M, **term):
    return objective_loss_and_grad(params, fixture.layout(R, M), [term]).terms[0]


def worked_example() -> str:
    """The table, as text."""
    fixture = builtin_fixture("packed")
    params = objective_params(fixture)
    ce = _term(params, fixture, 2, 2, kind="ce")
    mtp = _term(params, fixture, 2, 2, kind="mtp")
    lines = [
        f"packed: {fixture.num_rows} rows; ce counts {ce.count} target tokens, the mtp head "
        f"{mtp.count}",
        f"mtp divided by ce's count instead of its own: mtp gradient x {mtp.count / ce.count:.3f}",
    ]
    entropy = _term(params, fixture, 2, 2, kind="entropy", scheme={"scope": "microbatch"})
    weights = entropy.token_weights[entropy.token_weights > 0]
    lines.append(
        "entropy bonus averaged per microbatch at R=2, M=2: heaviest token weighs "
        f"{weights.max() / weights.min():.2f}x the lightest (1x over the update)"
    )
    lines.append(f"moe_lb, top-{TOP_K} of {params['router'].shape[1]} experts, per layout (R, M):")
    for scope in ("update", "microbatch"):
        values = [
            _term(params, fixture, R, M, kind="moe_lb", top_k=TOP_K, scope=scope).loss
            for R, M in LAYOUTS
        ]
        shown = "  ".join(f"{R},{M}: {v:.4f}" for (R, M), v in zip(LAYOUTS, values, strict=True))
        lines.append(f"  {scope:<10} {shown}")
    return "\n".join(lines)


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    print(worked_example())
