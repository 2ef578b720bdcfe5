r"""The float64 oracle: loss and gradient of the intended objective, in closed form.

The bilinear model of every fixture: for token t with input :math:`x_t` and target
:math:`y_t`,

.. math::

    z_t = E[x_t]\, U, \qquad l_t = \operatorname{logsumexp}(z_t) - z_{t, y_t}

with :math:`E` = ``embed`` [V, H] and :math:`U` = ``unembed`` [H, V]. With
:math:`p_t = \operatorname{softmax}(z_t)`, :math:`e_t = p_t - \operatorname{onehot}(y_t)` and the
effective weight :math:`c_t = a_t / D` of the scheme,

.. math::

    \frac{\partial L}{\partial U} = \sum_t c_t\, E[x_t]^\top e_t, \qquad
    \frac{\partial L}{\partial E[x]} = \sum_{t:\, x_t = x} c_t\, U e_t.

No autodiff: the tests check this against central finite differences of the loss.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections import OrderedDict
from typing import NamedTuple

import numpy as np

from crosscheck.contract.fixture import Fixture
from crosscheck.contract.layout import IGNORE_INDEX
from crosscheck.contract.schemes import resolve_scheme
from crosscheck.contract.spec import SchemeSpec

Params = dict[str, np.ndarray]


class TokenTerms(NamedTuple):
    """Per-token loss l_t [N, T] (0 where ignored) and softmax error e_t [N, T, V]."""

    losses: np.ndarray
    errors: np.ndarray


def token_terms(params: Params, inputs: np.ndarray, targets: np.ndarray) -> TokenTerms:
    """l_t and e_t = softmax(z_t) - onehot(y_t) for every token, in float64."""
    embed = np.asarray(params["embed"], dtype=np.float64)
    unembed = np.asarray(params["unembed"], dtype=np.float64)
    valid = targets != IGNORE_INDEX
    safe_targets = np.where(valid, targets, 0)
    logits = embed[inputs] @ unembed
    peak = logits.max(axis=-1, keepdims=True)
    shifted = logits - peak
    log_norm = np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    probs = np.exp(shifted - log_norm)
    target_logit = np.take_along_axis(shifted, safe_targets[..., None], axis=-1)
    losses = np.where(valid, (log_norm - target_logit)[..., 0], 0.0)
    onehot = np.zeros_like(probs)
    np.put_along_axis(onehot, safe_targets[..., None], 1.0, axis=-1)
    errors = np.where(valid[..., None], probs - onehot, 0.0)
    return TokenTerms(losses, errors)


#: How many (params, batch) pairs `_shared_token_terms` keeps: an update's first step on one
#: fixture is shared by every scheme and layout run on it; later steps' params are new.
_TOKEN_TERMS_KEPT = 16
_token_terms_kept: OrderedDict[bytes, TokenTerms] = OrderedDict()
#: `crosscheck run` judges rows on several threads at once: one thread's eviction between
#: another's lookup and its move to the end would raise KeyError there.
_token_terms_lock = threading.Lock()


def _shared_token_terms(params: Params, inputs: np.ndarray, targets: np.ndarray) -> TokenTerms:
    """`token_terms`, computed once per distinct (params, inputs, targets) among the last
    `_TOKEN_TERMS_KEPT`: keyed by a digest of their dtypes, shapes and bytes, so equal
    values share a result whatever objects hold them. The arrays returned are read-only:
    callers share them."""
    digest = hashlib.blake2b(digest_size=32)
    for name, array in [*sorted(params.items()), ("inputs", inputs), ("targets", targets)]:
        array = np.ascontiguousarray(array)
        digest.update(f"{name}:{array.dtype.str}:{array.shape};".encode())
        digest.update(array.tobytes())
    key = digest.digest()
    with _token_terms_lock:
        terms = _token_terms_kept.get(key)
        if terms is not None:
            _token_terms_kept.move_to_end(key)
            return terms
    # Computed outside the lock: two threads may compute the same value, never a wrong one.
    terms = token_terms(params, inputs, targets)
    for array in terms:
        array.setflags(write=False)
    with _token_terms_lock:
        _token_terms_kept[key] = terms
        if len(_token_terms_kept) > _TOKEN_TERMS_KEPT:
            _token_terms_kept.popitem(last=False)
    return terms


def weighted_loss(params: Params, inputs: np.ndarray, targets: np.ndarray, c: np.ndarray) -> float:
    """L = sum_t c_t l_t (correctly rounded sum)."""
    losses = token_terms(params, inputs, targets).losses
    return math.fsum((c * losses).ravel().tolist())


def weighted_grad(params: Params, inputs: np.ndarray, targets: np.ndarray, c: np.ndarray) -> Params:
    """dL/dparams of L = sum_t c_t l_t, closed form (see the module docstring)."""
    errors = token_terms(params, inputs, targets).errors
    return _grad_from_errors(params, inputs, errors, c)


def _grad_from_errors(params: Params, inputs: np.ndarray, errors: np.ndarray, c: np.ndarray):
    """`weighted_grad` given the tokens' softmax errors e_t (computed once by the caller)."""
    embed = np.asarray(params["embed"], dtype=np.float64)
    unembed = np.asarray(params["unembed"], dtype=np.float64)
    flat_inputs = inputs.ravel()
    scaled = (c[..., None] * errors).reshape(flat_inputs.size, -1)  # c_t e_t, [tokens, V]
    d_unembed = embed[flat_inputs].T @ scaled
    d_embed = np.zeros_like(embed)
    np.add.at(d_embed, flat_inputs, scaled @ unembed.T)
    return {"embed": d_embed, "unembed": d_unembed}


def token_jacobian(params: Params, inputs: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Every valid token's own gradient of l_t, flattened: [valid tokens, V H + H V].

    Row i is d l_t / d(embed, unembed) for the i-th valid token in [N, T] order, with the
    embed block first (the order of sorted parameter names). For any weights c,
    ``c[valid] @ J`` is `weighted_grad` flattened: diagnosis fits against these rows.
    """
    embed = np.asarray(params["embed"], dtype=np.float64)
    unembed = np.asarray(params["unembed"], dtype=np.float64)
    valid = targets != IGNORE_INDEX
    errors = token_terms(params, inputs, targets).errors[valid]  # e_t, [n, V]
    x = inputs[valid]
    n, (V, H) = x.size, embed.shape
    d_embed = np.zeros((n, V, H))
    d_embed[np.arange(n), x] = errors @ unembed.T  # only row x_t of embed: U e_t
    d_unembed = embed[x][:, :, None] * errors[:, None, :]  # E[x_t]^T e_t, [n, H, V]
    return np.concatenate([d_embed.reshape(n, -1), d_unembed.reshape(n, -1)], axis=1)


class OracleResult(NamedTuple):
    """The objective of one update over the whole global batch, and what went into it."""

    loss: float
    grads: Params
    denominator: float
    #: Effective weight a_t / D of every token, global [N, T] order.
    token_weights: np.ndarray
    #: True when no token of the update carries weight: the loss and gradient are exactly 0.
    no_valid_tokens: bool
    #: Valid targets per rank, [R].
    rank_valid_tokens: np.ndarray
    #: Unnormalized loss sum per rank, sum of a_t l_t (intended schemes) [R].
    rank_loss_sums: np.ndarray


def loss_and_grad(
    fixture: Fixture,
    scheme: str | SchemeSpec,
    world_size: int = 1,
    accum_steps: int = 1,
    params: Params | None = None,
    *,
    context_size: int = 1,
    context_order: str = "contiguous",
) -> OracleResult:
    """The oracle's objective and gradient for `scheme` on `fixture` laid out as (R, M), every
    row's positions over `context_size` context-parallel ranks (`crosscheck.contract.layout`).

    `params` defaults to the fixture's own. For the accidental schemes the denominator is
    reported as K, the number of units (R C per process, R C M per microbatch), and the
    unnormalized sums are those of each process's own means; the per-rank figures are per
    process (data-parallel rank r, context rank c: process r C + c).
    """
    scheme = resolve_scheme(scheme)
    params = fixture.params() if params is None else params
    batch = fixture.layout(world_size, accum_steps, context_size, context_order)
    weights = batch.to_global(scheme.effective_weights(batch))
    denominator = scheme.global_denominator(batch)
    terms = _shared_token_terms(params, fixture.inputs, fixture.targets)
    loss = math.fsum((weights * terms.losses).ravel().tolist())
    grads = _grad_from_errors(params, fixture.inputs, terms.errors, weights)
    no_valid = not np.any(weights)
    N, T = fixture.targets.shape
    rank_of_row = np.arange(N) // (N // world_size)
    process = rank_of_row[:, None] * context_size + batch.layout.context_ranks(T)[None, :]
    processes = world_size * context_size
    per_process = [process == p for p in range(processes)]
    return OracleResult(
        loss=loss,
        grads=grads,
        denominator=denominator,
        token_weights=weights,
        no_valid_tokens=no_valid,
        rank_valid_tokens=np.array(
            [int(np.count_nonzero(fixture.valid & on)) for on in per_process]
        ),
        rank_loss_sums=np.array(
            [
                math.fsum((weights[on] * denominator * terms.losses[on]).tolist())
                for on in per_process
            ]
        ),
    )


def loss(
    fixture: Fixture,
    scheme: str | SchemeSpec,
    world_size: int = 1,
    accum_steps: int = 1,
    params: Params | None = None,
) -> float:
    """The objective alone (used by the finite-difference tests)."""
    params = fixture.params() if params is None else params
    batch = fixture.layout(world_size, accum_steps)
    weights = batch.to_global(resolve_scheme(scheme).effective_weights(batch))
    return weighted_loss(params, fixture.inputs, fixture.targets, weights)
