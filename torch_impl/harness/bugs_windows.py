r"""One accumulation window of every buggy loop of docs/bugs.md, written as torch loops are.

Every function here runs the backward passes of one window (optimizer update) on one rank of a
DistributedDataParallel-wrapped model and returns the denominator the loop would log. The
driver (``torch_impl.harness.bugs``) zeroes the gradients between windows and reads ``.grad`` after
the last one: what the optimizer would receive. The patterns' wording is the contract of
``crosscheck.diagnosis.patterns``; the math is written here again, in torch, on purpose.

Notation: R ranks, M microbatches per rank, :math:`l_t` the cross-entropy of token t,
:math:`v_t = 1` where the target carries a loss, :math:`n_r` / :math:`n_{rm}` the valid
targets of rank r / of its microbatch m, :math:`D = \sum_r n_r` the global valid count.

The intended token mean is :math:`g = \nabla \sum_t v_t l_t / D`. DDP *averages* the R ranks'
gradients, so a correct loop backpropagates :math:`R \sum_{t \in (r, m)} v_t l_t / D` on every
microbatch: the average of R such gradients is g (torchtitan multiplies by the world size for
the same reason). Each bug below deviates from that loop in exactly one place, marked ``BUG``.
As in the real loops, no bug guards 0/0: a step whose denominator is 0 produces NaN. The pieces
the loops share (`Window`, the sync context, the global count, the scaled window) are in
``torch_impl.harness.windows``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from torch_impl.batch import TokenBatch
from torch_impl.harness.bugs_context import (
    cp_count_over_dp_only,
    cp_count_over_replicas,
    cp_local_count,
    cp_local_sequence_count,
    missing_cp_compensation,
)
from torch_impl.harness.bugs_groups import local_group_count, zero_count_nan
from torch_impl.harness.windows import (
    Window,
    WindowStep,
    accumulating,
    cross_entropy_of,
    global_sum,
    local_valid,
    scaled_sum_window,
    token_mean_with_count,
)
from torch_impl.pipeline import PipelinePosition, PipelineResult, Stage, pipeline_update

#: A pipeline pattern's window on one stage (``torch_impl.pipeline``).
PipelineStep = Callable[[Stage, Sequence[TokenBatch], PipelinePosition], PipelineResult]

#: The calibration step's id (crosscheck.diagnosis.patterns.RANK_SKEW; torch_impl does not import
#: the harness, so the string is repeated here and checked against it in the tests).
RANK_SKEW = "rank-skew"


def rank_mean(model: nn.Module, microbatches: Sequence[TokenBatch], window: Window) -> float:
    r"""rank-mean: each rank divides its loss sum by its own :math:`n_r`; DDP averages ranks.

    Token t of rank r weighs :math:`v_t / (R\, n_r)` instead of :math:`v_t / D`: the seed
    example's 9x between a 100-token and a 900-token rank. Upstream: seed example;
    torchtune#2980; prime-rl#2358. Logs :math:`n_r`.
    """
    n_rank = local_valid(microbatches)  # BUG: never all-reduced
    scaled_sum_window(model, microbatches, window, n_rank, 1.0)
    return float(n_rank)


def microbatch_mean(model: nn.Module, microbatches: Sequence[TokenBatch], window: Window) -> float:
    r"""microbatch-mean: ``reduction="mean"`` per microbatch, divided by M; DDP averages.

    Token t of microbatch (r, m) weighs :math:`v_t / (R\, M\, n_{rm})` (the nanoGPT loop).
    Upstream: transformers#34191; nanoGPT; T5X microbatches; Levanter MEAN; optax.MultiSteps
    with a mean loss. Logs :math:`n_{rm}` of this rank's last microbatch.
    """
    for step, batch in enumerate(microbatches):
        with accumulating(model, step, window.accum_steps):
            loss = cross_entropy_of(model, batch, "mean")  # BUG: a mean per microbatch
            (loss / window.accum_steps).backward()
    return float(microbatches[-1].valid.sum())


def microstep_mean(model: nn.Module, microbatches: Sequence[TokenBatch], window: Window) -> float:
    r"""microstep-mean: each microbatch's own count, all-reduced, divided by M.

    Before each microbatch's backward the loop all-reduces that microbatch's valid count,
    :math:`n_m = \sum_r n_{rm}`, and backpropagates :math:`R \sum_{t \in (r, m)} v_t l_t /
    (n_m M)` (x R against DDP's average): token t of microbatch m weighs
    :math:`v_t / (M\, n_m)`, every rank of a microbatch alike. Upstream: optax.MultiSteps with
    a mean loss under jit over a globally sharded batch (the optax gradient accumulation
    guide); transformers#34191 is the per-rank cousin. Logs :math:`n_m` of the last microbatch.
    """
    n_m = torch.zeros((), dtype=torch.int64)
    for step, batch in enumerate(microbatches):
        # BUG: a count per microbatch (over all ranks), not one for the whole window.
        n_m = global_sum(batch.valid.sum())
        with accumulating(model, step, window.accum_steps):
            loss = cross_entropy_of(model, batch, "sum") / n_m / window.accum_steps
            (loss * window.world_size).backward()
    return float(n_m)


def missing_world_size(
    model: nn.Module, microbatches: Sequence[TokenBatch], window: Window
) -> float:
    r"""missing-world-size: the right global D, but nobody undoes DDP's average over R.

    Backpropagates :math:`\sum_t v_t l_t / D`; the gradient is :math:`g / R`.
    Upstream: transformers#37474. Logs D.
    """
    denominator = global_sum(local_valid(microbatches))
    scaled_sum_window(model, microbatches, window, denominator, 1.0)  # BUG: scale 1, not R
    return float(denominator)


def double_world_size(
    model: nn.Module, microbatches: Sequence[TokenBatch], window: Window
) -> float:
    r"""double-world-size: the user multiplies by R and a wrapper multiplies by R again.

    Backpropagates :math:`R \cdot R \sum_t v_t l_t / D`; the gradient is :math:`R\, g`.
    Upstream: liquid-finetune#38; transformers#48690. Logs D.
    """
    R = window.world_size
    denominator = global_sum(local_valid(microbatches))
    for step, batch in enumerate(microbatches):
        with accumulating(model, step, window.accum_steps):
            loss = cross_entropy_of(model, batch, "sum") * R / denominator  # the user's x R
            (loss * R).backward()  # BUG: the wrapper's x R on top
    return float(denominator)


def double_accum_scale(
    model: nn.Module, microbatches: Sequence[TokenBatch], window: Window
) -> float:
    r"""double-accum-scale: the loss is rescaled by the accumulation count once too often.

    D already covers all M microbatches, yet each microbatch loss
    :math:`R \sum_t v_t l_t / D` is multiplied by M; the gradient is :math:`M\, g`.
    Upstream: transformers#35438. Logs D.
    """
    denominator = global_sum(local_valid(microbatches))
    for step, batch in enumerate(microbatches):
        with accumulating(model, step, window.accum_steps):
            loss = cross_entropy_of(model, batch, "sum") * window.world_size / denominator
            (loss * window.accum_steps).backward()  # BUG: x M on a globally normalized loss
    return float(denominator)


def double_accum_divide(
    model: nn.Module, microbatches: Sequence[TokenBatch], window: Window
) -> float:
    r"""double-accum-divide: a loss normalized over the whole window is divided by M again.

    The user's loss already divides by the window's global count (``num_items_in_batch``
    counts all M microbatches of all ranks, and the user multiplies by R against DDP's
    average): :math:`R \sum_{t \in (r, m)} v_t l_t / D`. The trainer's training step then
    divides every microbatch loss by ``gradient_accumulation_steps`` before backward, as it
    would a per-microbatch mean: the gradient is :math:`g / M`.
    Upstream: ms-swift#10117. Logs D.
    """
    num_items_in_batch = global_sum(local_valid(microbatches))
    for step, batch in enumerate(microbatches):
        with accumulating(model, step, window.accum_steps):
            # The user's compute_loss: right on its own.
            loss = cross_entropy_of(model, batch, "sum") * window.world_size / num_items_in_batch
            (loss / window.accum_steps).backward()  # BUG: the trainer's / M on top
    return float(num_items_in_batch)


def unshifted_count(model: nn.Module, microbatches: Sequence[TokenBatch], window: Window) -> float:
    r"""unshifted-count: labels are counted before the causal shift drops each row's first.

    Every row with a valid target counts one label more,
    :math:`C = D + \#\{\text{rows with a valid target}\}`; the loss sums are right, so the
    gradient is :math:`\frac{D}{C}\, g`. Upstream: transformers#46204. Logs C.
    """
    # BUG: the labels counted before the shift. The fixture's targets are already shifted;
    # counting unshifted labels adds the label the shift drops, once per row with a target.
    return token_mean_with_count(
        model, microbatches, window, lambda b: b.valid.sum() + b.valid.any(dim=1).sum()
    )


def attention_mask_count(
    model: nn.Module, microbatches: Sequence[TokenBatch], window: Window
) -> float:
    r"""attention-mask-count: the denominator counts attended positions, not loss targets.

    :math:`C = \#\{t : \text{segment\_id}_t > 0\}` (prompts, image placeholders and document
    ends included); the gradient is :math:`\frac{D}{C}\, g`.
    Upstream: unsloth-zoo#1217; multimodal trainers. Logs C.
    """
    # BUG: attention_mask.sum() where (labels != -100).sum() was meant.
    return token_mean_with_count(model, microbatches, window, lambda b: (b.segment_ids > 0).sum())


def padding_as_tokens(
    model: nn.Module, microbatches: Sequence[TokenBatch], window: Window
) -> float:
    r"""padding-as-tokens: the denominator counts every target slot, :math:`C = N T`.

    Padding and ignored targets are counted as tokens; the gradient is
    :math:`\frac{D}{N T}\, g`. Upstream: T5X NUM_TOTAL_TARGET_TOKENS vs
    NUM_REAL_TARGET_TOKENS. Logs N T.
    """
    # BUG: targets.numel() (NUM_TOTAL_TARGET_TOKENS) where the valid count was meant.
    return token_mean_with_count(
        model, microbatches, window, lambda b: torch.tensor(b.targets.numel(), dtype=torch.int64)
    )


def clip_per_microbatch(
    model: nn.Module, microbatches: Sequence[TokenBatch], window: Window
) -> float:
    r"""clip-per-microbatch: each accumulation step's synchronized gradient is clipped alone.

    Step m backpropagates the correct :math:`R \sum_{t \in (r, m)} v_t l_t / D` *with* DDP
    sync, so ``.grad`` holds :math:`g_m`, all ranks' microbatch m; ``clip_grad_norm_`` scales
    it by :math:`\min(1, c / (\lVert g_m \rVert + 10^{-6}))` before it joins the accumulator:
    :math:`\sum_m \mathrm{clip}(g_m)` instead of :math:`\mathrm{clip}(\sum_m g_m)`, with
    c = ``window.clip_norm`` (crosscheck.diagnosis.patterns.CLIP_PER_MICROBATCH_NORM).
    Upstream: transformers#986; gpt-jax#2 (optax.apply_every).
    Logs D.
    """
    denominator = global_sum(local_valid(microbatches))
    params = [p for p in model.parameters() if p.requires_grad]
    accumulator = [torch.zeros_like(p) for p in params]
    for batch in microbatches:
        model.zero_grad(set_to_none=True)
        # BUG: no no_sync() and a clip inside the accumulation loop.
        (cross_entropy_of(model, batch, "sum") * window.world_size / denominator).backward()
        torch.nn.utils.clip_grad_norm_(params, max_norm=window.clip_norm)
        for total, p in zip(accumulator, params, strict=True):
            total.add_(p.grad)
    # What the optimizer reads.
    for total, p in zip(accumulator, params, strict=True):
        p.grad = total
    return float(denominator)


def stale_count(model: nn.Module, microbatches: Sequence[TokenBatch], window: Window) -> float:
    r"""stale-count: the global token counter lives across windows and is never reset.

    Window k divides by :math:`k D`: the diagnosed second window's gradient is :math:`g / 2`.
    Upstream: torchtune#1917 (review). Logs 2 D.
    """
    counter = window.carry.setdefault("num_tokens", torch.zeros((), dtype=torch.int64))
    counter += global_sum(local_valid(microbatches))  # BUG: no counter.zero_() per window
    scaled_sum_window(model, microbatches, window, counter, window.world_size)
    return float(counter)


def double_reduce_count(
    model: nn.Module, microbatches: Sequence[TokenBatch], window: Window
) -> float:
    r"""double-reduce-count: the count buffer is all-reduced in place, then all-reduced again.

    After the first reduce every rank holds D; the second sums R copies: :math:`R D`, and the
    gradient is :math:`g / R`. Upstream: Megatron-LM#7481. Logs R D.
    """
    num_tokens = local_valid(microbatches)
    dist.all_reduce(num_tokens)  # in the loss function
    dist.all_reduce(num_tokens)  # BUG: the step reduces the same (already global) buffer
    scaled_sum_window(model, microbatches, window, num_tokens, window.world_size)
    return float(num_tokens)


def packed_as_one(model: nn.Module, microbatches: Sequence[TokenBatch], window: Window) -> float:
    r"""packed-as-one: the per-sequence mean is taken per packed row, not per document.

    Intended: sequence_mean, each (row, segment) averaged over its own valid targets. The loop
    treats a packed row as one sequence: token t of row i weighs :math:`v_t / (n_i D_{rows})`
    with :math:`n_i` the row's valid targets (shared by all its segments) and
    :math:`D_{rows}` the global number of rows with a valid target.
    Upstream: packing collators; functionary#265. Logs :math:`D_{rows}`.
    """
    local_rows = sum(
        (b.valid.any(dim=1).sum() for b in microbatches), torch.zeros((), dtype=torch.int64)
    )
    num_sequences = global_sum(local_rows)  # BUG: rows, not (row, segment) pairs
    for step, batch in enumerate(microbatches):
        with accumulating(model, step, window.accum_steps):
            losses = cross_entropy_of(model, batch, "none")
            # BUG: one mean per row; segment_ids are never looked at. A row without a valid
            # target has a zero sum, and clamp keeps its mean 0 (0/0 is not this bug).
            row_means = losses.sum(dim=1) / batch.valid.sum(dim=1).clamp(min=1)
            (row_means.sum() * window.world_size / num_sequences).backward()
    return float(num_sequences)


def float32_count(model: nn.Module, microbatches: Sequence[TokenBatch], window: Window) -> float:
    r"""float32-count: the weighted mean's denominator is accumulated and reduced in float32.

    Intended: weighted_mean, :math:`\sum_t w_t v_t l_t / W` with :math:`W = \sum_t w_t v_t`.
    The loop keeps W in a float32 tensor; past :math:`2^{24}` it rounds to a neighbour
    :math:`\tilde W` of W and the gradient is :math:`\frac{W}{\tilde W} g` (losses stay in the
    model's dtype). Upstream: large-batch pretraining. Logs :math:`\tilde W`.
    """
    weight_total = torch.zeros((), dtype=torch.float32)  # BUG: float32 for a 2^24+ count
    for batch in microbatches:
        weight_total += torch.where(batch.valid, batch.weights, 0.0).to(torch.float32).sum()
    weight_total = global_sum(weight_total)
    for step, batch in enumerate(microbatches):
        with accumulating(model, step, window.accum_steps):
            losses = cross_entropy_of(model, batch, "none")
            weighted = (losses * batch.weights.to(losses.dtype)).sum()
            # Dividing by the 0-dim float32 tensor keeps the loss's dtype (type promotion
            # between 0-dim tensors picks the wider float): only W is rounded.
            (weighted * window.world_size / weight_total).backward()
    return float(weight_total)


def rank_skew(model: nn.Module, microbatches: Sequence[TokenBatch], window: Window) -> float:
    r"""rank-skew: the correct token-mean loop, except rank 0's loss is multiplied by `skew`.

    The gradient is :math:`g + (\mathrm{skew} - 1)\, g_0` with :math:`g_0` rank 0's share of
    g: the smallest distortion verification should flag (not a docs/bugs.md pattern; skew 1 is
    the correct step). Logs D.
    """
    denominator = global_sum(local_valid(microbatches))
    scale = window.world_size * (window.skew if window.rank == 0 else 1.0)
    scaled_sum_window(model, microbatches, window, denominator, scale)
    return float(denominator)


def pp_unsent_count(
    stage: Stage, microbatches: Sequence[TokenBatch], position: PipelinePosition
) -> PipelineResult:
    r"""pp-unsent-count: postnorm through a 1F1B pipeline, D never sent down.

    The last stage counts D from its labels and divides its own gradient after the schedule;
    stage 0 is never told D and keeps :math:`\sum_t v_t \nabla l_t`, D times its intended
    gradient. Upstream: torchtitan#4194 (pipeline gradients inflated by the token count);
    torchtitan#2972. Logs D (on the last stage).
    """
    return pipeline_update(
        stage,
        microbatches,
        "token_mean",
        position=position,
        schedule="1f1b",
        strategy="postnorm",
        count_to_first_stage=False,  # BUG: the count stays on the last stage
    )


#: Pattern id (crosscheck.diagnosis.patterns.PATTERNS, plus RANK_SKEW) -> its window.
WINDOW_STEPS: dict[str, WindowStep] = {
    "rank-mean": rank_mean,
    "microbatch-mean": microbatch_mean,
    "microstep-mean": microstep_mean,
    "missing-world-size": missing_world_size,
    "double-world-size": double_world_size,
    "double-accum-scale": double_accum_scale,
    "double-accum-divide": double_accum_divide,
    "unshifted-count": unshifted_count,
    "attention-mask-count": attention_mask_count,
    "clip-per-microbatch": clip_per_microbatch,
    "stale-count": stale_count,
    "double-reduce-count": double_reduce_count,
    "packed-as-one": packed_as_one,
    "padding-as-tokens": padding_as_tokens,
    "float32-count": float32_count,
    # Contract v2 (torch_impl.harness.bugs_groups).
    "local-group-count": local_group_count,
    "zero-count-nan": zero_count_nan,
    # Context parallel (torch_impl.harness.bugs_context).
    "cp-local-count": cp_local_count,
    "cp-count-over-replicas": cp_count_over_replicas,
    "cp-count-over-dp-only": cp_count_over_dp_only,
    "missing-cp-compensation": missing_cp_compensation,
    "cp-local-sequence-count": cp_local_sequence_count,
    RANK_SKEW: rank_skew,
}

#: The pipeline patterns: (stage, this data rank's microbatches, position) -> the stage's
#: result (``torch_impl.pipeline``); run by ``torch_impl.harness.bugs`` on R x 2 processes.
PIPELINE_STEPS: dict[str, PipelineStep] = {
    "pp-unsent-count": pp_unsent_count,
}
