r"""One rank's side of a spec: masks, group counts, a_t and D_u, and the count pre-pass.

Every grouping is read as an id per token, so that a count is one ``scatter_add`` of the mask
into a vector indexed by id:

* ``row`` and ``segment`` get ids local to their microbatch (row index; row x (S + 1) + segment
  id): their groups never cross a microbatch, so a count is the same at every scope and any
  sum over groups is a sum over microbatches (*additive*);
* ``none`` (id 0), ``rank`` (r), ``microbatch`` (r M + m), ``group`` (``group_ids``) and
  ``document`` (``document_ids``) get global ids, and a count at scope ``rank`` is the sum of
  the rank's microbatch vectors; at scope ``update`` it is that sum over every rank, which one
  all-reduce of the rank's vector gives (the count pre-pass, ``torch_impl.update``).
  Vector lengths are agreed before the step (`IdBounds`: the largest id + 1).

Without ``group_ids`` each row is its own group and without ``document_ids`` each (row,
segment) pair is a document (the doc's defaults): exactly ``row`` and ``segment``.

Context parallel (docs/contract.md#context-parallel; microbatches from
``torch_impl.batch.context_microbatches``): a process holds a part of every row of its
microbatches, and the C processes of a data-parallel rank hold the same rows. Rows and
segments then cross processes: they get global ids (the row's index in the global batch;
row x (S + 1) + segment id), counted like groups and documents, their update-scope vectors
summed by the pre-pass; and a part of D summed over processes that counts rows (the
absolute row weights) is this process's share only on context rank 0.

With :math:`n_G(t) = \sum_{u: G(u) = G(t),\ u \in \mathrm{unit}_C(t)} m_u`, the numerator is
:math:`a_t = m_t s_t n_G(t)^{-\alpha}` (0 where :math:`m_t = 0`, never 0/0) and the
denominator of a unit u (``SpecView.unit_denominator``) is the doc's table. ``power_sum`` is
:math:`\sum n_{c,g}^{-\alpha'}` over the count cells (count unit c, group g) non-empty in u:
when the count scope C contains u that is the groups of u with their C-counts; when C lies
inside u, every C-unit's groups are summed separately (a microbatch-local count treats a split
group as two). Counts are int64 and exact; only weight sums and power sums round (float64).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from torch_impl.batch import TokenBatch
from torch_impl.spec import SCOPES, SchemeSpec

#: Groupings whose groups never cross a microbatch: counted per microbatch, at every scope.
LOCAL_GROUPINGS = ("row", "segment")


@dataclass(frozen=True, slots=True)
class Position:
    """Where this rank's microbatches sit in the update: rank r of R, M microbatches each."""

    rank: int
    world_size: int
    accum_steps: int


@dataclass(frozen=True, slots=True)
class IdBounds:
    """Largest ``group_ids`` / ``document_ids`` value + 1 over the whole update (0: absent);
    under context parallel also the rows (largest global row index + 1) and the segment ids'
    (largest + 1), the lengths of the rows' and segments' global ids.

    Every rank must use the same bounds: they are the lengths of the vectors all-reduced.
    """

    groups: int = 0
    documents: int = 0
    rows: int = 0
    segments: int = 0

    @classmethod
    def of(cls, microbatches: Sequence[TokenBatch]) -> IdBounds:
        """The bounds of these microbatches alone (agree them across ranks before use)."""

        def bound(key: str) -> int:
            values = [getattr(b, key) for b in microbatches if getattr(b, key) is not None]
            return max((int(v.max()) + 1 for v in values if v.numel()), default=0)

        rows = max((b.first_row + b.targets.shape[0] for b in microbatches), default=0)
        return cls(bound("group_ids"), bound("document_ids"), rows, bound("segment_ids"))

    def as_list(self) -> list[int]:
        """The bounds in field order: what the ranks agree on with one MAX all-reduce."""
        return [self.groups, self.documents, self.rows, self.segments]


def effective_grouping(grouping: str, batch: TokenBatch) -> str:
    """`grouping`, or its default when the batch lacks the ids (group -> row, doc -> segment)."""
    if grouping == "group" and batch.group_ids is None:
        return "row"
    if grouping == "document" and batch.document_ids is None:
        return "segment"
    return grouping


def row_mask(batch: TokenBatch, which: str) -> torch.Tensor:
    """[B] bool: the rows a mask keeps at all (sample: sample_mask = 1; otherwise every row)."""
    if which == "sample" and batch.sample_mask is not None:
        return batch.sample_mask != 0
    return torch.ones(batch.targets.shape[0], dtype=torch.bool)


def token_mask(batch: TokenBatch, which: str) -> torch.Tensor:
    """[B, T] bool m_t: valid; valid in a kept row (sample); valid with w_t != 0."""
    mask = batch.valid & row_mask(batch, which)[:, None]
    if which == "nonzero_weight":
        mask = mask & (batch.weights != 0)
    return mask


def soft_factor(batch: TokenBatch, soft: str) -> torch.Tensor:
    """[B, T] float64 s_t: 1, w_t, or the row's weight with its sign (absent: 1)."""
    shape = batch.targets.shape
    if soft == "token":
        return batch.weights.to(torch.float64)
    if soft == "row" and batch.row_weights is not None:
        return batch.row_weights.to(torch.float64)[:, None].expand(shape)
    return torch.ones(shape, dtype=torch.float64)


def _psum(counts: torch.Tensor, nonempty: torch.Tensor, alpha: float) -> float:
    """sum of counts[g]^(-alpha) over the groups g with nonempty[g] > 0, in float64 (fsum)."""
    n = counts[nonempty > 0].to(torch.float64)
    return math.fsum((1.0 / n if alpha == 1.0 else n.pow(-alpha)).tolist())


class SpecView:
    """One rank's microbatches seen through a spec: count vectors, a_t and D_u.

    Pure (no collective): `local_prepass` is what this rank contributes to the count
    pre-pass, and every method that needs update-scope counts takes the pre-pass result,
    ``global_parts`` (name -> the summed int64 vector of every rank).
    """

    def __init__(
        self,
        spec: SchemeSpec,
        microbatches: Sequence[TokenBatch],
        position: Position,
        bounds: IdBounds,
    ) -> None:
        if len(microbatches) != position.accum_steps:
            raise ValueError(
                f"rank {position.rank}: {len(microbatches)} microbatches, expected "
                f"accum_steps={position.accum_steps}"
            )
        self.spec, self.microbatches = spec, microbatches
        self.position, self.bounds = position, bounds
        contexts = {(b.context_rank, b.context_size) for b in microbatches}
        if len(contexts) > 1:
            raise ValueError(
                f"rank {position.rank}: microbatches of several context ranks {sorted(contexts)}"
            )
        self.context_rank, context_size = contexts.pop() if contexts else (0, 1)
        #: Groupings whose groups stay inside one microbatch: none under context parallel.
        self.local_groupings = LOCAL_GROUPINGS if context_size == 1 else ()
        w, d = spec.weight, spec.denominator
        self.weight_group = self._grouping(w.group)
        self.den_group = self._grouping(d.group)
        self.vectors: dict[str, list[torch.Tensor]] = {}
        if self.weight_group != "none":
            self.vectors["weight_count"] = self._per_microbatch(self.weight_group, w.mask, False)
        if d.kind in ("groups", "power_sum"):
            self.vectors["den_count"] = self._per_microbatch(self.den_group, d.mask, False)
        if d.kind == "all_groups":
            self.vectors["den_present"] = self._per_microbatch(self.den_group, d.mask, True)

    def _grouping(self, grouping: str) -> str:
        found = {effective_grouping(grouping, b) for b in self.microbatches}
        if len(found) > 1:
            raise ValueError(
                f"rank {self.position.rank}: grouping {grouping!r} needs its ids in every "
                "microbatch or in none"
            )
        return found.pop() if found else grouping

    def _ids(self, batch: TokenBatch, grouping: str, step: int) -> tuple[torch.Tensor, int]:
        """Per-token ids [B, T] of a grouping, and the length of its count vector."""
        p, shape = self.position, batch.targets.shape
        rows = torch.arange(shape[0])[:, None].expand(shape)
        if grouping in ("row", "segment") and grouping not in self.local_groupings:
            # Context parallel: ids of the global batch, the same on every process of a row.
            rows = rows + batch.first_row
            if grouping == "row":
                return rows, self.bounds.rows
            width = self.bounds.segments
            return rows * width + batch.segment_ids, self.bounds.rows * width
        if grouping == "row":
            return rows, shape[0]
        if grouping == "segment":
            width = int(batch.segment_ids.max()) + 1 if batch.segment_ids.numel() else 1
            return rows * width + batch.segment_ids, shape[0] * width
        if grouping == "group":
            ids, length = batch.group_ids[:, None].expand(shape), self.bounds.groups
        elif grouping == "document":
            ids, length = batch.document_ids, self.bounds.documents
        else:
            unit = {"none": 0, "rank": p.rank, "microbatch": p.rank * p.accum_steps + step}
            size = {"none": 1, "rank": p.world_size, "microbatch": p.world_size * p.accum_steps}
            return torch.full(shape, unit[grouping], dtype=torch.long), size[grouping]
        if ids.numel() and int(ids.max()) >= length:
            raise ValueError(
                f"rank {p.rank}, microbatch {step}: {grouping} id {int(ids.max())} is past the "
                f"agreed bound {length} (IdBounds must cover every rank's ids)"
            )
        return ids.long(), length

    def _per_microbatch(self, grouping: str, mask: str, presence: bool) -> list[torch.Tensor]:
        """One int64 vector per microbatch: m-counts per id, or (presence) positions per id.

        A group is present in a row the mask keeps (``all_groups``: rows with sample_mask = 1
        when the mask is ``sample``); segment and document id 0 are padding, never a group.
        """
        out = []
        for step, batch in enumerate(self.microbatches):
            ids, length = self._ids(batch, grouping, step)
            if presence:
                keep = row_mask(batch, mask)[:, None].expand_as(ids)
                if grouping in ("segment", "document"):
                    keep = keep & ((batch.segment_ids if grouping == "segment" else ids) != 0)
            else:
                keep = token_mask(batch, mask)
            vector = torch.zeros(length, dtype=torch.int64)
            out.append(vector.scatter_add_(0, ids.flatten(), keep.flatten().to(torch.int64)))
        return out

    # -- the count pre-pass -------------------------------------------------------------------

    def global_parts(self) -> tuple[tuple[str, int], ...]:
        """(name, length) of every vector this spec needs summed over the whole update."""
        w, d, U = self.spec.weight, self.spec.denominator, self.spec.scope
        parts = []
        if self.weight_group not in ("none", *self.local_groupings) and w.count_scope == "update":
            parts.append("weight_count")
        if self.den_group not in self.local_groupings:
            if (d.kind == "groups" and U == "update") or (
                d.kind == "power_sum" and w.count_scope == "update"
            ):
                parts.append("den_count")
            if d.kind == "all_groups" and U == "update":
                parts.append("den_present")
        return tuple((name, int(self.vectors[name][0].numel())) for name in parts)

    def local_prepass(self) -> torch.Tensor:
        """This rank's share of the pre-pass: its summed vectors, concatenated, as float64.

        float64 so that it can travel in one all-reduce with float64 denominator slots; the
        counts are integers below 2^53 and so exact, and are read back as int64.
        """
        parts = [self._rank_vector(name) for name, _ in self.global_parts()]
        return torch.cat(parts).to(torch.float64) if parts else torch.zeros(0, dtype=torch.float64)

    def split_prepass(self, summed: torch.Tensor) -> dict[str, torch.Tensor]:
        """name -> int64 vector, from the all-reduced concatenation."""
        out, start = {}, 0
        for name, length in self.global_parts():
            out[name] = summed[start : start + length].round().to(torch.int64)
            start += length
        return out

    def _rank_vector(self, name: str) -> torch.Tensor:
        return torch.stack(self.vectors[name]).sum(dim=0)

    def _vector(self, name: str, scope: str, step: int, global_parts: Mapping) -> torch.Tensor:
        """The count vector of `name` over the unit of `scope` that holds microbatch `step`."""
        if scope == "microbatch" or self._is_local(name):
            return self.vectors[name][step]
        if scope == "rank":
            return self._rank_vector(name)
        return global_parts[name]

    def _is_local(self, name: str) -> bool:
        group = self.weight_group if name == "weight_count" else self.den_group
        return group in self.local_groupings

    # -- numerator and denominators -----------------------------------------------------------

    def numerators(self, global_parts: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """a_t = m_t s_t n_G(t)^(-alpha) per microbatch, float64 [B, T]; 0 where m_t = 0."""
        w = self.spec.weight
        out = []
        for step, batch in enumerate(self.microbatches):
            mask = token_mask(batch, w.mask)
            value = soft_factor(batch, w.soft)
            if self.weight_group != "none":
                ids, _ = self._ids(batch, self.weight_group, step)
                counts = self._vector("weight_count", w.count_scope, step, global_parts)
                # m_t = 1 counts t itself, so n >= 1 wherever the weight is kept; the clamp
                # only keeps the masked-out tokens' discarded branch finite.
                n = counts[ids].to(torch.float64).clamp(min=1.0)
                value = value * (1.0 / n if w.alpha == 1.0 else n.pow(-w.alpha))
            out.append(torch.where(mask, value, torch.zeros_like(value)))
        return out

    def unit_denominator(
        self, steps: Sequence[int], scope: str, global_parts: Mapping[str, torch.Tensor]
    ) -> float:
        """D_u of the unit of `scope` made of this rank's microbatches `steps`.

        Scope ``update`` here means the whole update, read from `global_parts`; an additive
        kind's update-scope D is instead the sum of every rank's `update_share`.
        """
        d = self.spec.denominator
        batches = [self.microbatches[s] for s in steps]
        if d.kind == "configured":
            return float(d.value)
        if d.kind == "one":
            return 1.0
        if d.kind == "tokens":
            return float(sum(int(token_mask(b, d.mask).sum()) for b in batches))
        if d.kind == "slots":
            return float(sum(b.targets.numel() for b in batches))
        if d.kind == "weight_sum":
            m_w = [torch.where(token_mask(b, d.mask), b.weights.double(), 0.0) for b in batches]
            return math.fsum(float(x.sum()) for x in m_w)
        if d.kind == "abs_row_weight_sum":
            # Every row of the unit, fully masked ones included (TRL weighted_nll).
            return math.fsum(
                float(b.targets.shape[0] if b.row_weights is None else b.row_weights.abs().sum())
                for b in batches
            )
        name = "den_present" if d.kind == "all_groups" else "den_count"
        if self.den_group in self.local_groupings:
            # Groups inside single microbatches: the unit's value is the sum of theirs.
            return math.fsum(self._group_value(self.vectors[name][s]) for s in steps)
        if scope == "update":
            vector = global_parts[name]
        else:
            vector = torch.stack([self.vectors[name][s] for s in steps]).sum(dim=0)
        if d.kind != "power_sum":
            return float(int((vector > 0).sum()))
        count_scope = self.spec.weight.count_scope
        if SCOPES.index(count_scope) >= SCOPES.index(scope):
            # The count unit holds u: u's non-empty groups with their count-scope counts.
            return _psum(self._vector(name, count_scope, steps[0], global_parts), vector, d.alpha)
        # Count units inside u: each one's groups on their own (microbatch counts in a rank).
        return math.fsum(
            _psum(self.vectors[name][s], self.vectors[name][s], d.alpha) for s in steps
        )

    def _group_value(self, vector: torch.Tensor) -> float:
        """groups / all_groups / power_sum of one microbatch's row or segment groups."""
        d = self.spec.denominator
        if d.kind == "power_sum":
            return _psum(vector, vector, d.alpha)
        return float(int((vector > 0).sum()))

    def additive(self) -> bool:
        """Whether the update-scope D is the sum over ranks of `update_share`."""
        d = self.spec.denominator
        if d.kind in ("configured", "one"):
            return False
        if (
            d.kind in ("groups", "all_groups", "power_sum")
            and self.den_group not in self.local_groupings
        ):
            # A global id grouping: counts of the whole update, unless power_sum counts at a
            # scope inside the update (then every rank's cells are its own: a sum again).
            return d.kind == "power_sum" and self.spec.weight.count_scope != "update"
        return True

    def update_share(self) -> float:
        """This rank's share of an additive update-scope D (no collective needed: local)."""
        if not self.additive():
            return 0.0
        if self.spec.denominator.kind == "abs_row_weight_sum" and self.context_rank != 0:
            # Every context rank of a data rank holds the same rows: one of them counts them.
            return 0.0
        return self.unit_denominator(range(len(self.microbatches)), "rank", {})

    def valid_tokens(self) -> int:
        return sum(int(b.valid.sum()) for b in self.microbatches)
