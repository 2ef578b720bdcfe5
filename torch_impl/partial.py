"""What one rank holds inside an update's accumulation window, to stop there and continue later.

An update of M microbatches can stop after its first j < M (``update.accumulate_partial``):
every one of those ran without gradient sync, so nothing of the update has crossed ranks yet
except precount's count collective. What the rank then holds is its local, unreduced ``.grad``
plus the sums below; a checkpoint saves both (``torch_impl.checkpoint``), and passing the sums as
``resume=`` to ``accumulate_precount``/``accumulate_postnorm`` after restoring ``.grad``
finishes the update exactly as if it had never stopped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Strategy = Literal["precount", "postnorm"]


class ResumeMismatchError(ValueError):
    """A partial accumulation that does not fit the update it is asked to continue."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PartialAccumulation:
    """One rank after the first `microbatches_done` microbatches of an update.

    The gradient of those microbatches is not in here: it sits in the parameters' ``.grad``.
    """

    strategy: Strategy
    microbatches_done: int
    #: This rank's sums over the microbatches done: its share of D, sum of a_t l_t, valid
    #: targets; postnorm's last all-reduce carries the update's totals. The share rides on a
    #: rank's last microbatch (``update.plan_update``), so a partial window holds 0 of it: a
    #: resumed update recomputes the share from the labels, as it recomputes its plan.
    local_denominator: float = 0.0
    local_loss_sum: float = 0.0
    local_valid_tokens: int = 0
    #: precount only: every rank's (sum of d, valid targets) over all M microbatches, from the
    #: count collective that precedes the first backward; D follows from them. They are
    #: recomputable from the labels, so a resume recomputes them and refuses when they differ
    #: (the interrupted update's batch changed). Empty for postnorm.
    rank_counts: tuple[tuple[float, float], ...] = ()


def starting_point(
    resume: PartialAccumulation | None, strategy: Strategy, stop: int
) -> PartialAccumulation:
    """Where an update's microbatch loop starts: at 0, or where a partial update stopped.

    `stop` is where this run of the loop will end; a partial state already past it is refused.
    """
    if resume is None:
        return PartialAccumulation(strategy=strategy, microbatches_done=0)
    if resume.strategy != strategy:
        raise ResumeMismatchError(
            f"a partial {resume.strategy} accumulation cannot be continued by {strategy}: "
            "the gradient in .grad is scaled differently"
        )
    if not 0 <= resume.microbatches_done <= stop:
        raise ResumeMismatchError(
            f"the partial accumulation is {resume.microbatches_done} microbatches in, "
            f"past the requested stop after {stop}"
        )
    return resume
