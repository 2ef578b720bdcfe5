r"""The group basis: the gradients a diagnosis fits any gradient on, from any model.

Valid tokens with a unit u_t > 0 fall into groups g, one per (row, segment) of the global
batch (`token_groups`); u_t is the soft weight w_t for a weighted scheme, else 1 (`token_units`).
Each group has its basis gradient

.. math::  b_g = \nabla_\theta \sum_{t \in g} u_t\, l_t(\theta),

and every weighting that is constant per group relative to the units, c_g u_t for token t of
group g, has the gradient :math:`\sum_g c_g b_g = c B`. For the analytic bilinear model the
oracle sums its per-token Jacobian over each group (``crosscheck.diagnosis.verdict``'s
`jacobian_group_basis`); for any other model, a `GroupBasis` holds B computed by that model, one
backward per group (``crosscheck.verification.model_basis`` computes one with a torch or JAX
model). The groups do not depend on the layout (R, M): one basis per fixture and units serves
every layout.

A weighting that varies inside a group (another scheme's soft weights) is not c B for any c,
so a basis cannot predict its gradient: `basis_grad_of` refuses it, and the diagnosis drops
such candidates with a note rather than predict them wrongly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from crosscheck.contract.fixture import Fixture
from crosscheck.contract.layout import Layout
from crosscheck.contract.spec import SchemeSpec
from crosscheck.diagnosis.candidates import Candidate
from crosscheck.diagnosis.judgement import per_group_weights


def token_units(fixture: Fixture, scheme: SchemeSpec) -> np.ndarray:
    """u_t [N, T]: the soft weight w_t of a valid token under a weighted scheme (weighted_mean,
    or a spec whose soft weight is per token), else 1 for a valid token; 0 for an ignored one."""
    valid = fixture.valid
    if scheme.weight.soft == "token":
        return np.where(valid, fixture.weights, 0.0)
    return valid.astype(np.float64)


class GroupKey(NamedTuple):
    """Where a group of `token_groups` lies: its process (data rank r, context rank c: r C +
    c), microbatch, row and segment, and under context parallel the context rank holding its
    positions (None without context parallel, where a group is a whole (row, segment))."""

    rank: int
    microbatch: int
    row: int
    segment: int
    context: int | None = None

    @property
    def label(self) -> str:
        where = f"row {self.row} segment {self.segment}"
        return where if self.context is None else f"{where} context rank {self.context}"


def token_groups(
    fixture: Fixture,
    world_size: int,
    accum_steps: int,
    units: np.ndarray,
    layout: Layout | None = None,
) -> tuple[np.ndarray, list[GroupKey]]:
    """Group id per token of the global [N, T] batch (-1: no weight), and each group's key.
    The ids are in (row, segment) order, whatever the layout. Under context parallel
    (`layout` with C > 1) a (row, segment) is cut into its context ranks' parts, each a group
    of its own: a buggy step may weigh the parts of one document apart."""
    layout = layout or Layout(world_size, accum_steps)
    batch = fixture.layout(world_size, accum_steps)
    _, M, B, T = batch.targets.shape
    C = layout.context_size
    width = int(fixture.segment_ids.max(initial=0)) + 1
    context = np.broadcast_to(layout.context_ranks(T)[None, :], fixture.segment_ids.shape)
    key = (np.arange(fixture.num_rows)[:, None] * width + fixture.segment_ids) * C + context
    carries = fixture.valid & (units > 0)
    keys, inverse = np.unique(key[carries], return_inverse=True)
    group_of = np.full(key.shape, -1, dtype=np.int64)
    group_of[carries] = inverse
    described = []
    for k in keys:
        piece, c = divmod(int(k), C)
        row, segment = divmod(piece, width)
        rank, microbatch = divmod(row // B, M)
        described.append(GroupKey(rank * C + c, microbatch, row, segment, c if C > 1 else None))
    return group_of, described


@dataclass(frozen=True, slots=True)
class GroupBasis:
    """B [K, P] of one fixture and units, computed by some model at its initial weights.

    Row g of `matrix` is b_g, flattened over the parameters in `shapes`' order (sorted by
    name, each raveled in C order: the order `diagnose` flattens a gradient dict in);
    `groups` [K, 2] holds each group's (row, segment), in `token_groups`' order.
    """

    fixture: str
    matrix: np.ndarray
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    groups: np.ndarray
    #: `dead_leaves` of this basis, found once here: every comparison of a diagnosis asks
    #: (a few dozen per case), and each would scan all of B [K, P] again.
    dead: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        names = [name for name, _ in self.shapes]
        if names != sorted(names):
            raise ValueError(f"GroupBasis.shapes must be sorted by name, got {names}")
        size = sum(int(np.prod(shape)) for _, shape in self.shapes)
        if self.matrix.ndim != 2 or self.matrix.shape[1] != size:
            raise ValueError(
                f"GroupBasis.matrix has shape {self.matrix.shape}: expected [groups, {size}] "
                "(the parameters of `shapes`, flattened)"
            )
        if self.groups.shape != (self.matrix.shape[0], 2):
            raise ValueError(
                f"GroupBasis.groups has shape {self.groups.shape}: expected "
                f"({self.matrix.shape[0]}, 2), one (row, segment) per row of the matrix"
            )
        object.__setattr__(self, "dead", dead_leaves(self))

    def live(self, tree: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """`tree` without the parameters the loss gives no gradient (`dead_leaves`): the
        worst-leaf error is taken over the others. A step that puts weight there anyway leaves
        the span of the basis, and the fit's residual shows it."""
        return {name: value for name, value in tree.items() if name not in self.dead}

    def check(
        self,
        fixture: Fixture,
        described: Sequence[GroupKey],
        grads: Mapping[str, np.ndarray],
    ) -> None:
        """ValueError unless this basis has the groups `token_groups` found on `fixture` and
        the parameters of `grads`, each of its shape."""
        if any(key.context is not None for key in described):
            raise ValueError(
                "a model's group basis holds whole (row, segment) groups: a gradient of a "
                "context-parallel step is diagnosed on the analytic model only"
            )
        expected = np.array([(key.row, key.segment) for key in described], dtype=np.int64)
        expected = expected.reshape(-1, 2)
        if fixture.name != self.fixture or not np.array_equal(expected, self.groups):
            raise ValueError(
                f"the group basis was computed for fixture {self.fixture!r} with "
                f"{len(self.groups)} groups; fixture {fixture.name!r} has {len(expected)} groups "
                "under the intended scheme's units: compute the basis on this fixture with this "
                "scheme"
            )
        names = {name for name, _ in self.shapes}
        if set(grads) != names:
            missing = sorted(names - set(grads))[:5]
            extra = sorted(set(grads) - names)[:5]
            raise ValueError(
                f"the gradient's parameters are not the group basis's: missing {missing}, "
                f"unexpected {extra} (the basis must come from the model the gradient is of)"
            )
        for name, shape in self.shapes:
            if np.shape(grads[name]) != shape:
                raise ValueError(
                    f"gradient {name!r} has shape {np.shape(grads[name])}, the group basis {shape}"
                )


#: A parameter whose every basis gradient is below this fraction of the basis's largest entry
#: gets no gradient from the loss (the key bias of attention: softmax ignores a constant added
#: to every score): what it holds is rounding, and the contract's float64 tolerance (1e-12)
#: cannot tell it from zero. Its worst-leaf error would compare rounding with rounding.
DEAD_LEAF = 1e-12


def dead_leaves(basis: GroupBasis) -> tuple[str, ...]:
    """The parameters the loss gives no gradient (`DEAD_LEAF`), in `basis.shapes` order."""
    top = float(np.max(np.abs(basis.matrix), initial=0.0))
    dead, start = [], 0
    for name, shape in basis.shapes:
        size = int(np.prod(shape))
        block = basis.matrix[:, start : start + size]
        if float(np.max(np.abs(block), initial=0.0)) <= DEAD_LEAF * top:
            dead.append(name)
        start += size
    return tuple(dead)


def basis_grad_of(
    basis: GroupBasis, group_of: np.ndarray, units: np.ndarray
) -> Callable[[np.ndarray], np.ndarray]:
    """flat_grad_of(token_weights [N, T]) = c B, c the weighting's per-group weights.

    Raises ValueError for a weighting that varies inside a group (`per_group_weights` is
    None): its gradient is not in the basis's span, and a basis cannot predict it.
    """

    def flat_grad_of(token_weights: np.ndarray) -> np.ndarray:
        per_group = per_group_weights(token_weights, group_of, units)
        if per_group is None:
            raise ValueError(
                "a weighting that varies inside a (row, segment) group cannot be predicted "
                "from a group basis"
            )
        return per_group @ basis.matrix

    return flat_grad_of


def group_mass(group_of: np.ndarray, units: np.ndarray, num_groups: int) -> np.ndarray:
    """U_g = sum_{t in g} u_t [K]."""
    carries = group_of >= 0
    return np.bincount(group_of[carries], weights=units[carries], minlength=num_groups)


def predictable(
    candidates: Sequence[Candidate],
    per_group: Sequence[np.ndarray | None],
    basis: GroupBasis | None,
) -> tuple[list[Candidate], list[np.ndarray | None], str]:
    """The candidates a group basis can predict (weights constant per group), their
    per-group weights, and a note naming the ones left out and the parameters the worst-leaf
    error leaves out (`dead_leaves`); '' when there are none. Without a basis (the oracle's
    Jacobian predicts every weighting) all of them, unchanged."""
    if basis is None:
        return list(candidates), list(per_group), ""
    pairs = list(zip(candidates, per_group, strict=True))
    unseen = [c.name for c, c_hyp in pairs if c_hyp is None and not c.leaf_scales]
    unscaled = [c.name for c, c_hyp in pairs if c.leaf_scales]
    notes = []
    if unseen:
        notes.append(
            f"not judged: {', '.join(dict.fromkeys(unseen))} (their weights vary inside a "
            "(row, segment) group, which a group basis cannot predict)"
        )
    if unscaled:
        notes.append(
            f"not judged: {', '.join(dict.fromkeys(unscaled))} (some parameters scaled apart "
            "from the others, which a group basis cannot predict)"
        )
    dead = basis.dead
    if dead:
        notes.append(
            f"the loss gives no gradient to {', '.join(dead[:5])}"
            + (f" and {len(dead) - 5} more" if len(dead) > 5 else "")
            + ": left out of the worst-leaf error"
        )
    note = "; ".join(notes)
    kept = [(c, c_hyp) for c, c_hyp in pairs if c_hyp is not None]
    return [c for c, _ in kept], [c_hyp for _, c_hyp in kept], note
