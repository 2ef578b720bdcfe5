r"""Multi-term objectives in a JAX training step: each term over its own count, at its own scope.

A real objective is a sum of terms, :math:`\sum_k \lambda_k L_k`, and every term has its own
mask, its own denominator and its own scope (docs/objectives.md). The steps here are the
objectives of ``examples/objectives.py`` written as a user writes them in plain JAX: one
``jax.shard_map`` over the "data" axis (R devices), a count pre-pass whose counts are
``psum``'d *before* anything is differentiated, one ``jax.grad`` per microbatch of that
microbatch's share of the update's loss, the M gradients summed, then ``psum``'d over the
devices. With v_t the valid targets (not -100), n = sum of v_t over the whole update,
z_t = h_t · unembed and lse_t = logsumexp(z_t):

* ``step`` (``MOE``): :math:`\frac{1}{n}\sum_t v_t\,\mathrm{ce}_t
  + 10^{-2}\,\frac{1}{n}\sum_t v_t\,\mathrm{lse}_t^2 + 0.01\,\mathrm{LB}`, where global-batch
  load balancing over the update's :math:`n_r` real tokens (segment id > 0) is

  .. math::

      \mathrm{LB} = E \sum_e \frac{c_e}{k\,n_r}\,\frac{1}{n_r}\sum_t \pi_{te}
      = \frac{E}{k\,n_r^2} \sum_t \sum_e c_e\,\pi_{te},

  :math:`\pi_t = \mathrm{softmax}(h_t \cdot \mathrm{router})` and :math:`c_e` the real tokens
  of the *whole update* whose top-k picks e: a count, so it carries no gradient, and global,
  so it is ``psum``'d in the pre-pass like n;
* ``step_entropy_bonus`` (``ENTROPY_BONUS``): the cross-entropy over n and an entropy bonus
  that is meant per microbatch, :math:`-0.1\,\frac{1}{R M}\sum_u \frac{1}{n_u}
  \sum_{t\in u} v_t H_t` (n_u: the microbatch's own valid targets);
* ``step_mtp`` (``MTP``): the cross-entropy over n and the multi-token-prediction head's
  cross-entropy on the targets shifted once more, over *its own* global count n' < n:
  :math:`0.3\,\frac{1}{n'}\sum_t v'_t\,\mathrm{ce}'_t`.

The other steps each get one auxiliary term wrong, every other term as above, the way real
trainers did (docs/bugs.md, "Multi-term objectives"); `diagnose_objective` names each:

============================== ============= ==========================================
step                           vs            named
============================== ============= ==========================================
step_z_loss_per_microbatch     MOE           sibling-term-scope(z_loss)
step_mtp_main_count            MTP           shifted-aux-count(mtp)
step_aux_world_size            MOE           aux-world-size-factor(moe_lb) (R > 1)
step_local_router_stats        MOE           aux-global-count-local-stats(moe_lb)
step_z_loss_coefficient_twice  MOE           aux-coefficient-twice(z_loss)
step_entropy_summed            ENTROPY_BONUS aux-summed-over-microbatches(entropy)
============================== ============= ==========================================

Protocol: ``step(params, apply_fn, batch, mesh)``; `params` holds the params the objective
reads (embed, unembed, and router or mtp_unembed), ``apply_fn(params, inputs, head)`` gives
``params["embed"][inputs] @ params[head]``, `batch` is numpy [R, M, B, T] (with
``mtp_targets`` for MTP) and `mesh` a 1-D mesh of R devices over "data". Every step returns
the gradient dict, replicated. The coefficients are this file's own hyperparameters; they
match ``examples/objectives.py``, which is what ``crosscheck verify --objective`` compares
against.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from examples._jax_common import IGNORE_INDEX, Batch, device_varying

Z_LOSS_COEFFICIENT = 1e-2
LOAD_BALANCE_COEFFICIENT = 0.01
TOP_K = 2
ENTROPY_COEFFICIENT = -0.1  # a bonus: higher entropy, lower loss
MTP_COEFFICIENT = 0.3

Microbatch = dict[str, jax.Array]
#: The update-wide numbers a microbatch's loss divides by, all known before any backward.
Counts = dict[str, jax.Array]
#: One microbatch's share of the update's loss: (params, apply_fn, microbatch, counts).
MicrobatchLoss = Callable[[Any, Callable, Microbatch, Counts], jax.Array]
#: How the devices' gradients combine: ``jax.lax.psum`` or ``jax.lax.pmean``.
Reduce = Callable[[Any, str], Any]


# --- per-token losses, summed over a microbatch (0 where the target is ignored) -------------


def ce_sum(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Sum of the cross-entropies of the valid targets."""
    valid = targets != IGNORE_INDEX
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(valid, targets, 0))
    return jnp.sum(jnp.where(valid, losses, 0.0))


def z_loss_sum(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Sum of logsumexp(z_t)^2 (PaLM's z-loss) over the valid targets."""
    lse = jax.nn.logsumexp(logits, axis=-1)
    return jnp.sum(jnp.where(targets != IGNORE_INDEX, lse * lse, 0.0))


def entropy_sum(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Sum of the predictive entropies H_t over the valid targets."""
    log_p = jax.nn.log_softmax(logits, axis=-1)
    entropy = -jnp.sum(jnp.exp(log_p) * log_p, axis=-1)
    return jnp.sum(jnp.where(targets != IGNORE_INDEX, entropy, 0.0))


def valid_count(targets: jax.Array) -> jax.Array:
    """The valid targets (not ignored) of `targets`."""
    return jnp.sum(targets != IGNORE_INDEX)


# --- the router ---------------------------------------------------------------------------


def router_probs(params: Any, apply_fn: Callable, microbatch: Microbatch) -> jax.Array:
    """pi_t = softmax(h_t · router) [..., E], 0 on padding (padding is not routed)."""
    probs = jax.nn.softmax(apply_fn(params, microbatch["inputs"], head="router"), axis=-1)
    return jnp.where((microbatch["segment_ids"] > 0)[..., None], probs, 0.0)


def expert_counts(probs: jax.Array, real: jax.Array, top_k: int) -> jax.Array:
    """c_e: the real tokens whose top-k experts include e [E].

    A count is a constant of the loss: stop_gradient says so (the one-hot of an argmax has
    no gradient anyway; this keeps it true if someone swaps in a soft pick).
    """
    _, picks = jax.lax.top_k(jax.lax.stop_gradient(probs), top_k)
    chosen = jax.nn.one_hot(picks, probs.shape[-1], dtype=jnp.int32).sum(axis=-2)
    return jnp.sum(jnp.where(real[..., None], chosen, 0), axis=tuple(range(real.ndim)))


def load_balance_share(probs: jax.Array, counts: Counts) -> jax.Array:
    r"""This microbatch's share of global-batch LB: :math:`\frac{E}{k n_r^2}\sum_{t}
    \sum_e c_e \pi_{te}` with the update's counts; the shares of all microbatches on all
    devices sum to LB."""
    E = probs.shape[-1]
    n = counts["real"].astype(probs.dtype)
    weighted = jnp.sum(probs * counts["experts"].astype(probs.dtype))
    return E * weighted / (TOP_K * jnp.maximum(n, 1.0) ** 2)


# --- the loop: pre-pass, one grad per microbatch, one reduction -----------------------------


def global_counts(params: Any, apply_fn: Callable, local: Microbatch, router: bool) -> Counts:
    """Every update-wide count, ``psum``'d over the devices before any gradient is taken.

    `local` is this device's [M, B, T] arrays. The router's forward runs once here for its
    top-k counts: the loss needs the *whole update's* counts while it differentiates one
    microbatch, and they are constants, so computing them first costs one extra router
    forward and no backward.
    """
    M = local["inputs"].shape[0]
    counts: Counts = {
        "valid": valid_count(local["targets"]),
        "microbatches": jnp.asarray(M * jax.lax.axis_size("data")),
    }
    if "mtp_targets" in local:
        counts["mtp_valid"] = valid_count(local["mtp_targets"])
    if router:
        real = local["segment_ids"] > 0
        counts["real"] = jnp.sum(real)
        counts["experts"] = expert_counts(router_probs(params, apply_fn, local), real, TOP_K)
    # microbatches is the same on every device already; the rest are this device's shares.
    return {k: v if k == "microbatches" else jax.lax.psum(v, "data") for k, v in counts.items()}


@functools.cache
def make_grads_fn(
    apply_fn: Callable,
    mesh: Mesh,
    microbatch_loss: MicrobatchLoss,
    router: bool,
    reduce: Reduce = jax.lax.psum,
) -> Callable:
    """(params, batch) -> gradient, built once per model, mesh and loss as a script does."""

    def device_grads(params: Any, batch: Microbatch) -> Any:
        local = {k: v[0] for k, v in batch.items()}  # this device's [M, B, T]
        counts = global_counts(params, apply_fn, local, router)
        # Device-varying params: each device's grad is its own, and `reduce` below is the one
        # data-parallel reduction (see _jax_common.device_varying).
        params = device_varying(params)
        grad_fn = jax.grad(microbatch_loss)
        total = None
        for m in range(local["inputs"].shape[0]):
            grads = grad_fn(params, apply_fn, {k: v[m] for k, v in local.items()}, counts)
            # Sum, not mean: every microbatch's loss is already its share of the update's.
            total = grads if total is None else jax.tree.map(jnp.add, total, grads)
        return reduce(total, "data")

    return jax.jit(jax.shard_map(device_grads, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))


def run(
    params: Any,
    apply_fn: Callable,
    batch: Batch,
    mesh: Mesh,
    microbatch_loss: MicrobatchLoss,
    router: bool = False,
    reduce: Reduce = jax.lax.psum,
) -> dict[str, jax.Array]:
    """One update's gradient of `microbatch_loss` summed over every microbatch and device."""
    fields = ("inputs", "targets", "segment_ids", "mtp_targets")
    arrays = {k: jnp.asarray(batch[k]) for k in fields if k in batch}
    grads_fn = make_grads_fn(apply_fn, mesh, microbatch_loss, router, reduce)
    return dict(grads_fn(params, arrays))


# --- the correct steps ----------------------------------------------------------------------


def moe_loss(params: Any, apply_fn: Callable, mb: Microbatch, counts: Counts) -> jax.Array:
    """MOE: ce and z-loss over the update's valid targets, LB over its real tokens."""
    logits = apply_fn(params, mb["inputs"], head="unembed")
    n = jnp.maximum(counts["valid"], 1)
    main = ce_sum(logits, mb["targets"]) / n
    z_loss = z_loss_sum(logits, mb["targets"]) / n
    balance = load_balance_share(router_probs(params, apply_fn, mb), counts)
    return main + Z_LOSS_COEFFICIENT * z_loss + LOAD_BALANCE_COEFFICIENT * balance


def step(params: Any, apply_fn: Callable, batch: Batch, mesh: Mesh) -> dict[str, jax.Array]:
    """MOE, every term over the whole update: ``crosscheck verify`` says PASS."""
    return run(params, apply_fn, batch, mesh, moe_loss, router=True)


def entropy_bonus_loss(
    params: Any, apply_fn: Callable, mb: Microbatch, counts: Counts
) -> jax.Array:
    """ENTROPY_BONUS: ce over the update, the entropy per microbatch, averaged over R M."""
    logits = apply_fn(params, mb["inputs"], head="unembed")
    main = ce_sum(logits, mb["targets"]) / jnp.maximum(counts["valid"], 1)
    # Meant local: this microbatch's own mean, one of the R M means averaged.
    own = jnp.maximum(valid_count(mb["targets"]), 1)
    entropy = entropy_sum(logits, mb["targets"]) / own / counts["microbatches"]
    return main + ENTROPY_COEFFICIENT * entropy


def step_entropy_bonus(
    params: Any, apply_fn: Callable, batch: Batch, mesh: Mesh
) -> dict[str, jax.Array]:
    """ENTROPY_BONUS, the bonus per microbatch as the objective means it: PASS."""
    return run(params, apply_fn, batch, mesh, entropy_bonus_loss)


def mtp_loss(params: Any, apply_fn: Callable, mb: Microbatch, counts: Counts) -> jax.Array:
    """MTP: ce over n, the mtp head over its own count n' (the rolled mask has fewer)."""
    main = ce_sum(apply_fn(params, mb["inputs"], head="unembed"), mb["targets"])
    mtp = ce_sum(apply_fn(params, mb["inputs"], head="mtp_unembed"), mb["mtp_targets"])
    n, n_mtp = jnp.maximum(counts["valid"], 1), jnp.maximum(counts["mtp_valid"], 1)
    return main / n + MTP_COEFFICIENT * mtp / n_mtp


def step_mtp(params: Any, apply_fn: Callable, batch: Batch, mesh: Mesh) -> dict[str, jax.Array]:
    """MTP, each head over its own count: PASS."""
    return run(params, apply_fn, batch, mesh, mtp_loss)


# --- one term wrong each --------------------------------------------------------------------


def z_loss_per_microbatch_loss(
    params: Any, apply_fn: Callable, mb: Microbatch, counts: Counts
) -> jax.Array:
    """MOE with the z-loss as a per-microbatch mean, averaged over the R M microbatches."""
    logits = apply_fn(params, mb["inputs"], head="unembed")
    main = ce_sum(logits, mb["targets"]) / jnp.maximum(counts["valid"], 1)
    # The bug: the sibling term's mean over this microbatch's own tokens, as a loss function
    # called per microbatch returns it.
    own = jnp.maximum(valid_count(mb["targets"]), 1)
    z_loss = z_loss_sum(logits, mb["targets"]) / own / counts["microbatches"]
    balance = load_balance_share(router_probs(params, apply_fn, mb), counts)
    return main + Z_LOSS_COEFFICIENT * z_loss + LOAD_BALANCE_COEFFICIENT * balance


def step_z_loss_per_microbatch(
    params: Any, apply_fn: Callable, batch: Batch, mesh: Mesh
) -> dict[str, jax.Array]:
    """sibling-term-scope(z_loss): the main term over the update, the z-loss per microbatch.

    A z-loss token of microbatch u weighs n / (R M n_u) times what it should: tokens of
    small microbatches count more. The same shape as verl#6957 (critic loss per
    microbatch), verl#7200 (distillation loss), trl#2995 (KL per sequence), SkyRL#1504 and
    NeMo-RL#2839. Intended at R M = 1.
    """
    return run(params, apply_fn, batch, mesh, z_loss_per_microbatch_loss, router=True)


def mtp_main_count_loss(
    params: Any, apply_fn: Callable, mb: Microbatch, counts: Counts
) -> jax.Array:
    """MTP with the mtp head divided by the main term's count n instead of its own n'."""
    main = ce_sum(apply_fn(params, mb["inputs"], head="unembed"), mb["targets"])
    mtp = ce_sum(apply_fn(params, mb["inputs"], head="mtp_unembed"), mb["mtp_targets"])
    n = jnp.maximum(counts["valid"], 1)
    return main / n + MTP_COEFFICIENT * mtp / n  # the bug: n, not counts["mtp_valid"]


def step_mtp_main_count(
    params: Any, apply_fn: Callable, batch: Batch, mesh: Mesh
) -> dict[str, jax.Array]:
    """shifted-aux-count(mtp): the rolled mask's loss over the unrolled count.

    v' loses a token at the end of every segment, so n' < n and the mtp gradient shrinks by
    n' / n at every layout: Megatron-LM#2417 (fixed in #3159).
    """
    return run(params, apply_fn, batch, mesh, mtp_main_count_loss)


def aux_world_size_loss(
    params: Any, apply_fn: Callable, mb: Microbatch, counts: Counts
) -> jax.Array:
    """MOE in the pmean idiom: the loss times R, LB complete on every device."""
    logits = apply_fn(params, mb["inputs"], head="unembed")
    n = jnp.maximum(counts["valid"], 1)
    main = ce_sum(logits, mb["targets"]) + Z_LOSS_COEFFICIENT * z_loss_sum(logits, mb["targets"])
    # Every device gathers the microbatch's per-expert probability sums of all devices: its
    # LB share is then the complete one, the same on every device, gradient included (the
    # all_gather's transpose sends each device's part back to it).
    probs = router_probs(params, apply_fn, mb)
    per_expert = jax.lax.all_gather(jnp.sum(probs, axis=tuple(range(probs.ndim - 1))), "data")
    E = probs.shape[-1]
    complete = E * jnp.sum(per_expert.sum(axis=0) * counts["experts"])
    balance = complete / (TOP_K * jnp.maximum(counts["real"], 1) ** 2)
    # The bug: R undoes pmean's 1/R for the main loss, whose devices hold disjoint tokens;
    # the balance loss, already whole on each device, is multiplied by R along with it.
    R = jax.lax.axis_size("data")
    return R * (main / n + LOAD_BALANCE_COEFFICIENT * balance)


def step_aux_world_size(
    params: Any, apply_fn: Callable, batch: Batch, mesh: Mesh
) -> dict[str, jax.Array]:
    """aux-world-size-factor(moe_lb): LB weighs R λ instead of λ.

    The DDP idiom (the gradient averaged over the R devices, the loss multiplied by R to
    make the average a global token mean) applied to a global-batch load-balancing loss that
    each device already computes whole, from all-gathered router statistics. Seen in MoE
    trainers' aux losses by code reading (docs/bugs.md); objective_candidates.py names no
    upstream issue. Intended at R = 1.
    """
    return run(
        params, apply_fn, batch, mesh, aux_world_size_loss, router=True, reduce=jax.lax.pmean
    )


def local_router_stats_loss(
    params: Any, apply_fn: Callable, mb: Microbatch, counts: Counts
) -> jax.Array:
    """MOE with LB from this microbatch's own routing, over the update's real tokens."""
    logits = apply_fn(params, mb["inputs"], head="unembed")
    n = jnp.maximum(counts["valid"], 1)
    main = ce_sum(logits, mb["targets"]) / n
    z_loss = z_loss_sum(logits, mb["targets"]) / n
    probs = router_probs(params, apply_fn, mb)
    real = mb["segment_ids"] > 0
    E = probs.shape[-1]
    # The bug: f_ue = c_ue / (k n_u) from this microbatch's picks and tokens, and the
    # probability sum over the global count n_r "like the main loss".
    own = jnp.maximum(jnp.sum(real), 1)
    fraction = expert_counts(probs, real, TOP_K) / (TOP_K * own)
    per_expert = jnp.sum(probs, axis=tuple(range(probs.ndim - 1)))
    balance = E * jnp.sum(fraction * per_expert) / jnp.maximum(counts["real"], 1)
    return main + Z_LOSS_COEFFICIENT * z_loss + LOAD_BALANCE_COEFFICIENT * balance


def step_local_router_stats(
    params: Any, apply_fn: Callable, batch: Batch, mesh: Mesh
) -> dict[str, jax.Array]:
    r"""aux-global-count-local-stats(moe_lb): neither global-batch nor micro-batch balancing.

    :math:`\sum_u E \sum_e f_{ue} \sum_{t \in u} \pi_{te} / n_r` with
    :math:`f_{ue} = c_{ue} / (k n_u)` the microbatch's own routing: a per-token weight of
    E / (k n_u n_r), and counts c_ue that differ from the update's, so the term's form (not
    just its weight) changes. MoE aux losses under accumulation, NVIDIA-NeMo/Automodel#3359
    (docs/bugs.md; objective_candidates.py names no upstream issue). Intended at R M = 1.
    """
    return run(params, apply_fn, batch, mesh, local_router_stats_loss, router=True)


def scaled_z_loss(logits: jax.Array, targets: jax.Array, n: jax.Array) -> jax.Array:
    """The z-loss as a library hands it over: already multiplied by its coefficient."""
    return Z_LOSS_COEFFICIENT * z_loss_sum(logits, targets) / n


def z_loss_coefficient_twice_loss(
    params: Any, apply_fn: Callable, mb: Microbatch, counts: Counts
) -> jax.Array:
    """MOE with the z-loss coefficient applied by `scaled_z_loss` and again here."""
    logits = apply_fn(params, mb["inputs"], head="unembed")
    n = jnp.maximum(counts["valid"], 1)
    main = ce_sum(logits, mb["targets"]) / n
    z_loss = scaled_z_loss(logits, mb["targets"], n)  # already λ L
    balance = load_balance_share(router_probs(params, apply_fn, mb), counts)
    return main + Z_LOSS_COEFFICIENT * z_loss + LOAD_BALANCE_COEFFICIENT * balance


def step_z_loss_coefficient_twice(
    params: Any, apply_fn: Callable, batch: Batch, mesh: Mesh
) -> dict[str, jax.Array]:
    """aux-coefficient-twice(z_loss): the z-loss weighs λ² = 1e-4 instead of λ = 1e-2.

    The loss function returns λ L and the trainer multiplies by λ again. Seen by code
    reading (docs/bugs.md); objective_candidates.py names no upstream issue. Intended at
    λ = 1 only.
    """
    return run(params, apply_fn, batch, mesh, z_loss_coefficient_twice_loss, router=True)


def entropy_summed_loss(
    params: Any, apply_fn: Callable, mb: Microbatch, counts: Counts
) -> jax.Array:
    """ENTROPY_BONUS with the microbatch's entropy mean at the full coefficient, no 1/(R M)."""
    logits = apply_fn(params, mb["inputs"], head="unembed")
    main = ce_sum(logits, mb["targets"]) / jnp.maximum(counts["valid"], 1)
    own = jnp.maximum(valid_count(mb["targets"]), 1)
    # The bug: this microbatch's own mean added whole, as a model adds its aux loss to the
    # loss it returns; the M grads are summed and psum'd like the main term's shares.
    entropy = entropy_sum(logits, mb["targets"]) / own
    return main + ENTROPY_COEFFICIENT * entropy


def step_entropy_summed(
    params: Any, apply_fn: Callable, batch: Batch, mesh: Mesh
) -> dict[str, jax.Array]:
    r"""aux-summed-over-microbatches(entropy): the R M per-microbatch means summed, not averaged.

    Each microbatch's loss is :math:`\frac{1}{n}\sum_{t\in u} v_t\,\mathrm{ce}_t
    - 0.1\,\frac{1}{n_u}\sum_{t\in u} v_t H_t`; summing the M gradients and ``psum``'ing
    them over the devices is right for the cross-entropy's shares of a global mean, but gives
    the entropy :math:`-0.1\sum_u \frac{1}{n_u}\sum_{t\in u} v_t H_t`, R M times the
    objective's mean. The arrangement transformers' Trainer gives a MoE model's router aux
    loss (transformers 5.24): modeling_mixtral.py:633 adds ``router_aux_loss_coef * aux_loss``
    to the model's loss, trainer.py:2215 multiplies the loss by ``num_processes``, and
    trainer.py:2116-2119 skips the division by the gradient accumulation steps when
    ``num_items_in_batch`` is given. Intended at R M = 1.
    """
    return run(params, apply_fn, batch, mesh, entropy_summed_loss)
