r"""Weighting schemes in torch: each microbatch returns :math:`(\sum_t a_t l_t,\ d)`.

The objective of one optimizer update over R ranks and M microbatches is

.. math::

    L = \frac{\sum_t a_t\, l_t}{D}, \qquad D = \sum_{\text{microbatches}} d

where :math:`l_t` is the token's cross-entropy, :math:`a_t` a weight computable inside the
microbatch and :math:`d` the microbatch's share of the denominator (docs/contract.md, "The
normalization contract"). A scheme is a name plus two pure functions, in the spirit of optax's
``GradientTransformation``; ``fixed_denominator`` replaces the sum of d when D is fixed before
the batch is seen (``sum``: D = 1; ``constant`` with an explicit normalizer C: D = C).

Written for torch on purpose, not ported from the numpy reference: the three implementations
are checked against each other, and shared code would hide a shared bug.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn
from torch.nn.functional import cross_entropy

from torch_impl.batch import IGNORE_INDEX, TokenBatch


class WeightingScheme(NamedTuple):
    """A scheme as pure functions of one microbatch."""

    name: str
    #: a_t for every token, float64 [B, T]; exactly 0 where the target is ignored. Built from
    #: the labels and weights alone, never from the model, so the params' dtype (bf16 too)
    #: cannot round it.
    token_weights: Callable[[TokenBatch], torch.Tensor]
    #: d, this microbatch's contribution to D (float64: counts come from integer sums and are
    #: exact; weight sums are float64 sums of the float64 weights).
    denominator: Callable[[TokenBatch], float]
    #: D for the whole update when it is not the sum of d.
    fixed_denominator: float | None = None


def _valid(batch: TokenBatch) -> torch.Tensor:
    return batch.valid.to(torch.float64)


def _per_valid_token(counts: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """v_t / n_group(t); a group with no valid token gives 0, never 0/0 = NaN."""
    return torch.where(valid, 1.0 / counts.clamp(min=1.0), torch.zeros_like(counts))


def _segment_counts(batch: TokenBatch) -> torch.Tensor:
    """Valid tokens per (row, segment id), one slot per pair: [B, S + 1]."""
    num_rows = batch.targets.shape[0]
    width = int(batch.segment_ids.max()) + 1 if batch.segment_ids.numel() else 1
    counts = torch.zeros(num_rows, width, dtype=torch.float64)
    return counts.scatter_add_(1, batch.segment_ids, _valid(batch))


def token_mean() -> WeightingScheme:
    r"""Global token mean: :math:`a_t = v_t`, :math:`d = \sum_{t \in mb} v_t`."""
    return WeightingScheme(
        "token_mean",
        token_weights=_valid,
        denominator=lambda b: float(b.valid.sum()),
    )


def sequence_mean() -> WeightingScheme:
    r"""Mean over packed documents of each document's token mean.

    A document is a (row, segment id) pair, segment 0 being padding (it never holds a valid
    target). :math:`a_t = v_t / n_{seg}(t)`, :math:`d` = documents with :math:`n_{seg} > 0`.
    """

    def weights(batch: TokenBatch) -> torch.Tensor:
        per_token = torch.gather(_segment_counts(batch), 1, batch.segment_ids)
        return _per_valid_token(per_token, batch.valid)

    return WeightingScheme(
        "sequence_mean",
        token_weights=weights,
        denominator=lambda b: float((_segment_counts(b) > 0).sum()),
    )


def row_mean() -> WeightingScheme:
    r"""Mean over rows of each row's token mean.

    :math:`a_t = v_t / n_{row}(t)`, :math:`d` = number of rows with :math:`n_{row} > 0`.
    """

    def weights(batch: TokenBatch) -> torch.Tensor:
        per_row = _valid(batch).sum(dim=1, keepdim=True).expand_as(batch.targets)
        return _per_valid_token(per_row, batch.valid)

    return WeightingScheme(
        "row_mean",
        token_weights=weights,
        denominator=lambda b: float(b.valid.any(dim=1).sum()),
    )


def weighted_mean() -> WeightingScheme:
    r"""Soft-weighted mean: :math:`a_t = w_t v_t`, :math:`d = \sum_{t \in mb} w_t v_t`.

    Ignored tokens may carry a nonzero :math:`w_t`; the :math:`v_t` factor drops them.
    """

    def weights(batch: TokenBatch) -> torch.Tensor:
        soft = batch.weights.to(torch.float64)
        return torch.where(batch.valid, soft, torch.zeros_like(soft))

    return WeightingScheme(
        "weighted_mean",
        token_weights=weights,
        denominator=lambda b: float(weights(b).sum()),
    )


def constant(normalizer: float | None = None) -> WeightingScheme:
    r"""Loss sum over a normalizer fixed in advance: :math:`a_t = v_t`.

    By default :math:`d = B T`, every target slot of the microbatch padding included, so
    :math:`D = N T` (T5X's NUM_TOTAL_TARGET_TOKENS); with `normalizer` C, :math:`D = C`.
    """
    if normalizer is not None and not normalizer > 0:
        raise ValueError(f"constant normalizer must be > 0, got {normalizer!r}")
    return WeightingScheme(
        "constant",
        token_weights=_valid,
        denominator=lambda b: float(b.targets.numel()),
        fixed_denominator=None if normalizer is None else float(normalizer),
    )


def loss_sum() -> WeightingScheme:
    r"""Plain sum of valid-token losses: :math:`a_t = v_t`, :math:`D = 1`."""
    return WeightingScheme(
        "sum",
        token_weights=_valid,
        denominator=lambda b: 0.0,
        fixed_denominator=1.0,
    )


SCHEMES: dict[str, Callable[[], WeightingScheme]] = {
    "token_mean": token_mean,
    "sequence_mean": sequence_mean,
    "row_mean": row_mean,
    "weighted_mean": weighted_mean,
    "constant": constant,
    "sum": loss_sum,
}


def get_scheme(scheme: str | WeightingScheme) -> WeightingScheme:
    """A scheme by name (the names of docs/contract.md); a WeightingScheme passes through."""
    if isinstance(scheme, WeightingScheme):
        return scheme
    try:
        return SCHEMES[scheme]()
    except KeyError:
        raise ValueError(
            f"unknown scheme {scheme!r}; torch_impl knows: {', '.join(SCHEMES)}"
        ) from None


def global_denominator(scheme: WeightingScheme, rank_denominators: list[float]) -> float:
    """D from every rank's summed d; ``fixed_denominator`` wins when the scheme has one."""
    if scheme.fixed_denominator is not None:
        return scheme.fixed_denominator
    # math.fsum is order-independent, so every rank (and both strategies) get the same D.
    return math.fsum(rank_denominators)


def accumulation_dtype(device: torch.device | str = "cpu") -> torch.dtype:
    """The dtype in which sums of weights, loss sums and divisions by D are done: float64.

    Whatever the params' dtype: a weight sum or a count rounded to bf16 (8 significant bits)
    is wrong past 256, to float32 past 2^24 (docs/bugs.md float32-count). float64 is exact for
    integers to 2^53 and is there on CPU and CUDA; MPS has no float64, so there float32 is the
    best available (exact counts to 2^24, weight sums to 6e-8 relative).
    """
    return torch.float32 if torch.device(device).type == "mps" else torch.float64


class MicrobatchLoss(NamedTuple):
    """What one microbatch contributes to the update."""

    #: sum_t a_t l_t, differentiable, in ``accumulation_dtype`` (float64 on CPU) whatever the
    #: model's dtype: the backward then rounds each token's seed a_t s / D to the model's
    #: dtype once, after the division, instead of rounding a_t, s / D and their product.
    weighted_sum: torch.Tensor
    #: d (float64).
    denominator: float
    #: Number of tokens with a loss (for metrics).
    valid_tokens: int


def token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    r"""l_t = logsumexp(z_t) - z_t[y_t], exactly 0 where y_t = IGNORE_INDEX; [B, T].

    Computed in float32 at least: logits of a bf16 model are upcast first, as Hugging Face's
    ``logits.float()`` does. In bf16 the log-softmax and its backward would round every
    :math:`l_t` and every :math:`p_t` to 8 significant bits; upcast, only the logits
    themselves carry bf16's rounding. float64 logits stay float64.
    """
    upcast = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return cross_entropy(
        upcast.flatten(0, 1), targets.flatten(), reduction="none", ignore_index=IGNORE_INDEX
    ).view_as(targets)


#: l_t [B, T] of one microbatch under a model (0 where the target is ignored): what a step
#: backpropagates through, so one update loop trains any model whose forward takes what the
#: microbatch holds (``torch_impl.transformer.microbatch_token_losses`` also reads segments).
PerTokenLosses = Callable[[nn.Module, TokenBatch], torch.Tensor]


def bilinear_token_losses(model: nn.Module, batch: TokenBatch) -> torch.Tensor:
    """The default `PerTokenLosses`: a model of the inputs alone (``BilinearLM``)."""
    return token_losses(model(batch.inputs), batch.targets)


def microbatch_loss(
    model: nn.Module,
    batch: TokenBatch,
    scheme: WeightingScheme,
    vocab_size: int,
    per_token_losses: PerTokenLosses = bilinear_token_losses,
) -> MicrobatchLoss:
    r"""Forward one microbatch and return :math:`(\sum_t a_t l_t,\ d)` and its valid tokens.

    The batch is validated first, so a bad token fails with its rank, microbatch, row and
    position rather than inside ``F.cross_entropy``. a_t and d are float64 whatever the
    model's dtype (``WeightingScheme`` builds them from the labels alone), and the weighted sum
    is taken in ``accumulation_dtype``: with bf16 params, a_t rounded to bf16 would already
    move a soft weight by up to :math:`2^{-9}`, and the sum of a_t l_t logged for metrics would
    carry bf16's error. `per_token_losses` runs the model (default: the bilinear model).
    """
    batch.validate(vocab_size)
    losses = per_token_losses(model, batch)
    acc = accumulation_dtype(losses.device)
    weights = scheme.token_weights(batch).to(device=losses.device, dtype=acc)
    return MicrobatchLoss(
        weighted_sum=(weights * losses.to(acc)).sum(),
        denominator=scheme.denominator(batch),
        valid_tokens=int(batch.valid.sum()),
    )
