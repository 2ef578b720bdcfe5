r"""A multi-term objective (docs/objectives.md) under ``jax.shard_map``, with autodiff.

    total = sum_k λ_k L_k,   L_k = (1/K_k) sum over units u of (sum_{t in u} a_t l_t) / D_u

Terms are the dicts of docs/objectives.md: ``ce``, ``z_loss``, ``entropy``, ``ref_kl`` and
``mtp`` weigh their tokens by their mask (a_t = v_t, v'_t for mtp's targets shifted once more
inside the segment) over the token count of the term's scheme ``scope`` (``update`` by
default, ``rank`` or ``microbatch``); ``moe_lb`` is Switch load balancing with per-expert
counts c_ue of the top-k router picks, a_t = 1 on real tokens, l_t = sum_e c_ue π_te and
D_u = k n_u^2 / E, at ``update`` or ``microbatch`` scope.

Every rank holds its [M, B, T] block. First, before any backward, everything a weight needs.
A per-token term is its scheme spec read by `jax_impl.accumulate.rank_plan`, the same reading
as a single-term update, with the term's mask as the spec's ``valid`` mask (v'_t for mtp):
a_t and 1 / (K D_u) for every microbatch, any spec of docs/schemes-as-data.md, the group and
document counts that cross microbatches and ranks included (one ``psum`` of the count
vectors and D's channels per term). moe_lb's expert counts come from a forward of the router
without gradient, reduced by one ``psum`` where the unit spans ranks, so the counts that
scale each token are the global ones (an update-scope moe_lb built from the local counts
would be the microbatch-scope objective of another layout). Then each microbatch's
sum_k λ_k (sum_t a_t l_t) / D_u / K is differentiated, the gradients are summed over the
microbatches and ``psum``'d over ranks. The counts are constants of the backward: no gradient
flows through a count (f in Switch's f · P). The frozen reference (``ref_embed``,
``ref_unembed``) is read, never differentiated.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_impl.accumulate import AxisName, Collective, Strategy, rank_plan
from jax_impl.batch import IGNORE_INDEX, Batch
from jax_impl.context_parallel import AXES as CONTEXT_AXES
from jax_impl.context_parallel import context_placer as _context_placer
from jax_impl.context_parallel import context_positions
from jax_impl.model import Params
from jax_impl.shard_map_step import rank_varying, replicate, shard_batch
from jax_impl.spec import SchemeSpec, parse_spec
from jax_impl.spec_counts import masks, token_mask

PER_TOKEN_KINDS = ("ce", "z_loss", "entropy", "ref_kl", "mtp")
KINDS = (*PER_TOKEN_KINDS, "moe_lb")
TRAINED_PARAMS = ("embed", "unembed", "mtp_unembed", "router")
FROZEN_PARAMS = ("ref_embed", "ref_unembed")
HEAD = {"mtp": "mtp_unembed", "moe_lb": "router"}  # every other kind reads "unembed"


@dataclass(frozen=True)
class ObjectiveTerm:
    """One term λ L, read from its dict by `parse_terms`: a per-token kind with its scheme
    spec, or moe_lb with its scope and top_k."""

    name: str
    kind: str
    coefficient: float
    scope: str
    top_k: int = 0
    spec: SchemeSpec | None = None


_TERM_KEYS = {"kind", "coefficient", "scheme", "scope", "top_k", "name"}


def _term_spec(name: str, data: Mapping[str, Any]) -> SchemeSpec:
    """A per-token term's scheme spec ({} = token_mean over the term's mask)."""
    if "scope" in data or "top_k" in data:
        # The scheme's own "scope" says it: two places to say it could disagree.
        raise ValueError(
            f"term {name!r}: scope and top_k are moe_lb's; a {data['kind']} term's scope is "
            "its scheme's 'scope'"
        )
    scheme = data.get("scheme") or {}
    if not isinstance(scheme, Mapping):
        raise ValueError(f"term {name!r}: scheme must be a scheme-spec dict, got {scheme!r}")
    try:
        # "name" labels a spec and takes no part in the math.
        return parse_spec({k: v for k, v in scheme.items() if k != "name"})
    except ValueError as exc:
        raise ValueError(f"term {name!r}: {exc}") from None


def parse_terms(terms: Sequence[Mapping[str, Any]]) -> tuple[ObjectiveTerm, ...]:
    """The terms of an objective, each checked (a spec by `jax_impl.spec.parse_spec`)."""
    parsed = []
    for data in terms:
        kind = data.get("kind")
        if kind not in KINDS:
            raise ValueError(f"term kind must be one of {', '.join(KINDS)}, got {kind!r}")
        name = str(data.get("name") or kind)
        unknown = set(data) - _TERM_KEYS
        coefficient = data.get("coefficient", 1.0)
        if unknown or isinstance(coefficient, bool) or not isinstance(coefficient, int | float):
            raise ValueError(
                f"term {name!r}: unknown keys {sorted(unknown)} or a coefficient "
                f"that is not a number ({coefficient!r})"
            )
        if kind == "moe_lb":
            scope, top_k = data.get("scope", "update"), data.get("top_k")
            if scope not in ("update", "microbatch") or not isinstance(top_k, int) or top_k < 1:
                raise ValueError(
                    f"term {name!r}: moe_lb needs a positive top_k and an update or "
                    f"microbatch scope, got top_k={top_k!r}, scope={scope!r}"
                )
            if data.get("scheme"):
                raise ValueError(f"term {name!r}: moe_lb has its own form and takes no scheme")
            parsed.append(ObjectiveTerm(name, kind, float(coefficient), scope, top_k))
        else:
            spec = _term_spec(name, data)
            parsed.append(ObjectiveTerm(name, kind, float(coefficient), spec.scope, spec=spec))
    if len({t.name for t in parsed}) != len(parsed):
        raise ValueError(f"term names must be unique, got {[t.name for t in parsed]}")
    return tuple(parsed)


class ObjectiveOutput(NamedTuple):
    """The update's objective; everything replicated over the mesh."""

    loss: jax.Array
    #: d total / d param for every trained param present.
    grads: Params
    #: L_k per term, before its coefficient [num terms].
    term_losses: jax.Array
    #: Tokens of each term's mask over the update (real tokens for moe_lb) [num terms].
    term_counts: jax.Array
    #: D_u of every unit of each term's scope ([1], [R] or [R M] per term).
    term_denominators: tuple[jax.Array, ...]


def mtp_targets(targets: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """y'_t = y_{t+1} when t + 1 < T and the segment does not change there, else ignored."""
    same = segment_ids[..., 1:] == segment_ids[..., :-1]
    shifted = jnp.where(same, targets[..., 1:], IGNORE_INDEX)
    return jnp.concatenate([shifted, jnp.full_like(targets[..., :1], IGNORE_INDEX)], axis=-1)


def token_losses(
    term: ObjectiveTerm,
    params: Params,
    inputs: jax.Array,
    targets: jax.Array,
    segment_ids: jax.Array,
    *,
    shifted: bool = False,
) -> jax.Array:
    """l_t of a per-token kind on [..., T] tokens, 0 where its mask is 0. For mtp `targets`
    are y, shifted here on the rows given, or already y' when `shifted` (a context shard's,
    shifted on whole rows)."""
    logits = jnp.take(params["embed"], inputs, axis=0) @ params[HEAD.get(term.kind, "unembed")]
    log_p = jax.nn.log_softmax(logits)
    p = jnp.exp(log_p)
    if term.kind == "mtp" and not shifted:
        targets = mtp_targets(targets, segment_ids)
    valid = targets != IGNORE_INDEX
    if term.kind in ("ce", "mtp"):
        safe = jnp.where(valid, targets, 0)
        losses = -jnp.take_along_axis(log_p, safe[..., None], axis=-1)[..., 0]
    elif term.kind == "z_loss":
        losses = jax.nn.logsumexp(logits, axis=-1) ** 2
    elif term.kind == "entropy":
        losses = -jnp.sum(p * log_p, axis=-1)
    else:  # ref_kl: q from the frozen reference, which no gradient reaches
        ref = lax.stop_gradient(jnp.take(params["ref_embed"], inputs, axis=0))
        log_q = jax.nn.log_softmax(ref @ lax.stop_gradient(params["ref_unembed"]))
        losses = jnp.sum(p * (log_p - log_q), axis=-1)
    return jnp.where(valid, losses, 0.0)


def router_probs(params: Params, inputs: jax.Array) -> jax.Array:
    """π_t = softmax(embed[x_t] · router) [..., E]."""
    return jax.nn.softmax(jnp.take(params["embed"], inputs, axis=0) @ params["router"])


def expert_counts(probs: jax.Array, real: jax.Array, top_k: int) -> jax.Array:
    """c_e per microbatch [M, E]: real tokens whose top-k includes e (lax.top_k puts the
    lower index first on a tie, the contract's rule)."""
    _, picks = lax.top_k(probs, top_k)
    onehot = jax.nn.one_hot(picks, probs.shape[-1], dtype=jnp.int32).sum(axis=-2)
    return jnp.sum(onehot * real[..., None], axis=(1, 2), dtype=jnp.int32)


class _Norm(NamedTuple):
    """A term's constants for the backward: 1 / (D_u K) per microbatch [M], and a_t [M, B, T]
    (per-token kinds) or the expert counts g [M, E] that multiply π_t (moe_lb); plus what is
    reported."""

    scale: jax.Array
    weights: jax.Array | None
    counts: jax.Array | None
    denominators: jax.Array
    count: jax.Array


def _gather(x: jax.Array, axis: str, world_size: int) -> jax.Array:
    """Every rank's `x` stacked rank-major [R, ...], by one psum of a one-slot-per-rank array."""
    slots = jnp.zeros((world_size, *x.shape), x.dtype)
    return lax.psum(slots.at[lax.axis_index(axis)].set(x), axis)


def _reported(denominators: jax.Array, scope: str, axis: str, world_size: int) -> jax.Array:
    """D_u of every unit of the scope, rank-major: [1], [R] or [R M]."""
    if scope == "update":
        return jnp.reshape(denominators, (1,))
    gathered = _gather(denominators, axis, world_size)  # [R] or [R, M]
    return gathered.reshape(-1)


def _router_norm(term, params, batch: Batch, axis: AxisName, world_size: int, dtype) -> _Norm:
    """moe_lb's expert counts and D_u = k n_u^2 / E, reduced where the unit spans ranks.

    Under context parallel (`axis` = ("data", "context"), `world_size` the R C processes) a
    microbatch is its data rank's: its counts are summed over the context axis first."""
    real = batch.segment_ids > 0  # padding is not routed
    local = jnp.sum(real, axis=(1, 2), dtype=jnp.int32)  # per microbatch [M]
    M = local.shape[0]
    count = lax.psum(jnp.sum(local), axis)
    probs = lax.stop_gradient(router_probs(params, batch.inputs))
    counts = expert_counts(probs, real, term.top_k)
    E = probs.shape[-1]
    data_axis, data_ranks = axis, world_size
    if not isinstance(axis, str):  # context parallel: the microbatch spans the context axis
        data_axis, context_axis = axis
        data_ranks = world_size // lax.axis_size(context_axis)
        # Summed over the context shards here, so only the data axis is left to sum.
        local, counts = lax.psum((local, counts), context_axis)
    if term.scope == "update":
        counts = jnp.broadcast_to(lax.psum(jnp.sum(counts, axis=0), data_axis), counts.shape)
        n = count.astype(dtype)
    else:
        n = local.astype(dtype)
    denominators = term.top_k * n * n / E
    units = data_ranks * M if term.scope == "microbatch" else 1
    # A unit with D_u = 0 has no token of weight: it contributes 0, never 0/0.
    safe = jnp.where(denominators > 0, denominators, 1)
    scale = jnp.broadcast_to(jnp.where(denominators > 0, 1 / safe / units, 0), (M,))
    reported = _reported(denominators, term.scope, data_axis, data_ranks)
    return _Norm(scale, None, counts, reported, count)


def term_batch(term: ObjectiveTerm, batch: Batch, context: ContextShift | None = None) -> Batch:
    """The batch whose ``valid`` mask is the term's mask: y' as the targets for mtp, shifted
    on whole rows across the context shards under context parallel (`context`)."""
    if term.kind != "mtp":
        return batch
    if context is None:
        return replace(batch, targets=mtp_targets(batch.targets, batch.segment_ids))
    return replace(batch, targets=context.shifted_targets(batch))


class ContextShift(NamedTuple):
    """The context axis and the order its ranks split a row in (context parallel)."""

    axis: str
    order: str

    def shifted_targets(self, batch: Batch) -> jax.Array:
        """y' at this shard's positions [..., T/C], shifted on whole rows: the rows' targets
        and segment ids gathered over the context axis (context rank by context rank), put
        back in position order, shifted, and this rank's positions taken. A shard cannot
        shift its own targets: the next target of its last position lives on another rank
        (Megatron-LM#7498 is this bug)."""
        C = lax.axis_size(self.axis)
        T = batch.targets.shape[-1] * C
        positions = context_positions(T, C, self.order)  # [C, T/C], static
        in_position_order = np.argsort(positions.ravel(), kind="stable")

        def whole(x: jax.Array) -> jax.Array:
            gathered = lax.all_gather(x, self.axis, axis=x.ndim - 1, tiled=True)
            return gathered[..., in_position_order]

        shifted = mtp_targets(whole(batch.targets), whole(batch.segment_ids))
        own = jnp.asarray(positions)[lax.axis_index(self.axis)]
        return jnp.take(shifted, own, axis=-1)


def _precount(term, params, own: Batch, axis: AxisName, world_size: int, dtype) -> _Norm:
    """The term's weights and counts, reduced where its unit spans ranks, before any backward.

    `own` is `term_batch`'s (y' as mtp's targets). A per-token term's spec is read by
    `rank_plan` (precount, summed gradients: s = 1), so its scale per microbatch is
    1 / (K D_u)."""
    if term.kind == "moe_lb":
        return _router_norm(term, params, own, axis, world_size, dtype)
    plan = rank_plan(term.spec, own, axis, Strategy.PRECOUNT, Collective.PSUM)
    numerator_mask = token_mask(term.spec.weight.mask, masks(own))
    count = lax.psum(jnp.sum(numerator_mask, dtype=jnp.int32), axis)
    # D per rank (U = rank) is broadcast over the rank's microbatches: one value per unit.
    local = plan.denominator[0] if term.spec.scope == "rank" else plan.denominator
    return _Norm(
        plan.grad_scale.astype(dtype),
        plan.token_weights.astype(dtype),
        None,
        _reported(local, term.spec.scope, axis, world_size),
        count,
    )


def _term_sum(
    term: ObjectiveTerm,
    norm: _Norm,
    params: Params,
    mb: Batch,
    m: int,
    weights: jax.Array | None = None,
):
    """sum_{t in microbatch m} a_t l_t / D_u / K of one term; `weights`: a_t of `mb` when it
    is not this rank's microbatch m (a step that gathered every rank's rows)."""
    if term.kind == "moe_lb":
        losses = router_probs(params, mb.inputs) @ norm.counts[m].astype(params["router"].dtype)
        losses = jnp.where(mb.segment_ids > 0, losses, 0.0)
    else:
        # `mb` is the term's (`term_batch`): mtp's targets are y' already.
        losses = token_losses(term, params, mb.inputs, mb.targets, mb.segment_ids, shifted=True)
        losses = losses * (norm.weights[m] if weights is None else weights)
    return jnp.sum(losses) * norm.scale[m]


def _rank_objective(
    params: Params,
    batch: Batch,
    terms,
    axis: AxisName,
    world_size: int,
    context: ContextShift | None = None,
):
    """One process's part: its [M, B, T] microbatches ([M, B, T/C] under context parallel,
    where `axis` is ("data", "context") and `world_size` counts the R C processes)."""
    lead = 1 if context is None else 2
    batch = jax.tree.map(lambda x: x.reshape(x.shape[lead:]), batch)  # drop the mesh axes
    dtype = params["embed"].dtype
    batches = [term_batch(t, batch, context) for t in terms]
    norms = [
        _precount(t, params, b, axis, world_size, dtype)
        for t, b in zip(terms, batches, strict=True)
    ]
    trained = {k: v for k, v in params.items() if k in TRAINED_PARAMS}
    frozen = {k: v for k, v in params.items() if k in FROZEN_PARAMS}
    coefficients = jnp.asarray([t.coefficient for t in terms], dtype)

    def microbatch_objective(p: Params, m: int):
        parts = jnp.stack(
            [
                _term_sum(t, n, p | frozen, jax.tree.map(lambda x, m=m: x[m], b), m)
                for t, n, b in zip(terms, norms, batches, strict=True)
            ]
        )
        return jnp.sum(coefficients * parts), parts

    local = rank_varying(trained, axis)
    grads = jax.tree.map(jnp.zeros_like, local)
    parts = jnp.zeros(len(terms), dtype)
    for m in range(batch.inputs.shape[0]):
        g, part = jax.grad(microbatch_objective, has_aux=True)(local, m)
        grads = jax.tree.map(jnp.add, grads, g)
        parts = parts + part
    grads, parts = lax.psum((grads, parts), axis)
    return ObjectiveOutput(
        loss=jnp.sum(coefficients * parts),
        grads=grads,
        term_losses=parts,
        term_counts=jnp.stack([n.count for n in norms]),
        term_denominators=tuple(n.denominators for n in norms),
    )


def make_objective_fn(
    terms: Sequence[Mapping[str, Any]],
    mesh: Mesh,
    axis_name: str = "data",
    *,
    context_order: str = "contiguous",
) -> Callable[[Params, Batch], ObjectiveOutput]:
    """objective(params, batch) -> ObjectiveOutput, jitted, over the 1-D `mesh`.

    `batch` is [R, M, B, T] with R the mesh size (`jax_impl.lay_out_global_batch`); params
    hold ``embed`` and the heads and references the terms read. On a ("data", "context")
    mesh (`jax_impl.context_parallel.context_mesh`) the batch is [R, C, M, B, T/C], laid out
    by `lay_out_context_parallel` in `context_order`: every collective spans both axes, mtp's
    targets are shifted on whole rows, and a microbatch-scope moe_lb counts its data rank's
    microbatch over every context shard.
    """
    parsed = parse_terms(terms)
    if tuple(mesh.axis_names) == CONTEXT_AXES:
        axis: AxisName = CONTEXT_AXES
        context = ContextShift(CONTEXT_AXES[1], context_order)
        world_size = mesh.shape[CONTEXT_AXES[0]] * mesh.shape[CONTEXT_AXES[1]]
        place = _context_placer(mesh)
    else:
        axis, context, world_size = axis_name, None, mesh.shape[axis_name]

        def place(batch: Batch) -> Batch:
            return shard_batch(batch, mesh, axis_name)

    def per_rank(params, batch):
        return _rank_objective(params, batch, parsed, axis, world_size, context)

    mapped = jax.jit(
        jax.shard_map(
            per_rank,
            mesh=mesh,
            in_specs=(P(), P(*axis) if context else P(axis)),
            out_specs=P(),
        )
    )

    def objective(params: Params, batch: Batch) -> ObjectiveOutput:
        for term in parsed:
            kind_params = ("embed", HEAD.get(term.kind, "unembed"))
            needed = kind_params + (FROZEN_PARAMS if term.kind == "ref_kl" else ())
            missing = [k for k in needed if k not in params]
            if missing:
                raise ValueError(f"term {term.name!r} ({term.kind}) needs params {missing}")
        return mapped(replicate(dict(params), mesh), place(batch))

    return objective
