r"""The plain DDP loop with ``F.cross_entropy(reduction="mean")``: the bug, reproduced on purpose.

This is the shape of nanoGPT's ``train.py`` and of many hand-written loops: each microbatch
takes its own token mean, divides by the accumulation steps, and DDP averages over ranks. Token
t on rank r, microbatch m then weighs

.. math::

    \frac{v_t}{R\, M\, n_{rm}}

(docs/bugs.md microbatch-mean, transformers#34191), and at M = 1 that is :math:`v_t / (R\, n_r)`
(rank-mean, the seed example's 9x; torchtune#2980, prime-rl#2358). A microbatch without a valid
target reports a loss of 0/0 = NaN, but its gradient is exactly zero (``nll_loss``'s backward
skips ignored targets), so it adds nothing: the oracle's convention for the accidental schemes.
The reference keeps this loop so the suite can show it reproduces the accidental schemes of the
oracle exactly, i.e. that the comparison would catch a real loop written this way.

The logits are upcast to float32 at least before the mean, as Hugging Face's ``logits.float()``
does. That keeps the count of the accident exact: ``F.cross_entropy(reduction="mean")`` divides
by n_rm accumulated in the input's dtype, and in bf16 a microbatch of 1028 valid tokens counts
as 1024 (bf16 holds integers exactly only to 256); in float32 the count is exact to 2^24 tokens
per microbatch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn.functional import cross_entropy

from torch_impl.batch import IGNORE_INDEX, TokenBatch
from torch_impl.update import sync_context


def accumulate_mean_loss(
    model: nn.Module, microbatches: Sequence[TokenBatch], *, vocab_size: int
) -> list[float]:
    """Backpropagate mean(l_t over the microbatch) / M for each microbatch; returns the means."""
    accum_steps = len(microbatches)
    means = []
    for step, batch in enumerate(microbatches):
        batch.validate(vocab_size)
        with sync_context(model, step == accum_steps - 1):
            logits = model(batch.inputs)
            # float32 at least (float64 stays): the mean's token count is kept in this dtype.
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
            loss = cross_entropy(
                logits.flatten(0, 1),
                batch.targets.flatten(),
                ignore_index=IGNORE_INDEX,
                reduction="mean",
            )
            (loss / accum_steps).backward()
        means.append(float(loss.detach()))
    return means
