r"""nanoGPT's gradient accumulation under DDP: a step ``crosscheck verify`` rejects for token_mean.

Mirrors the training loop of Karpathy's nanoGPT (``train.py``)::

    for micro_step in range(gradient_accumulation_steps):
        if ddp:
            model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)
        logits, loss = model(X, Y)             # F.cross_entropy(..., ignore_index=-1): a mean
        loss = loss / gradient_accumulation_steps
        scaler.scale(loss).backward()

(``no_sync()`` below is the context-manager spelling of that flag). Each microbatch's loss is
the mean over its own n_rm valid targets, divided by M, and DDP averages the R ranks, so token
t of rank r, microbatch m weighs

.. math::  \frac{v_t}{R\, M\, n_{rm}} \quad\text{instead of}\quad \frac{v_t}{\sum_{r,m} n_{rm}}.

``crosscheck verify`` with the token_mean scheme FAILS it and diagnoses the gradient as
``microbatch_mean`` (``rank_mean`` at M = 1): a token in a microbatch with few valid targets
counts for more. It is exact only when every microbatch holds the same number of valid
targets, as nanoGPT's own data does (fixed-length blocks, nothing ignored); padding, packing
with ignored boundaries or prompt masking break it.
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.functional import cross_entropy
from torch.nn.parallel import DistributedDataParallel

IGNORE_INDEX = -100


def step(model: DistributedDataParallel, microbatches: list[dict[str, torch.Tensor]]) -> None:
    """One update's backward passes, nanoGPT-style: per-microbatch mean loss divided by M."""
    accum_steps = len(microbatches)
    for micro_step, batch in enumerate(microbatches):
        last = micro_step == accum_steps - 1
        # Only the last backward all-reduces; the others accumulate locally.
        with contextlib.nullcontext() if last else model.no_sync():
            logits = model(batch["inputs"])
            loss = cross_entropy(
                logits.view(-1, logits.size(-1)),
                batch["targets"].view(-1),
                ignore_index=IGNORE_INDEX,
            )
            loss = loss / accum_steps  # scale the loss to account for gradient accumulation
            loss.backward()
