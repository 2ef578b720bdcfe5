"""Trainer-mode cases (contract v2's scheme specs) for the torch runner.

A case whose scheme is not one of v1's names runs through ``torch_impl.spec_update``
(`torch_impl.harness.spec_cases.SpecCase`): one update, its gradient, D and objective judged
against the oracle (no optimizer step: `crosscheck.run.rows.compare_with_oracle`).
"""

from __future__ import annotations

import numpy as np

from crosscheck.contract.cases import Case, CaseOutput, RankMetrics
from crosscheck.contract.schemes import SCHEMES as V1_SCHEMES
from crosscheck.contract.schemes import resolve_scheme
from crosscheck.launch.workers import first_disagreeing_rank, launch_arrays


def is_spec_case(case: Case) -> bool:
    """A trainer mode of contract v2 (run through ``torch_impl.spec_update``), not a v1 name."""
    return case.scheme not in V1_SCHEMES


def spec_case(case: Case, front_end: str):
    """The case as a torch_impl SpecCase: one update of the spec, its gradient judged."""
    from torch_impl.harness.spec_cases import SpecCase

    batch, params = launch_arrays(case.fixture)
    return SpecCase(
        label=case.describe(),
        batch=batch,
        params=params,
        spec=resolve_scheme(case.scheme).to_dict(),
        strategy=case.strategy,
        accum_steps=case.accum_steps,
        dtype=case.dtype,
        front_end=front_end,
    )


def spec_output(case: Case, per_rank: list) -> CaseOutput:
    """Rank 0's gradient (checked equal on every rank) and what each rank's update logged.

    A spec case runs one update without an optimizer step: its row stands on the gradient,
    D and the objective (`crosscheck.run.rows.compare_with_oracle`)."""
    first = per_rank[0]
    rank = first_disagreeing_rank(per_rank)
    if rank is not None:
        raise AssertionError(f"{case.describe()}: rank {rank} holds a different gradient")
    metrics = []
    for out in per_rank:
        acc = out.accumulated
        metrics.append(
            RankMetrics(
                rank=out.rank,
                update=0,
                valid_tokens=int(acc.rank_valid_tokens[out.rank]),
                loss_sum=float(acc.rank_loss_sums[out.rank]),
                # D of the update (scope update); a local scope logs its number of units K.
                denominator=float(
                    acc.unit_denominators[0] if acc.num_units == 1 else acc.num_units
                ),
                objective=float(acc.objective),
                grad_norm=float(np.sqrt(sum(np.sum(g * g) for g in first.grads.values()))),
                clipped_grad_norm=float("nan"),
            )
        )
    return CaseOutput(grads=first.grads, params=[], metrics=metrics)
