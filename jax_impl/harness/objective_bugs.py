r"""Multi-term objectives with one auxiliary term weighted wrongly, as buggy JAX steps.

Each step is `jax_impl.objective` (one ``jax.shard_map`` device per rank, the counts
``psum``'d before any backward, one ``jax.grad`` per microbatch, gradients summed over the
microbatches and reduced over ranks) with exactly one term `target` computed the way a real
loop got it wrong. Every other term keeps its correct weights. With λ_k the coefficients,
n the update's count of the main term, n_u a microbatch's, R ranks and M microbatches:

* ``sibling-term-scope`` (verl#6957, verl#7200, trl#2995, SkyRL#1504, NeMo-RL#2839): the DDP
  idiom, where the gradient all-reduce averages ranks, so every globally normalized term is
  multiplied by R; the target takes its own microbatch-local mean and is averaged over the
  M accumulation steps, as a per-microbatch loss function returns it. Its gradient is
  :math:`\frac{1}{R M}\sum_u \frac{1}{n^k_u}\sum_{t\in u} \lambda_k \nabla l^k_t`.
* ``shifted-aux-count`` (Megatron-LM#2417, fixed in #3159): the ``mtp`` term, whose rolled
  mask v' has fewer tokens, is divided by the main term's count n instead of its own n'.
* ``aux-world-size-factor``: DDP idiom again, the target computed complete on every rank
  (all-gathered tokens: each rank evaluates the whole update's term, as a replicated
  global-batch load-balancing loss is) and then multiplied by R with the main loss: after
  the rank average it weighs R λ_k instead of λ_k.
* ``aux-global-count-local-stats``: ``moe_lb`` from this microbatch's routing statistics,
  :math:`f_{ue} = c_{ue}/(k n_u)` and :math:`\sum_{t\in u}\pi_{te}`, divided by the global
  token count n as the main loss is: :math:`\sum_u E \sum_e f_{ue} \sum_{t\in u}\pi_{te} / n`,
  neither the global-batch nor the micro-batch balancing it meant.
* ``aux-coefficient-twice``: the loss function returns λ_k L_k and the trainer multiplies
  by λ_k again: :math:`\lambda_k^2 L_k`.
* ``aux-summed-over-microbatches``: DDP idiom, the target a ``moe_lb`` term of ``microbatch``
  scope, meant as the mean over the update's R M forwards of each forward's router loss
  :math:`E\sum_e f_{ue} P_{ue}` (:math:`P_{ue} = \sum_{t\in u}\pi_{te}/n_u`). The model returns
  that loss and the trainer adds it at full λ_k to each microbatch's loss, multiplied by R with
  the main loss and never divided by M (transformers' ``Trainer``): after the rank average the
  update sums it over its R M forwards, R M times the intended term.

`make_objective_bug_fn(pattern, terms, target, mesh)` returns
``fn(params, batch) -> grads`` (replicated). jax_impl never imports crosscheck: the
diagnosis that names these lives in `crosscheck.diagnosis.objective_diagnosis`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_impl.batch import IGNORE_INDEX, Batch
from jax_impl.model import Params

# The correct objective's pieces: the bugs differ from it only in the target's weights.
from jax_impl.objective import (
    FROZEN_PARAMS,
    TRAINED_PARAMS,
    _Norm,
    _precount,
    _term_sum,
    expert_counts,
    parse_terms,
    router_probs,
    term_batch,
    token_losses,
)
from jax_impl.shard_map_step import rank_varying, replicate, shard_batch

PATTERNS = (
    "sibling-term-scope",
    "shifted-aux-count",
    "aux-world-size-factor",
    "aux-global-count-local-stats",
    "aux-coefficient-twice",
    "aux-summed-over-microbatches",
)
#: Steps that average gradients over ranks (DDP); the others sum them (jax_impl.objective).
_AVERAGED = frozenset(
    {"sibling-term-scope", "aux-world-size-factor", "aux-summed-over-microbatches"}
)
#: Of those, the steps whose target rides the main loss's factor R (a per-microbatch criterion,
#: sibling-term-scope's, knows no world size).
_TARGET_TIMES_R = frozenset({"aux-world-size-factor", "aux-summed-over-microbatches"})


def _gathered(mb: Batch, axis: str) -> Batch:
    """Every rank's microbatch m, rows concatenated: the whole update's accumulation step m."""
    return jax.tree.map(lambda x: lax.all_gather(x, axis, tiled=True), mb)


def _local_balance(term, p, mb: Batch) -> tuple[jax.Array, jax.Array]:
    """(E sum_e f_ue sum_{t in u} pi_te, n_u) from this microbatch's routing alone, as a
    model's forward computes it: f_ue = c_ue / (k n_u) from its top-k picks (no gradient)."""
    real = mb.segment_ids > 0
    probs = router_probs(p, mb.inputs)
    counts = expert_counts(lax.stop_gradient(probs)[None], real[None], term.top_k)[0]
    n_local = jnp.maximum(jnp.sum(real), 1).astype(probs.dtype)
    f = counts.astype(probs.dtype) / (term.top_k * n_local)  # this microbatch's f_ue
    mass = jnp.sum(jnp.where(real[..., None], probs, 0.0), axis=(0, 1))  # sum_t pi_te
    return probs.shape[-1] * jnp.sum(f * mass), n_local


def _buggy_part(pattern, term, norm: _Norm, main: _Norm, p, mb, m, axis, M):
    """The target term's λ-free contribution of microbatch m, as the buggy step writes it."""
    if pattern == "sibling-term-scope":
        # loss_fn returns the microbatch's own masked mean; the accumulation averages them.
        losses = token_losses(term, p, mb.inputs, mb.targets, mb.segment_ids, shifted=True)
        n_local = jnp.sum(mb.targets != IGNORE_INDEX)  # the term's targets (y' for mtp)
        return jnp.sum(losses) / jnp.maximum(n_local, 1) / M
    if pattern == "shifted-aux-count":
        # One num_tokens for every term: the main term's, n, not the rolled mask's n'.
        losses = token_losses(term, p, mb.inputs, mb.targets, mb.segment_ids, shifted=True)
        return jnp.sum(losses) / main.count.astype(losses.dtype)
    if pattern == "aux-world-size-factor":
        # Complete on every rank: the term of the whole update's step m, global weights.
        # a_t of every rank's rows of step m (moe_lb has none: its counts are the update's).
        weights = (
            None if norm.weights is None else lax.all_gather(norm.weights[m], axis, tiled=True)
        )
        return _term_sum(term, norm, p, _gathered(mb, axis), m, weights)
    if pattern == "aux-global-count-local-stats":
        balance, _ = _local_balance(term, p, mb)
        return balance / norm.count.astype(balance.dtype)  # divided like the main loss
    if pattern == "aux-summed-over-microbatches":
        # The forward's own router loss, E sum_e f_ue P_ue: its mean over its n_u tokens.
        balance, n_local = _local_balance(term, p, mb)
        return balance / n_local
    if pattern == "aux-coefficient-twice":
        # The loss function already returns λ L; the caller multiplies by λ again.
        return term.coefficient * _term_sum(term, norm, p, mb, m)
    raise ValueError(f"unknown pattern {pattern!r}; one of {', '.join(PATTERNS)}")


def _check(pattern: str, target, main) -> None:
    if pattern not in PATTERNS:
        raise ValueError(f"unknown pattern {pattern!r}; one of {', '.join(PATTERNS)}")
    if target is main:
        raise ValueError("the target must be an auxiliary term, not the main (first) term")
    needs = {
        "shifted-aux-count": ("mtp",),
        "aux-global-count-local-stats": ("moe_lb",),
        "aux-summed-over-microbatches": ("moe_lb",),
    }
    if pattern in needs and target.kind not in needs[pattern]:
        raise ValueError(f"{pattern} hits a {needs[pattern][0]} term, not {target.kind}")
    local_ok = target.kind != "moe_lb" and target.scope == "update"
    if pattern == "sibling-term-scope" and not local_ok:
        raise ValueError("sibling-term-scope localizes a per-token term of update scope")
    if pattern in ("shifted-aux-count", "aux-world-size-factor") and target.scope != "update":
        raise ValueError(f"{pattern} is written for a target of update scope")
    if pattern == "aux-summed-over-microbatches" and target.scope != "microbatch":
        # Summing per-forward means is a bug only of a term meant as their mean.
        raise ValueError(f"{pattern} is written for a target of microbatch scope")


def make_objective_bug_fn(
    pattern: str,
    terms: Sequence[Mapping[str, Any]],
    target: str,
    mesh: Mesh,
    axis_name: str = "data",
) -> Callable[[Params, Batch], Params]:
    """grads(params, batch [R, M, B, T]) of `terms` with `target` weighted as `pattern` does."""
    parsed = parse_terms(terms)
    hit = next((t for t in parsed if t.name == target), None)
    if hit is None:
        raise ValueError(f"no term {target!r} in {[t.name for t in parsed]}")
    _check(pattern, hit, parsed[0])
    R = mesh.shape[axis_name]
    averaged = pattern in _AVERAGED

    def per_rank(params: Params, batch: Batch) -> Params:
        batch = jax.tree.map(lambda x: x[0], batch)
        M = batch.inputs.shape[0]
        dtype = params["embed"].dtype
        batches = [term_batch(t, batch) for t in parsed]  # y' as mtp's targets
        norms = [
            _precount(t, params, b, axis_name, R, dtype)
            for t, b in zip(parsed, batches, strict=True)
        ]
        frozen = {k: v for k, v in params.items() if k in FROZEN_PARAMS}

        def microbatch_loss(p: Params, m: int) -> jax.Array:
            p = p | frozen
            total = jnp.zeros((), dtype)
            for term, norm, own in zip(parsed, norms, batches, strict=True):
                mb = jax.tree.map(lambda x: x[m], own)
                if term is hit:
                    part = _buggy_part(pattern, term, norm, norms[0], p, mb, m, axis_name, M)
                    # Only a target that rides the main loss's DDP factor gets R.
                    factor = R if pattern in _TARGET_TIMES_R else 1
                else:
                    part, factor = _term_sum(term, norm, p, mb, m), R if averaged else 1
                total = total + factor * term.coefficient * part
            return total

        local = rank_varying({k: v for k, v in params.items() if k in TRAINED_PARAMS}, axis_name)
        grads = jax.tree.map(jnp.zeros_like, local)
        for m in range(M):
            grads = jax.tree.map(jnp.add, grads, jax.grad(microbatch_loss)(local, m))
        return lax.pmean(grads, axis_name) if averaged else lax.psum(grads, axis_name)

    mapped = jax.jit(
        jax.shard_map(per_rank, mesh=mesh, in_specs=(P(), P(axis_name)), out_specs=P())
    )

    def step(params: Params, batch: Batch) -> Params:
        return mapped(replicate(dict(params), mesh), shard_batch(batch, mesh, axis_name))

    return step
