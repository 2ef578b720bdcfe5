r"""Per-token losses and one microbatch's weighted sum :math:`\sum_t a_t l_t`, in torch.

The weights :math:`a_t` come from the update's scheme spec (``torch_impl.spec_counts``: a
token's weight may depend on counts over the whole update, so it is computed for every
microbatch of the update at once); this module runs the model and takes the weighted sum, in
float64 whatever the model's dtype (``accumulation_dtype``).

Written for torch on purpose, not ported from the numpy reference: the three implementations
are checked against each other, and shared code would hide a shared bug.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn
from torch.nn.functional import cross_entropy

from torch_impl.batch import IGNORE_INDEX, TokenBatch


def accumulation_dtype(device: torch.device | str = "cpu") -> torch.dtype:
    """The dtype in which sums of weights, loss sums and divisions by D are done: float64.

    Whatever the params' dtype: a weight sum or a count rounded to bf16 (8 significant bits)
    is wrong past 256, to float32 past 2^24 (docs/bugs.md float32-count). float64 is exact for
    integers to 2^53 and is there on CPU and CUDA; MPS has no float64, so there float32 is the
    best available (exact counts to 2^24, weight sums to 6e-8 relative).
    """
    return torch.float32 if torch.device(device).type == "mps" else torch.float64


class MicrobatchLoss(NamedTuple):
    """What one microbatch contributes to the update's loss sum."""

    #: sum_t a_t l_t, differentiable, in ``accumulation_dtype`` (float64 on CPU) whatever the
    #: model's dtype: the backward then rounds each token's seed a_t s / D to the model's
    #: dtype once, after the division, instead of rounding a_t, s / D and their product.
    weighted_sum: torch.Tensor
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
    weights: torch.Tensor,
    vocab_size: int,
    per_token_losses: PerTokenLosses = bilinear_token_losses,
) -> MicrobatchLoss:
    r"""Forward one microbatch and return :math:`\sum_t a_t l_t` and its valid tokens.

    `weights` is :math:`a_t` [B, T] (``SpecView.numerators``, or already over a local unit's
    :math:`D_u`). The batch is validated first, so a bad token fails with its rank, microbatch,
    row and position rather than inside ``F.cross_entropy``. a_t is float64 whatever the
    model's dtype (the spec builds it from the labels alone), and the weighted sum
    is taken in ``accumulation_dtype``: with bf16 params, a_t rounded to bf16 would already
    move a soft weight by up to :math:`2^{-9}`, and the sum of a_t l_t logged for metrics would
    carry bf16's error. `per_token_losses` runs the model (default: the bilinear model).
    """
    batch.validate(vocab_size)
    return validated_microbatch_loss(model, batch, weights, per_token_losses)


def validated_microbatch_loss(
    model: nn.Module,
    batch: TokenBatch,
    weights: torch.Tensor,
    per_token_losses: PerTokenLosses = bilinear_token_losses,
) -> MicrobatchLoss:
    """`microbatch_loss` of a batch its caller validated already (``batch.validate``, as the
    update loops' pre-check does for every microbatch of an update before any collective)."""
    losses = per_token_losses(model, batch)
    acc = accumulation_dtype(losses.device)
    weights = weights.to(device=losses.device, dtype=acc)
    return MicrobatchLoss(
        weighted_sum=(weights * losses.to(acc)).sum(),
        valid_tokens=int(batch.valid.sum()),
    )
