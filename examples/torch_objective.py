r"""Multi-term objectives in a DDP accumulation loop: three correct steps and six bugs.

A training objective is rarely one cross-entropy (docs/objectives.md): MoE pretraining adds a
z-loss and a load-balancing loss, RL trainers an entropy bonus, multi-token prediction a second
head. Each term has its own mask, its own count and its own scope,

.. math::  \text{total} = \sum_k \lambda_k L_k,

and a term normalized against the wrong count is a bug even when every term on its own is right
(docs/bugs.md, "Multi-term objectives"). With :math:`h_t` the hidden state,
:math:`z_t = h_t W_{\text{unembed}}`, :math:`v_t` the valid targets and n their count over the
whole update (every rank, every microbatch):

* cross-entropy :math:`L_{ce} = \frac1n \sum_t v_t (\operatorname{lse}(z_t) - z_t[y_t])`;
* z-loss (PaLM) :math:`L_z = \frac1n \sum_t v_t \operatorname{lse}(z_t)^2`;
* load balancing (Switch, global-batch): over the update's :math:`n_r` real tokens (segment
  id > 0; padding is not routed), router probabilities :math:`\pi_t` and top-k picks,
  :math:`LB = E \sum_e f_e P_e` with :math:`f_e = c_e / (k n_r)` (:math:`c_e` real tokens that
  picked expert e: a count, no gradient) and :math:`P_e = \frac{1}{n_r} \sum_t \pi_{te}`;
* entropy bonus, meant per microbatch: :math:`L_H = \frac{1}{R M} \sum_{(r,m)}
  \frac{1}{n_{rm}} \sum_{t \in (r,m)} v_t H_t`, :math:`H_t = -\sum_v p_{tv} \log p_{tv}`,
  with a negative coefficient;
* multi-token prediction: the cross-entropy of the ``mtp_unembed`` head on ``mtp_targets``
  (the target one position further, within the segment), over its own count
  :math:`n' \le n`.

Every step runs the loop a DDP trainer runs for one optimizer update: a count pre-pass over
the M microbatches of the window, all-reduced once *before* any backward (the counts of the
whole update must be known before the first microbatch's gradient is taken); ``no_sync`` on
every microbatch but the last, so DDP all-reduces once; and each microbatch's loss multiplied
by R, because DDP *averages* the gradients over the R ranks and the objective is a sum over
ranks.

The steps (``crosscheck verify --framework torch --step examples.torch_objective:STEP
--objective examples.objectives:OBJECTIVE``):

* ``step`` (``MOE``): cross-entropy, z-loss and global-batch load balancing, every term over
  the whole update: intended.
* ``step_entropy_bonus`` (``ENTROPY_BONUS``): cross-entropy over the update, entropy bonus
  averaged per microbatch as the objective says: intended.
* ``step_mtp`` (``MTP``): cross-entropy and the MTP head over their own global counts:
  intended.
* ``step_z_loss_per_microbatch`` (``MOE``): the z-loss as each microbatch's own mean, divided
  by M, without the factor R: ``sibling-term-scope(z_loss)``.
* ``step_mtp_main_count`` (``MTP``): the MTP loss divided by the cross-entropy's count:
  ``shifted-aux-count(mtp)``.
* ``step_aux_world_size`` (``MOE``): the load balancing of the whole update computed on every
  rank, then multiplied by R with the rest of the loss: ``aux-world-size-factor(moe_lb)``.
* ``step_local_router_stats`` (``MOE``): load balancing from each microbatch's own routing
  statistics over the global token count: ``aux-global-count-local-stats(moe_lb)``.
* ``step_z_loss_coefficient_twice`` (``MOE``): the z-loss coefficient applied by the helper
  and again by the trainer: ``aux-coefficient-twice(z_loss)``.
* ``step_entropy_summed`` (``ENTROPY_BONUS``): each microbatch's entropy mean added at the
  full coefficient and multiplied by R with the rest of the loss, never divided by M:
  ``aux-summed-over-microbatches(entropy)``.

Each bug gets exactly one term wrong; the others are the correct step's. The coefficients are
the trainer's config (the same numbers as ``examples/objectives.py``, which states the
objectives these steps are judged against).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.nn.functional import cross_entropy, log_softmax, softmax
from torch.nn.parallel import DistributedDataParallel

IGNORE_INDEX = -100
#: The trainer's config: the z-loss and load-balancing coefficients, the experts each token is
#: routed to, the entropy bonus (negative: the objective rewards entropy) and the MTP weight.
Z_LOSS_COEFFICIENT = 1e-2
LOAD_BALANCE_COEFFICIENT = 0.01
TOP_K = 2
ENTROPY_COEFFICIENT = -0.1
MTP_COEFFICIENT = 0.3

Microbatch = dict[str, torch.Tensor]
#: The heads a MoE step reads: the LM head and the router.
MOE_HEADS = ("unembed", "router")


# -- the loop: no_sync, counts, per-token losses ------------------------------------------------


def sync_context(
    model: DistributedDataParallel, index: int, accum_steps: int
) -> contextlib.AbstractContextManager:
    """``no_sync`` on every microbatch but the last: DDP all-reduces once per update."""
    return contextlib.nullcontext() if index == accum_steps - 1 else model.no_sync()


def all_reduce_sum(counts: list[torch.Tensor]) -> list[int]:
    """Every count summed over the ranks, in one int64 all-reduce (exact, unlike float)."""
    packed = torch.stack([torch.as_tensor(c, dtype=torch.int64).reshape(()) for c in counts])
    dist.all_reduce(packed, op=dist.ReduceOp.SUM)
    return [int(c) for c in packed.tolist()]


def valid(batch: Microbatch, key: str = "targets") -> torch.Tensor:
    """The mask of the targets that get a loss."""
    return batch[key] != IGNORE_INDEX


def ce_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over the valid targets (divided by a count by the caller)."""
    return cross_entropy(
        logits.reshape(-1, logits.size(-1)),
        targets.reshape(-1).long(),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def z_loss_sum(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """PaLM's z-loss, lse(z_t)^2, summed over the valid targets."""
    return torch.logsumexp(logits, dim=-1).square()[mask].sum()


def entropy_sum(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The entropy -sum_v p log p of the model's distribution, summed over the valid targets."""
    log_p = log_softmax(logits, dim=-1)
    return -(log_p.exp() * log_p).sum(dim=-1)[mask].sum()


# -- routing ------------------------------------------------------------------------------------


def real_tokens(segment_ids: torch.Tensor) -> torch.Tensor:
    """Tokens the router sees: padding (segment id 0) is not routed."""
    return segment_ids > 0


def expert_counts(router_logits: torch.Tensor, segment_ids: torch.Tensor) -> torch.Tensor:
    """c_e: real tokens that picked expert e among their top k, int64 [E].

    Top-k of the logits is top-k of the probabilities (softmax is monotonic). The counts are
    integers: they carry no gradient, which is Switch's f (only P is differentiated).
    """
    num_experts = router_logits.size(-1)
    picks = router_logits.detach().topk(TOP_K, dim=-1).indices[real_tokens(segment_ids)]
    return torch.bincount(picks.reshape(-1), minlength=num_experts)


def router_probs(router_logits: torch.Tensor, segment_ids: torch.Tensor) -> torch.Tensor:
    """sum over this microbatch's real tokens of pi_t = softmax(router logits), [E]."""
    return softmax(router_logits, dim=-1)[real_tokens(segment_ids)].sum(dim=0)


def balance_loss(
    probs_sum: torch.Tensor, counts: torch.Tensor, count_tokens: int, prob_tokens: int
) -> torch.Tensor:
    """Switch's E sum_e f_e P_e with f_e = c_e / (k count_tokens) (a constant) and
    P_e = probs_sum_e / prob_tokens: this microbatch's share of the load-balancing loss when
    `probs_sum` covers only its tokens."""
    num_experts = probs_sum.numel()
    fraction = counts.to(probs_sum.dtype) / (TOP_K * count_tokens)
    return num_experts * (fraction @ probs_sum) / prob_tokens


# -- MOE: ce + z-loss + global-batch load balancing ---------------------------------------------


class MoECounts(NamedTuple):
    """The update's counts, the same on every rank: valid targets n, real tokens n_r and the
    per-expert top-k counts c [E]."""

    valid: int
    real: int
    experts: torch.Tensor


def moe_counts(model: DistributedDataParallel, microbatches: list[Microbatch]) -> MoECounts:
    """The count pre-pass: this rank's counts over the window, summed over every rank in one
    all-reduce, before any backward.

    The per-expert counts need the router's picks, so the pre-pass runs the router without
    gradient (on the wrapped module: no DDP bookkeeping for a forward that has no backward).
    Global-batch balancing needs them all-reduced: local counts would balance each rank (or
    microbatch) on its own, another objective.
    """
    valid_count = sum(valid(batch).sum() for batch in microbatches)
    real_count = sum(real_tokens(batch["segment_ids"]).sum() for batch in microbatches)
    with torch.no_grad():
        experts = sum(
            expert_counts(
                model.module(batch["inputs"], ("router",))["router"], batch["segment_ids"]
            )
            for batch in microbatches
        )
    valid_total, real_total, *expert_totals = all_reduce_sum([valid_count, real_count, *experts])
    return MoECounts(valid_total, real_total, torch.tensor(expert_totals, dtype=torch.int64))


class MoETerms(NamedTuple):
    """One microbatch's share of each term, each over its correct count (before λ)."""

    ce: torch.Tensor
    z_loss: torch.Tensor
    load_balance: torch.Tensor


def moe_terms(out: dict[str, torch.Tensor], batch: Microbatch, counts: MoECounts) -> MoETerms:
    """ce and z-loss summed over this microbatch's valid targets / the update's n; the load
    balancing with the update's counts f_e and this microbatch's part of P_e."""
    mask = valid(batch)
    logits = out["unembed"]
    probs_sum = router_probs(out["router"], batch["segment_ids"])
    return MoETerms(
        ce_sum(logits, batch["targets"]) / max(counts.valid, 1),
        z_loss_sum(logits, mask) / max(counts.valid, 1),
        balance_loss(probs_sum, counts.experts, max(counts.real, 1), max(counts.real, 1)),
    )


def step(model: DistributedDataParallel, microbatches: list[Microbatch]) -> None:
    """MOE, correct: every term over the whole update, counts all-reduced before any
    backward, loss times R."""
    counts = moe_counts(model, microbatches)
    world_size = dist.get_world_size()
    for index, batch in enumerate(microbatches):
        with sync_context(model, index, len(microbatches)):
            terms = moe_terms(model(batch["inputs"], MOE_HEADS), batch, counts)
            loss = (
                terms.ce
                + Z_LOSS_COEFFICIENT * terms.z_loss
                + LOAD_BALANCE_COEFFICIENT * terms.load_balance
            )
            (loss * world_size).backward()  # cancels DDP's average over the R ranks


def step_z_loss_per_microbatch(
    model: DistributedDataParallel, microbatches: list[Microbatch]
) -> None:
    """MOE with the z-loss as each microbatch's own token mean, divided by M, no factor R.

    A per-microbatch criterion added to a globally normalized main loss: after DDP's average
    the z-loss is the mean over the R M microbatches of their means, a more local scope than
    the update's (sibling-term-scope; the same shape as verl#6957's critic loss per
    microbatch, verl#7200's distillation loss, trl#2995's per-sequence KL, SkyRL#1504,
    NeMo-RL#2839).
    """
    counts = moe_counts(model, microbatches)
    world_size = dist.get_world_size()
    accum_steps = len(microbatches)
    for index, batch in enumerate(microbatches):
        with sync_context(model, index, accum_steps):
            out = model(batch["inputs"], MOE_HEADS)
            terms = moe_terms(out, batch, counts)
            main = terms.ce + LOAD_BALANCE_COEFFICIENT * terms.load_balance
            mask = valid(batch)
            # The bug: this microbatch's count, not the update's; and the criterion's
            # "/ accum_steps" never learned about the world size.
            z_mean = z_loss_sum(out["unembed"], mask) / max(int(mask.sum()), 1)
            (main * world_size + Z_LOSS_COEFFICIENT * z_mean / accum_steps).backward()


def step_aux_world_size(model: DistributedDataParallel, microbatches: list[Microbatch]) -> None:
    """MOE with the load balancing complete on every rank, then multiplied by R again.

    Each rank all-gathers the window's token ids and segment ids and evaluates the whole
    update's global-batch load balancing itself (the replicated way to get global statistics);
    the trainer then multiplies the whole loss by R for DDP's average. That R is right for the
    cross-entropy and the z-loss, which are sums over ranks, but the load balancing was already
    the full term on every rank: it weighs R λ (aux-world-size-factor; docs/bugs.md has it from
    code reading of MoE trainers' aux losses, no upstream issue yet).
    """
    world_size, rank = dist.get_world_size(), dist.get_rank()
    # Every rank's microbatches: [R, M, B, T] (microbatches have one shape per update).
    gathered = {}
    for key in ("inputs", "segment_ids"):
        local = torch.stack([batch[key] for batch in microbatches])
        parts = [torch.empty_like(local) for _ in range(world_size)]
        dist.all_gather(parts, local)
        gathered[key] = torch.stack(parts)
    # The ce count is all-reduced as usual; the routing counts come from the gathered tokens,
    # which every rank now holds in full (no all-reduce needed: the same numbers).
    (valid_total,) = all_reduce_sum([sum(valid(batch).sum() for batch in microbatches)])
    everyone_inputs = gathered["inputs"].flatten(0, 2)
    everyone_segments = gathered["segment_ids"].flatten(0, 2)
    with torch.no_grad():
        router_logits = model.module(everyone_inputs, ("router",))["router"]
    counts = MoECounts(
        valid_total,
        int(real_tokens(everyone_segments).sum()),
        expert_counts(router_logits, everyone_segments),
    )
    rows = microbatches[0]["inputs"].size(0)
    for index, batch in enumerate(microbatches):
        with sync_context(model, index, len(microbatches)):
            # One forward over microbatch `index` of every rank: the router's part of the
            # update's balancing reads all of them; ce and z-loss read this rank's rows.
            everyone = gathered["inputs"][:, index].flatten(0, 1)
            segments = gathered["segment_ids"][:, index].flatten(0, 1)
            out = model(everyone, MOE_HEADS)
            own = {"unembed": out["unembed"][rank * rows : (rank + 1) * rows]}
            mask = valid(batch)
            ce = ce_sum(own["unembed"], batch["targets"]) / max(counts.valid, 1)
            z_loss = z_loss_sum(own["unembed"], mask) / max(counts.valid, 1)
            load_balance = balance_loss(
                router_probs(out["router"], segments),
                counts.experts,
                max(counts.real, 1),
                max(counts.real, 1),
            )
            loss = ce + Z_LOSS_COEFFICIENT * z_loss + LOAD_BALANCE_COEFFICIENT * load_balance
            (loss * world_size).backward()  # the bug: R also multiplies the complete aux


def step_local_router_stats(model: DistributedDataParallel, microbatches: list[Microbatch]) -> None:
    """MOE with the load balancing from each microbatch's own routing statistics, divided by
    the global real-token count like the main loss.

    f_ue = c_ue / (k n_u) and sum_{t in u} pi_te come from microbatch u alone (what the
    router's forward has at hand), then divided by the update's n_r as the main loss divides
    by its global count: neither global-batch nor micro-batch balancing
    (aux-global-count-local-stats; docs/bugs.md cites NVIDIA-NeMo/Automodel#3359, MoE aux loss
    under gradient accumulation).
    """
    counts = moe_counts(model, microbatches)
    world_size = dist.get_world_size()
    for index, batch in enumerate(microbatches):
        with sync_context(model, index, len(microbatches)):
            out = model(batch["inputs"], MOE_HEADS)
            terms = moe_terms(out, batch, counts)
            segments = batch["segment_ids"]
            # The bug: f from this microbatch's picks and n_u, P over the global n_r.
            local_real = max(int(real_tokens(segments).sum()), 1)
            load_balance = balance_loss(
                router_probs(out["router"], segments),
                expert_counts(out["router"], segments),
                local_real,
                max(counts.real, 1),
            )
            loss = (
                terms.ce
                + Z_LOSS_COEFFICIENT * terms.z_loss
                + LOAD_BALANCE_COEFFICIENT * load_balance
            )
            (loss * world_size).backward()


def weighted_z_loss(logits: torch.Tensor, mask: torch.Tensor, valid_count: int) -> torch.Tensor:
    """A z-loss helper that takes the coefficient from the config itself: λ L_z's share."""
    return Z_LOSS_COEFFICIENT * z_loss_sum(logits, mask) / max(valid_count, 1)


def step_z_loss_coefficient_twice(
    model: DistributedDataParallel, microbatches: list[Microbatch]
) -> None:
    """MOE with the z-loss coefficient applied twice: the helper returns λ L_z and the
    trainer multiplies by λ again, so the z-loss weighs λ² (aux-coefficient-twice; docs/bugs.md
    has it from code reading, no upstream issue yet)."""
    counts = moe_counts(model, microbatches)
    world_size = dist.get_world_size()
    for index, batch in enumerate(microbatches):
        with sync_context(model, index, len(microbatches)):
            out = model(batch["inputs"], MOE_HEADS)
            terms = moe_terms(out, batch, counts)
            z_loss = weighted_z_loss(out["unembed"], valid(batch), counts.valid)
            loss = (
                terms.ce
                + Z_LOSS_COEFFICIENT * z_loss  # the bug: z_loss already holds λ
                + LOAD_BALANCE_COEFFICIENT * terms.load_balance
            )
            (loss * world_size).backward()


# -- ENTROPY_BONUS: ce over the update + entropy bonus per microbatch ---------------------------


def step_entropy_bonus(model: DistributedDataParallel, microbatches: list[Microbatch]) -> None:
    """ENTROPY_BONUS, correct: ce over the update's count; the entropy as each microbatch's
    token mean, averaged over the R M microbatches, as the objective means it.

    The microbatch mean needs no collective: 1/(R M) of it per microbatch, and the factor R
    that cancels DDP's average leaves 1/M.
    """
    (valid_total,) = all_reduce_sum([sum(valid(batch).sum() for batch in microbatches)])
    world_size = dist.get_world_size()
    accum_steps = len(microbatches)
    for index, batch in enumerate(microbatches):
        with sync_context(model, index, accum_steps):
            logits = model(batch["inputs"], ("unembed",))["unembed"]
            mask = valid(batch)
            ce = ce_sum(logits, batch["targets"]) / max(valid_total, 1)
            # A microbatch without a valid target has no mean: it adds 0, still one of R M.
            entropy = entropy_sum(logits, mask) / max(int(mask.sum()), 1)
            loss = ce + ENTROPY_COEFFICIENT * entropy / (world_size * accum_steps)
            (loss * world_size).backward()


def step_entropy_summed(model: DistributedDataParallel, microbatches: list[Microbatch]) -> None:
    r"""ENTROPY_BONUS with each microbatch's entropy mean added at the full coefficient,
    riding the main loss's factor R and never divided by M: the update sums the R M means.

    Every forward returns :math:`\frac{1}{n}\sum_{t \in (r,m)} v_t \mathrm{ce}_t + \lambda
    \frac{1}{n_{rm}} \sum_{t \in (r,m)} v_t H_t`, the whole of it times R for DDP's average;
    the cross-entropy comes out right (a share of a global mean), the entropy term as
    :math:`\lambda \sum_{(r,m)} \frac{1}{n_{rm}} \sum_{t \in (r,m)} v_t H_t`, R M times the
    objective's :math:`\frac{1}{R M}` mean (aux-summed-over-microbatches). The arrangement
    transformers' Trainer gives a MoE model's router aux loss (transformers 5.24):
    modeling_mixtral.py:633 adds ``router_aux_loss_coef * aux_loss`` to the model's loss,
    trainer.py:2215 multiplies the loss by ``num_processes``, and trainer.py:2116-2119 skips
    the division by the gradient accumulation steps when ``num_items_in_batch`` is given.
    Intended at R M = 1.
    """
    (valid_total,) = all_reduce_sum([sum(valid(batch).sum() for batch in microbatches)])
    world_size = dist.get_world_size()
    for index, batch in enumerate(microbatches):
        with sync_context(model, index, len(microbatches)):
            logits = model(batch["inputs"], ("unembed",))["unembed"]
            mask = valid(batch)
            ce = ce_sum(logits, batch["targets"]) / max(valid_total, 1)
            entropy = entropy_sum(logits, mask) / max(int(mask.sum()), 1)
            # The bug: the microbatch's own mean at the full coefficient, inside the loss
            # that R multiplies, with no 1/M: summed over the R M forwards, not averaged.
            loss = ce + ENTROPY_COEFFICIENT * entropy
            (loss * world_size).backward()


# -- MTP: ce + a multi-token-prediction head over its own count ---------------------------------


def mtp_counts(microbatches: list[Microbatch]) -> tuple[int, int]:
    """(n, n'): the update's valid targets and valid MTP targets, one all-reduce.

    n' <= n: position t has an MTP target when position t + 1 of its segment has a valid
    target, so a segment whose valid targets run to its last position has one MTP target
    fewer (packed rows: 204 against 231). Where they stop earlier, as a rollout's completion
    does before its padding, the counts are equal though the masks differ by one position.
    """
    valid_total, mtp_total = all_reduce_sum(
        [
            sum(valid(batch).sum() for batch in microbatches),
            sum(valid(batch, "mtp_targets").sum() for batch in microbatches),
        ]
    )
    return valid_total, mtp_total


def step_mtp(model: DistributedDataParallel, microbatches: list[Microbatch]) -> None:
    """MTP, correct: ce over n, the MTP head's cross-entropy over its own n'."""
    valid_total, mtp_total = mtp_counts(microbatches)
    world_size = dist.get_world_size()
    for index, batch in enumerate(microbatches):
        with sync_context(model, index, len(microbatches)):
            out = model(batch["inputs"], ("unembed", "mtp_unembed"))
            ce = ce_sum(out["unembed"], batch["targets"]) / max(valid_total, 1)
            mtp = ce_sum(out["mtp_unembed"], batch["mtp_targets"]) / max(mtp_total, 1)
            (world_size * (ce + MTP_COEFFICIENT * mtp)).backward()


def step_mtp_main_count(model: DistributedDataParallel, microbatches: list[Microbatch]) -> None:
    """MTP with the head's loss, summed over its own (rolled) mask, divided by the main
    loss's count n instead of n': the term weighs n'/n of what it should
    (shifted-aux-count; Megatron-LM#2417, fixed in #3159). A batch where n' = n (rollouts,
    whose completions end before their rows do) cannot show it: there it is the objective."""
    valid_total, _ = mtp_counts(microbatches)
    world_size = dist.get_world_size()
    for index, batch in enumerate(microbatches):
        with sync_context(model, index, len(microbatches)):
            out = model(batch["inputs"], ("unembed", "mtp_unembed"))
            ce = ce_sum(out["unembed"], batch["targets"]) / max(valid_total, 1)
            # The bug: the LM head's num_tokens reused for the MTP head.
            mtp = ce_sum(out["mtp_unembed"], batch["mtp_targets"]) / max(valid_total, 1)
            (world_size * (ce + MTP_COEFFICIENT * mtp)).backward()
