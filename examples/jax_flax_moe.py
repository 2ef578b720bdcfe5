r"""A small Flax MoE causal LM with its own router loss, in a pmap step: one correct, one Trainer's.

``crosscheck verify --framework jax --model examples.jax_flax_moe:model --objective
examples.jax_flax_moe:OBJECTIVE --step examples.jax_flax_moe:step``: the step gets this model's
params and ``apply`` and is judged, term by term, against the objective it means,

.. math::

    \text{total} = \frac{1}{n} \sum_t v_t\, \mathrm{ce}_t
      + \lambda \frac{1}{R M} \sum_{u} A(u), \qquad \lambda = 0.02,

n the update's valid targets (target != -100), v_t 1 on them, and A(u) the model's own router
load-balancing loss of the forward over microbatch u (its B rows): the per-forward mean,
``moe_lb`` at ``microbatch`` scope (docs/verify.md, "Multi-term objectives").

``model()`` returns ``(apply_fn, params)``, initialized from a fixed PRNGKey (the same params
every call): token and learned position embeddings, one pre-norm block of causal
self-attention and a mixture-of-experts feed-forward, an unembedding, over the fixtures'
40-token vocabulary. ``apply_fn(params, inputs)`` returns ``(logits [..., T, V], aux_loss)``.
The MoE layer has E = 4 experts (each a small GELU MLP) and a router ``Dense`` to E logits;
every token takes its top k = 2 experts, their routing probabilities renormalized to sum to 1
(Mixtral's combine). The router loss is Switch's, over all the [B, T] positions of the
forward's inputs (padding included, to keep it simple), N = B T of them:

.. math::

    A = E \sum_e f_e P_e, \qquad
    f_e = \frac{c_e}{k N}, \qquad P_e = \frac{1}{N} \sum_t \pi_{te},

pi_t = softmax(router logits of token t), c_e the number of the forward's tokens whose top k
includes e (a count: no gradient), so that the f_e sum to 1 (transformers'
``load_balancing_loss_func``, modeling_mixtral.py:540-544, leaves out the 1/k: its loss is k
times this one). Every token passes through every expert and keeps the outputs of its top k
(dense dispatch, no capacity, nothing dropped), so rows are independent: a row's logits are
the same in any batch, as the reference needs; only A depends on the forward's rows.

* ``step``: a count pre-pass (the update's valid targets, ``psum``'d over the devices), then
  one forward and gradient per microbatch of ``ce_sum / n + λ A / (R M)``, the gradients
  summed over the microbatches and ``psum``'d: the objective; PASSES.
* ``step_aux_summed``: the same, but every microbatch adds ``λ A`` whole: the arrangement
  transformers 5.24's ``Trainer`` gives a MoE model's router loss (the model's loss holds
  ``router_aux_loss_coef * aux_loss``, modeling_mixtral.py:633; the whole loss times R,
  trainer.py:2215; not divided by the accumulation steps under ``num_items_in_batch``,
  trainer.py:2116-2119): the router loss summed over the update's R M forwards. FAILS:
  aux-summed-over-microbatches(moe_lb), scale R M.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from examples._jax_common import IGNORE_INDEX, Batch

VOCAB_SIZE = 40
#: The longest row of the built-in fixtures (packed is 8 x 64).
MAX_LENGTH = 64
ROUTER_AUX_LOSS_COEF = 0.02
#: What the steps mean: the token mean of the cross-entropy over the update, plus the router
#: loss at its coefficient as the mean over the update's forwards.
OBJECTIVE = [
    {"kind": "ce"},
    {"kind": "moe_lb", "coefficient": ROUTER_AUX_LOSS_COEF, "top_k": 2, "scope": "microbatch"},
]


class MoEFeedForward(nn.Module):
    """(out [..., T, D], A): each token's top-k experts' outputs, and the router loss."""

    num_experts: int = 4
    top_k: int = 2
    hidden: int = 32

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        E, k, width = self.num_experts, self.top_k, x.shape[-1]
        probs = jax.nn.softmax(nn.Dense(E, use_bias=False, name="router")(x), axis=-1)
        top_probs, top_experts = jax.lax.top_k(probs, k)  # [..., T, k]
        chosen = jax.nn.one_hot(top_experts, E, dtype=x.dtype)  # [..., T, k, E]
        # Mixtral's combine: the top k's probabilities renormalized, 0 for the other experts.
        gates = jnp.einsum("...k,...ke->...e", top_probs / top_probs.sum(-1, keepdims=True), chosen)
        init = nn.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        w_in = self.param("w_in", init, (E, width, self.hidden))
        w_out = self.param("w_out", init, (E, self.hidden, width))
        # Dense dispatch: every expert on every token, each token keeping its top k.
        hidden = nn.gelu(jnp.einsum("...d,edf->...ef", x, w_in))
        experts = jnp.einsum("...ef,efd->...ed", hidden, w_out)
        out = jnp.einsum("...e,...ed->...d", gates, experts)

        tokens = probs.reshape(-1, E)  # the forward's N = B T positions, padding included
        counts = jax.lax.stop_gradient(chosen.reshape(-1, E).sum(0))  # c_e
        fraction = counts / (k * tokens.shape[0])  # f_e, summing to 1
        aux = E * jnp.sum(fraction * tokens.mean(0))  # E sum_e f_e P_e
        return out, aux


class TinyMoELM(nn.Module):
    """(logits [..., T, V], A) of a one-block pre-norm causal Transformer with an MoE MLP."""

    vocab_size: int = VOCAB_SIZE
    width: int = 16
    heads: int = 2

    @nn.compact
    def __call__(self, inputs: jax.Array) -> tuple[jax.Array, jax.Array]:
        length = inputs.shape[-1]
        positions = self.param("positions", nn.initializers.normal(0.02), (MAX_LENGTH, self.width))
        x = nn.Embed(self.vocab_size, self.width)(inputs) + positions[:length]
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(
            h, h, mask=nn.make_causal_mask(inputs)
        )
        out, aux = MoEFeedForward(hidden=2 * self.width)(nn.LayerNorm()(x))
        return nn.Dense(self.vocab_size)(nn.LayerNorm()(x + out)), aux


def model() -> tuple[Callable[..., tuple[jax.Array, jax.Array]], Any]:
    """(apply_fn, params), the same params every call (PRNGKey 0)."""
    module = TinyMoELM()
    params = module.init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))
    return module.apply, params


def device_grads(
    apply_fn: Callable, aux_weight: float, params: Any, batch: dict[str, jax.Array]
) -> Any:
    """One device's gradient over its M microbatches ([M, B, T] each), psum'd over the
    devices: of each microbatch's summed cross-entropy over the update's count, plus
    `aux_weight` times its forward's router loss."""
    # The count pre-pass: the update's valid targets, known before any gradient.
    count = jax.lax.psum(jnp.sum(batch["targets"] != IGNORE_INDEX), axis_name="batch")

    def loss(p: Any, inputs: jax.Array, targets: jax.Array) -> jax.Array:
        logits, aux = apply_fn(p, inputs)  # one forward per microbatch: A of its B rows
        mask = targets != IGNORE_INDEX
        losses = optax.softmax_cross_entropy_with_integer_labels(
            logits, jnp.where(mask, targets, 0)
        )
        return jnp.sum(jnp.where(mask, losses, 0.0)) / count + aux_weight * aux

    grads = [
        jax.grad(loss)(params, inputs, targets)
        for inputs, targets in zip(batch["inputs"], batch["targets"], strict=True)
    ]
    summed = jax.tree.map(lambda *leaves: sum(leaves), *grads)
    return jax.lax.psum(summed, axis_name="batch")


@functools.cache
def p_grads(apply_fn: Callable, aux_weight: float, devices: tuple[jax.Device, ...]) -> Callable:
    """The pmapped step, built once per model, router-loss weight and device set."""
    return jax.pmap(
        functools.partial(device_grads, apply_fn, aux_weight),
        axis_name="batch",
        in_axes=(None, 0),  # params broadcast, batch split over devices
        devices=devices,
    )


def _run(params: Any, apply_fn: Callable, batch: Batch, mesh: Mesh, aux_weight: float) -> Any:
    arrays = {key: batch[key] for key in ("inputs", "targets")}  # [R, M, B, T]
    return p_grads(apply_fn, aux_weight, tuple(mesh.devices.flat))(params, arrays)


def step(params: Any, apply_fn: Callable, batch: Batch, mesh: Mesh) -> Any:
    """ce over the psum'd count plus λ A / (R M) per microbatch, gradients summed and psum'd
    ([R, ...], replicated): the objective."""
    R, M = batch["inputs"].shape[:2]
    return _run(params, apply_fn, batch, mesh, ROUTER_AUX_LOSS_COEF / (R * M))


def step_aux_summed(params: Any, apply_fn: Callable, batch: Batch, mesh: Mesh) -> Any:
    """The same with λ A whole per microbatch: the Trainer's router loss, summed over the R M
    forwards."""
    return _run(params, apply_fn, batch, mesh, ROUTER_AUX_LOSS_COEF)
