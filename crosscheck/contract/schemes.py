r"""The normalization contract: every weighting scheme as a named object (numpy, float64).

One optimizer update sees a global batch laid out over R ranks and M microbatches. A scheme
gives every token a *local* weight :math:`a_t` (computable inside its own microbatch) and every
microbatch a denominator contribution :math:`d`; the objective is

.. math::

    L = \frac{\sum_t a_t\, l_t}{D}, \qquad D = \sum_{\text{microbatches}} d

so the effective weight of token t is :math:`a_t / D`. Intended schemes are invariant to the
layout (R, M) of the same global batch. The two accidental schemes (``rank_mean``,
``microbatch_mean``) are what frameworks produce when each rank or microbatch takes its own
mean and the results are averaged; they are not of the (a_t, d) form and exist so a gradient
can be compared with them and the bug named.

This is the numpy reference of the contract. The JAX and torch implementations write the same
math again on purpose: sharing this code would hide a shared bug.

One word, three packages. Here a *scheme* is a `Scheme` object: the spec of an objective's
normalization, with its parameters (``Constant(4096)`` holds C), that computes effective
weights; every scheme, the two accidental ones included, has one, and `Scheme.spec` is the
name `get_scheme` reads back (``constant:4096``). The references use the same names for the
same math in their own form, and only for the six intended schemes:

* ``torch_impl.schemes``: a scheme is a ``WeightingScheme``, a name plus pure functions
  (a_t and d of one microbatch) and ``fixed_denominator``; ``torch_impl.schemes.get_scheme``
  takes a name or a ``WeightingScheme``, ``constant(normalizer)`` holds C;
* ``jax_impl.schemes``: ``Scheme`` is an ``IntEnum`` of names (its value indexes
  ``lax.switch`` in a compiled step) and carries no parameter: C travels beside it, as the
  ``constant_normalizer`` argument of ``jax_impl.schemes.global_denominator``.

So a name (``"token_mean"``) means the same scheme in all three; a parameter lives in the
object here and in torch, beside the enum in JAX. Crosscheck hands the references names
(the matrix refuses a parameter it could not hand on: `crosscheck.run.plan`), and keeps the
`Scheme` object wherever it judges (``crosscheck.verify``, ``crosscheck.diagnose``).
"""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np

from crosscheck.contract.layout import LaidOutBatch, Microbatch


def _per_group_counts(group_keys: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """For every token, the number of valid tokens sharing its group key (same shape)."""
    _, inverse = np.unique(group_keys.ravel(), return_inverse=True)
    counts = np.bincount(inverse, weights=valid.ravel().astype(np.float64))
    return counts[inverse].reshape(group_keys.shape)


def _segment_keys(mb: Microbatch) -> np.ndarray:
    """A key per token identifying (row, segment id) within the microbatch."""
    rows = np.arange(mb.targets.shape[0], dtype=np.int64)[:, None]
    width = int(mb.segment_ids.max(initial=0)) + 1
    return rows * width + mb.segment_ids.astype(np.int64)


def _normalize_groups(counts: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """v_t / n_group(t), and 0 where the group has no valid token (no 0/0)."""
    safe = np.where(counts > 0, counts, 1.0)
    return np.where(valid, 1.0 / safe, 0.0)


class Scheme:
    """A named weighting scheme. Subclasses document their math in the docstring."""

    name: ClassVar[str]
    intended: ClassVar[bool] = True
    #: D for the whole update when it does not come from summing d (``sum``; ``constant(C)``).
    fixed_denominator: float | None = None

    def token_weights(self, mb: Microbatch) -> np.ndarray:
        """a_t for every token of one microbatch, [B, T] float64."""
        raise NotImplementedError(f"{self.name} has no local token weight a_t")

    def denominator(self, mb: Microbatch) -> float:
        """d, this microbatch's contribution to D."""
        raise NotImplementedError(f"{self.name} has no denominator contribution d")

    def global_denominator(self, batch: LaidOutBatch) -> float:
        """D = sum of d over all R M microbatches of the update (correctly rounded sum)."""
        if self.fixed_denominator is not None:
            return float(self.fixed_denominator)
        return math.fsum(self.denominator(mb) for _, _, mb in batch.microbatches())

    def effective_weights(self, batch: LaidOutBatch) -> np.ndarray:
        """Every token's effective weight a_t / D, [R, M, B, T] float64.

        When D = 0 (no token carries weight anywhere in the update) every weight is 0: the
        objective is empty, its gradient is zero, and no NaN is produced.
        """
        D = self.global_denominator(batch)
        R, M = batch.layout.world_size, batch.layout.accum_steps
        out = np.zeros(batch.targets.shape, dtype=np.float64)
        if D == 0:
            return out
        for r in range(R):
            for m in range(M):
                out[r, m] = self.token_weights(batch.microbatch(r, m)) / D
        return out

    @property
    def spec(self) -> str:
        """The scheme as `get_scheme` reads it back: its name, or ``constant:C`` with a C."""
        if self.name == "constant" and self.fixed_denominator is not None:
            return f"constant:{self.fixed_denominator:.17g}"
        return self.name

    def __repr__(self) -> str:
        return f"<scheme {self.spec}>"


class TokenMean(Scheme):
    r"""Global token mean: every valid token of the update weighs the same.

    :math:`a_t = v_t`, :math:`d = \sum_{t \in mb} v_t`, so :math:`L = \sum_t v_t l_t / \sum_t v_t`
    over the whole global batch (torchtitan's ``global_valid_tokens``).
    """

    name = "token_mean"

    def token_weights(self, mb: Microbatch) -> np.ndarray:
        return mb.valid.astype(np.float64)

    def denominator(self, mb: Microbatch) -> float:
        return float(np.count_nonzero(mb.valid))


class SequenceMean(Scheme):
    r"""Mean over sequences (packed documents) of each sequence's token mean.

    A sequence is a (row, segment id) pair with segment id > 0; segment 0 is padding.
    :math:`a_t = v_t / n_{seg}(t)`, :math:`d` = number of segments with :math:`n_{seg} > 0`.
    """

    name = "sequence_mean"

    def token_weights(self, mb: Microbatch) -> np.ndarray:
        counts = _per_group_counts(_segment_keys(mb), mb.valid)
        return _normalize_groups(counts, mb.valid)

    def denominator(self, mb: Microbatch) -> float:
        keys = _segment_keys(mb)[mb.valid]
        return float(np.unique(keys).size)


class RowMean(Scheme):
    r"""Mean over rows (examples) of each row's token mean.

    :math:`a_t = v_t / n_{row}(t)`, :math:`d` = number of rows with :math:`n_{row} > 0`.
    """

    name = "row_mean"

    def token_weights(self, mb: Microbatch) -> np.ndarray:
        counts = np.broadcast_to(mb.valid.sum(axis=1, keepdims=True), mb.valid.shape)
        return _normalize_groups(counts.astype(np.float64), mb.valid)

    def denominator(self, mb: Microbatch) -> float:
        return float(np.count_nonzero(mb.valid.any(axis=1)))


class WeightedMean(Scheme):
    r"""Mean weighted by per-token soft weights :math:`w_t \ge 0`.

    :math:`a_t = w_t v_t`, :math:`d = \sum_{t \in mb} w_t v_t`.
    """

    name = "weighted_mean"

    def token_weights(self, mb: Microbatch) -> np.ndarray:
        return np.where(mb.valid, mb.weights, 0.0).astype(np.float64)

    def denominator(self, mb: Microbatch) -> float:
        return math.fsum(np.where(mb.valid, mb.weights, 0.0).ravel().tolist())


class Constant(Scheme):
    r"""Sum of valid-token losses over a normalizer fixed before the batch is seen.

    :math:`a_t = v_t`. By default :math:`d = B \cdot T`, every target slot of the microbatch,
    padding included, so :math:`D = N \cdot T` (T5X's ``NUM_TOTAL_TARGET_TOKENS``). With an
    explicit ``normalizer`` C, :math:`D = C` for the update.
    """

    name = "constant"

    def __init__(self, normalizer: float | None = None) -> None:
        if normalizer is not None and not normalizer > 0:
            raise ValueError(f"constant normalizer must be > 0, got {normalizer!r}")
        self.fixed_denominator = normalizer

    def token_weights(self, mb: Microbatch) -> np.ndarray:
        return mb.valid.astype(np.float64)

    def denominator(self, mb: Microbatch) -> float:
        return float(mb.targets.size)


class Sum(Scheme):
    r"""Plain sum of valid-token losses: :math:`a_t = v_t`, :math:`D = 1`."""

    name = "sum"
    fixed_denominator = 1.0

    def token_weights(self, mb: Microbatch) -> np.ndarray:
        return mb.valid.astype(np.float64)


class RankMean(Scheme):
    r"""Accidental: each rank takes its own token mean, the all-reduce averages the ranks.

    Token t on rank r weighs :math:`v_t / (R\, n_r)` with :math:`n_r` the valid tokens of rank
    r over all its microbatches. A rank with :math:`n_r = 0` contributes nothing here (a real
    framework computes 0/0 = NaN there). This is the seed example's 9x. Its weight
    :math:`a_t = v_t / n_r` is rank-local, not microbatch-local (:math:`d = 1` per rank), which
    is why it overrides ``effective_weights`` instead of giving ``token_weights``.
    """

    name = "rank_mean"
    intended = False

    def effective_weights(self, batch: LaidOutBatch) -> np.ndarray:
        R = batch.layout.world_size
        valid = batch.valid
        n_rank = valid.sum(axis=(1, 2, 3), keepdims=True).astype(np.float64)
        return _normalize_groups(np.broadcast_to(n_rank, valid.shape), valid) / R


class MicrobatchMean(Scheme):
    r"""Accidental: each microbatch takes its own token mean; microbatches and ranks averaged.

    Token t on rank r, microbatch m weighs :math:`v_t / (R\, M\, n_{rm})` (nanoGPT-style loops,
    optax.MultiSteps with a mean loss, transformers#34191). It happens to be of the local form,
    :math:`a_t = v_t / n_{rm}` and :math:`d = 1` for every microbatch, empty ones included
    (they add 1 to D and nothing to the numerator), so :math:`D = R M`. What makes it
    accidental is that D counts microbatches, which depends on the layout, not the data.
    """

    name = "microbatch_mean"
    intended = False

    def token_weights(self, mb: Microbatch) -> np.ndarray:
        counts = np.full(mb.valid.shape, float(np.count_nonzero(mb.valid)))
        return _normalize_groups(counts, mb.valid)

    def denominator(self, mb: Microbatch) -> float:
        return 1.0


SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        TokenMean(),
        SequenceMean(),
        RowMean(),
        WeightedMean(),
        Constant(),
        Sum(),
        RankMean(),
        MicrobatchMean(),
    )
}
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


def get_scheme(scheme: str | Scheme) -> Scheme:
    """Look a scheme up by name; a Scheme passes through unchanged.

    ``constant:C`` is the constant scheme with the explicit normalizer C (``Constant(C)``);
    plain ``constant`` counts every target slot.
    """
    if isinstance(scheme, Scheme):
        return scheme
    name, sep, argument = str(scheme).partition(":")
    if sep:
        if name != "constant":
            raise ValueError(
                f"only constant takes a parameter (constant:C), got {scheme!r}; known schemes: "
                f"{', '.join(SCHEMES)}"
            )
        try:
            normalizer = float(argument)
        except ValueError:
            raise ValueError(f"constant:C needs a number C, got {scheme!r}") from None
        if not (math.isfinite(normalizer) and normalizer > 0):
            raise ValueError(f"constant:C needs a finite C > 0, got {scheme!r}")
        return Constant(normalizer)
    try:
        return SCHEMES[scheme]
    except KeyError:
        raise ValueError(
            f"unknown scheme {scheme!r}; known schemes: {', '.join(SCHEMES)} "
            "(and constant:C for an explicit normalizer C)"
        ) from None


def effective_weights(scheme: str | Scheme, batch: LaidOutBatch) -> np.ndarray:
    """Every token's effective weight in the global [N, T] order for a laid-out batch."""
    return batch.to_global(get_scheme(scheme).effective_weights(batch))
