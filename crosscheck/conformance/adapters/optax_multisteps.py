r"""optax 0.2.8's real ``optax.MultiSteps`` on a tiny Flax 0.12.8 NNX causal LM, one update.

Why one file: the six settings share the model, the loss and the micro-step loop; each is
a few lines of it.

Pinned: optax 0.2.8, flax 0.12.8, jax / jaxlib 0.10.2. Run a row as::

    OMP_NUM_THREADS=1 .venv/bin/python -m crosscheck verify --framework jax \
        --step crosscheck.conformance.adapters.optax_multisteps:step_jit_mean \
        --model crosscheck.conformance.adapters.optax_multisteps:model \
        --forward crosscheck.conformance.adapters.optax_multisteps:logits \
        --scheme token_mean --fixtures packed,ragged --world-sizes 1,2 --accum-steps 1,2 \
        --timeout 300

**What optax documents.** ``optax.MultiSteps`` (``optax/_src/wrappers.py:34`` re-exports
``optax/transforms/_accumulation.py:243``), class docstring (``_accumulation.py:246-255``):
"This wrapper collects together the updates passed to its ``update`` function over consecutive
steps until a given number of scheduled steps is reached. [...] the gradients accumulated to
the current time will be passed to the wrapped optimizer's update function". Its
``use_grad_mean`` (``_accumulation.py:279-280``): "if ``True`` (the default), gradients
accumulated over multiple mini-steps are averaged. Otherwise, they are summed." The code that
does it, ``_accumulation.py:305-311``: with ``use_grad_mean`` a Welford running mean, ``acc +
(grad - acc) / (n_acc + 1)``, otherwise ``grad + acc``; ``:366-368`` hands the accumulated
gradient to the inner optimizer and ``:370, :386`` emit its update on the k-th mini-step
(zeros before). The accumulator is float32 unless told otherwise (``accumulator_dtype``,
``:268``, ``:293-294``: "defaults to `float32`"); these steps keep that default, as a user
does, so every mini-step but the last is rounded to float32 and verify judges at
float32-level.

optax's gradient accumulation guide (``examples/gradient_accumulation.ipynb`` of
google-deepmind/optax, rendered at optax.readthedocs.io/en/latest/_collections/examples/
gradient_accumulation.html) promises what the average is *for*: "Gradient accumulation makes
it possible to simulate training on one large batch"; "The following two snippets will compute
numerically identical results, but with the difference that the second snippet will use
gradient accumulation over three batches to mimic the first snippet, which performs a single
step with one large batch"; "the wrapped optimizer will be applied to the average over the raw
gradients seen up until now". Its loss is a batch *mean*,
``optax.softmax_cross_entropy_with_integer_labels(logits, batch['label']).mean()``, and its
three microbatches hold three examples each: equal counts, where the average of microbatch
means *is* the large-batch mean.

**Intended scheme, per setting.** ``use_grad_mean=True``: ``token_mean``, the one large-batch
step the guide promises to mimic; the docs show that equality only for microbatches of equal
counts, so with a token-mean loss over microbatches of unequal valid-token counts the expected
verdict is the average of microbatch means (microbatch-mean, or under jit its
per-global-microbatch form, microstep-mean), i.e. documented behaviour, not an optax
bug. ``use_grad_mean=False``: the docs only promise "summed"; the intended scheme is still
``token_mean`` (a summing MultiSteps is the tool for a loss normalized by the whole window:
``examples/jax_optax_float32.py``), and with a per-microbatch mean loss the sum is M times the
average above.

**What verify says** (``--scheme token_mean``, packed and ragged, R in {1, 2}, M in {1, 2}):
every setting is exact (float64-exact) at M = 1 wherever the mean is taken over the global
microbatch, and none is token_mean at M = 2. With n_rm the valid targets of rank r's
microbatch m, n_m = sum_r n_rm and N = sum n_rm, a token's weight is

* ``step_jit_mean``, ``step_nnx_mean``: 1 / (M n_m): microstep-mean (at R = 1 it
  coincides with microbatch-mean, the name kept there);
* ``step_jit_sum``, ``step_nnx_sum``: 1 / n_m, M times that: microbatch-skew at M = 2;
* ``step_shard_map_mean``: 1 / (R M n_rm): rank-mean at M = 1, microbatch-mean at M = 2 (the
  catalogued pattern, named for every case);
* ``step_shard_map_sum``: 1 / (R n_rm): rank-mean at M = 1, microbatch-skew at M = 2.

The factors verify recovers (N times the weight) agree with these to 3.4e-9 (the float32
accumulator). M times a microbatch mean (the sum settings) has no pattern of its own: it is
named by its family, microbatch-skew (one factor per microbatch).

**The loss** is what a Flax / optax user writes for a language model: the token mean of the
microbatch's cross-entropy over its valid targets. Per token, optax's own
``softmax_cross_entropy_with_integer_labels(logits, labels, where=mask)``: ``where`` "Elements
to include in the computation of shape ``[batch_size]`` or logits.shape"
(``optax/losses/_classification.py:330-331``), a [B, T] token mask that the code expands over
the classes and turns into a loss of 0 for an excluded token (``:379-380, :403-406``); ignored
targets (-100) also get the in-range label 0, as a user does before a gather. The mean is
lm1b's: Flax's NNX LM example (google/flax ``examples/lm1b_nnx/train.py``:
``compute_weighted_cross_entropy`` returns ``loss.sum(), weights.sum()`` and ``train_step``'s
``loss_fn`` returns ``mean_loss = loss / weight_sum``). No fixture of the runs below has a
microbatch without valid targets, so the mean is not guarded (a user's is not).

**Settings** (every step takes ``optimizer``, the harness's ``optax.sgd(1.0)``, wraps it in
``optax.MultiSteps(optimizer, every_k_schedule=M, use_grad_mean=...)``, steps it M times, one
micro-step per microbatch, and returns the updates it emits on the M-th, minus the accumulated
gradient, so that MultiSteps' own accumulation is what is verified; no gradient clipping):

* ``step_jit_mean`` / ``step_jit_sum``: ``jax.jit`` with the microbatch's global rows [R B, T]
  placed by ``NamedSharding(mesh, P("data"))`` (device r holds rank r's rows) and params
  replicated (``P()``): the gradient of the token mean of the *global* microbatch, XLA
  inserting the all-reduce, as Flax's lm1b_nnx example jits ``train_step`` with
  ``in_shardings=(state_sharding, data_sharding, None)``, ``data_sharding =
  NamedSharding(mesh, P(config.data_sharding))``. ``use_grad_mean`` True / False.
* ``step_shard_map_mean`` / ``step_shard_map_sum``: ``jax.shard_map`` over "data": each
  device's token mean of its own rows, ``jax.lax.pmean`` over "data", and ``jax.grad`` of that
  outside the shard_map: the data-parallel recipe of JAX's shard_map tutorial ("Manual
  parallelism with shard_map", docs.jax.dev/en/latest/notebooks/shard_map.html, data
  parallelism: ``loss_dp`` returns ``jax.lax.pmean(local_loss, 'batch')`` of each device's
  mean loss), the shard_map form of Flax's pmap ``train_step`` (``lax.pmean(grads,
  'batch')``): the gradient is the mean over devices of per-device mean-loss gradients.
* ``step_nnx_mean`` / ``step_nnx_sum``: Flax NNX's own update loop, ``nnx.Optimizer(model,
  optax.MultiSteps(...), wrt=nnx.Param)`` (``flax/nnx/training/optimizer.py:131-166``) under
  ``nnx.jit``, ``nnx.value_and_grad`` of the same global-microbatch mean loss, sharded as in
  ``step_jit_*``; ``optimizer.update(model, grads)`` (``optimizer.py:217-230``) calls
  ``tx.update`` and ``optax.apply_updates`` and returns the updates it applied, which the step
  returns.

**The model** (``model()``): a one-block pre-norm causal Transformer in Flax NNX (token and
learned position embeddings, ``nnx.MultiHeadAttention`` with ``nnx.make_causal_mask`` and
``attention_fn=exact_attention``, an MLP, a vocabulary head) over the fixtures' 40 tokens,
rows up to 64 long, built from ``nnx.Rngs(0)`` so every call gives the same params; rows are
independent (attention within a row, layer norm per token). It is split as ``graphdef, state
= nnx.split(module)`` and handed over as ``(apply_fn, params)``: ``params =
nnx.as_pure(state)`` (an ``nnx.State`` of plain arrays, leaves named by their pytree path, the
same paths ``nnx.Optimizer.update`` returns its updates under), ``apply_fn =
functools.partial(apply_graph, graphdef)``, ``apply_fn(params, inputs) = nnx.merge(graphdef,
params)(inputs)``. The harness casts the floating leaves to the job's dtype (float64 by
default) and the NNX layers compute in their params' dtype; the one exception, the float32
softmax of ``jax.nn.dot_product_attention`` that ``nnx.MultiHeadAttention`` reaches by
default, is avoided by ``exact_attention`` (Flax's own attention-weights path), so the model
is float64-exact and only MultiSteps' float32 accumulator rounds; likewise ``nnx.Embed``'s
compute dtype, fixed to float32 when it is built, is reset to None (follow the params).

**Deviations for CPU.** The devices are XLA's fake CPU devices (8, set by the harness); the
mesh is the harness's 1-D "data" mesh over R of them. Nothing else.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.nnx.nn.attention import dot_product_attention_weights
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

#: The fixtures' vocabulary (crosscheck.fixtures.documents.VOCAB_SIZE).
VOCAB_SIZE = 40
#: The longest row of the built-in fixtures (packed is 8 x 64).
MAX_LENGTH = 64
IGNORE_INDEX = -100

Batch = dict[str, np.ndarray]
Microbatch = dict[str, jax.Array]


def exact_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    mask: jax.Array | None = None,
    dtype: Any = None,
    precision: Any = None,
    is_causal: bool = False,
    **unused: Any,
) -> jax.Array:
    """``nnx.dot_product_attention`` without its fast path, in the inputs' dtype.

    Without dropout, ``nnx.dot_product_attention`` hands the call to
    ``jax.nn.dot_product_attention`` (flax/nnx/nn/attention.py:288), whose XLA path takes the
    softmax in float32 whatever the dtype (jax/_src/nn/functions.py:861, :970): the model would
    be float32-level in float64, and the key bias, which the loss gives no gradient, would hold
    float32 rounding the harness cannot tell from a gradient. Flax's own weights path
    (``dot_product_attention_weights``, then the same einsum as its slow path) keeps float64.
    """
    weights = dot_product_attention_weights(
        query, key, mask=mask, dtype=dtype, precision=precision, is_causal=is_causal
    )
    return jnp.einsum("...hqk,...khd->...qhd", weights, value, precision=precision)


class TinyCausalLM(nnx.Module):
    """logits [..., T, V] of a one-block pre-norm causal Transformer (rows independent)."""

    def __init__(self, rngs: nnx.Rngs, width: int = 32, heads: int = 4) -> None:
        self.embed = nnx.Embed(VOCAB_SIZE, width, rngs=rngs)
        # nnx.Embed fixes its compute dtype when built (``dtype or self.embedding.dtype``,
        # flax/nnx/nn/linear.py:1290: float32 here), so float64 params would be gathered, and
        # their gradient scatter-added, in float32; None lets it follow the params' dtype as
        # the other layers do.
        self.embed.dtype = None
        self.positions = nnx.Param(
            nnx.initializers.normal(0.02)(rngs.params(), (MAX_LENGTH, width))
        )
        self.norm_attn = nnx.LayerNorm(width, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=heads,
            in_features=width,
            decode=False,
            attention_fn=exact_attention,
            rngs=rngs,
        )
        self.norm_mlp = nnx.LayerNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, 2 * width, rngs=rngs)
        self.down = nnx.Linear(2 * width, width, rngs=rngs)
        self.norm_out = nnx.LayerNorm(width, rngs=rngs)
        self.head = nnx.Linear(width, VOCAB_SIZE, rngs=rngs)

    def __call__(self, inputs: jax.Array) -> jax.Array:
        x = self.embed(inputs) + self.positions[: inputs.shape[-1]]
        # Causal attention within each row only: the reference evaluates rows alone.
        x = x + self.attn(self.norm_attn(x), mask=nnx.make_causal_mask(inputs))
        x = x + self.down(nnx.gelu(self.up(self.norm_mlp(x))))
        return self.head(self.norm_out(x))


def apply_graph(graphdef: nnx.GraphDef, params: Any, inputs: jax.Array) -> jax.Array:
    """The logits of `inputs` under `params`: the module rebuilt by ``nnx.merge``."""
    return nnx.merge(graphdef, params)(inputs)


def model() -> tuple[Callable[..., jax.Array], Any]:
    """(apply_fn, params) of a fresh TinyCausalLM, the same params every call (Rngs(0))."""
    graphdef, state = nnx.split(TinyCausalLM(nnx.Rngs(0)))
    # Every variable is a Param: the harness's gradient (all leaves) is nnx.Optimizer's
    # wrt=nnx.Param, and no RNG or batch-statistics state rides along.
    others = [path for path, v in nnx.to_flat_state(state) if not isinstance(v, nnx.Param)]
    if others:
        raise RuntimeError(f"TinyCausalLM holds non-Param state at {others}")
    return functools.partial(apply_graph, graphdef), nnx.as_pure(state)


def logits(apply_fn: Callable[..., jax.Array], params: Any, microbatch: dict) -> jax.Array:
    """The logits [B, T, V] the reference's token losses come from (``--forward``)."""
    return apply_fn(params, microbatch["inputs"])


def token_mean_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """The user's loss: the microbatch's token mean of optax's cross-entropy, ignored targets
    excluded by its ``where=`` (lm1b_nnx's ``loss.sum() / weights.sum()``)."""
    mask = targets != IGNORE_INDEX
    labels = jnp.where(mask, targets, 0)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels, where=mask)
    return jnp.sum(losses) / jnp.sum(mask)


@functools.cache
def accumulate(optimizer: optax.GradientTransformation, k: int, mean: bool) -> optax.MultiSteps:
    """The user's optimizer applied once every `k` micro-steps; the default float32
    accumulator on purpose (what a user gets)."""
    return optax.MultiSteps(optimizer, every_k_schedule=k, use_grad_mean=mean)


def global_microbatches(batch: Batch, mesh: Mesh) -> list[Microbatch]:
    """Microbatch m of every rank as one global [R B, T] batch, rows sharded over "data";
    asserts that device r holds exactly rank r's rows of microbatch m."""
    R, M, B, T = batch["inputs"].shape
    devices = list(mesh.devices.flat)
    if len(devices) != R:
        raise RuntimeError(f"the mesh has {len(devices)} devices for R = {R} ranks")
    sharding = NamedSharding(mesh, P("data"))
    out = []
    for m in range(M):
        micro = {}
        for key in ("inputs", "targets"):
            global_rows = np.ascontiguousarray(batch[key][:, m].reshape(R * B, T))
            array = jax.device_put(jnp.asarray(global_rows, dtype=jnp.int32), sharding)
            for shard in array.addressable_shards:
                r = devices.index(shard.device)
                if not np.array_equal(np.asarray(shard.data), batch[key][r, m]):
                    raise RuntimeError(f"device {r} holds other rows of {key} than rank {r}'s")
            micro[key] = array
        out.append(micro)
    return out


def replicated(tree: Any, mesh: Mesh) -> Any:
    """`tree` placed whole on every device of the mesh (data parallelism's params)."""
    return jax.device_put(tree, NamedSharding(mesh, P()))


@functools.cache
def jit_train_step(apply_fn: Callable, tx: optax.MultiSteps) -> Callable:
    """The jitted micro-step: the global microbatch's token mean, its gradient (the sharding
    of the batch makes XLA reduce over the devices), one MultiSteps update."""

    @jax.jit
    def train_step(params: Any, opt_state: Any, micro: Microbatch) -> tuple[Any, Any]:
        def loss_fn(p: Any) -> jax.Array:
            return token_mean_loss(apply_fn(p, micro["inputs"]), micro["targets"])

        grads = jax.grad(loss_fn)(params)
        return tx.update(grads, opt_state, params)

    return train_step


@functools.cache
def shard_map_train_step(apply_fn: Callable, tx: optax.MultiSteps, mesh: Mesh) -> Callable:
    """The jitted micro-step of the shard_map tutorial's data parallelism: each device's
    token mean, pmean over "data", differentiated outside the shard_map."""

    def local_loss(params: Any, micro: Microbatch) -> jax.Array:
        loss = token_mean_loss(apply_fn(params, micro["inputs"]), micro["targets"])
        return jax.lax.pmean(loss, "data")

    loss_dp = jax.shard_map(local_loss, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())

    @jax.jit
    def train_step(params: Any, opt_state: Any, micro: Microbatch) -> tuple[Any, Any]:
        grads = jax.grad(loss_dp)(params, micro)
        return tx.update(grads, opt_state, params)

    return train_step


def run_micro_steps(
    train_step: Callable, params: Any, tx: optax.MultiSteps, batch: Batch, mesh: Mesh
) -> Any:
    """`train_step` once per microbatch, its updates applied after each (zeros until the
    M-th); returns the updates of the M-th micro-step."""
    params = replicated(params, mesh)
    opt_state = replicated(tx.init(params), mesh)
    micros = global_microbatches(batch, mesh)
    for micro in micros:
        updates, opt_state = train_step(params, opt_state, micro)
        params = optax.apply_updates(params, updates)
    if not bool(tx.has_updated(opt_state)):  # the M-th micro-step must have emitted
        raise RuntimeError(f"MultiSteps did not update after {len(micros)} micro-steps")
    return updates


def _jit(
    params: Any,
    apply_fn: Callable,
    batch: Batch,
    mesh: Mesh,
    optimizer: optax.GradientTransformation,
    mean: bool,
) -> Any:
    tx = accumulate(optimizer, batch["inputs"].shape[1], mean)
    return run_micro_steps(jit_train_step(apply_fn, tx), params, tx, batch, mesh)


def _shard_map(
    params: Any,
    apply_fn: Callable,
    batch: Batch,
    mesh: Mesh,
    optimizer: optax.GradientTransformation,
    mean: bool,
) -> Any:
    tx = accumulate(optimizer, batch["inputs"].shape[1], mean)
    return run_micro_steps(shard_map_train_step(apply_fn, tx, mesh), params, tx, batch, mesh)


@nnx.jit
def nnx_train_step(module: nnx.Module, opt: nnx.Optimizer, micro: Microbatch) -> Any:
    """Flax NNX's update loop: value_and_grad of the module's loss, ``optimizer.update``;
    returns the updates it applied."""

    def loss_fn(m: nnx.Module) -> jax.Array:
        return token_mean_loss(m(micro["inputs"]), micro["targets"])

    _, grads = nnx.value_and_grad(loss_fn)(module)
    return opt.update(module, grads)


def _nnx(
    params: Any,
    apply_fn: Callable,
    batch: Batch,
    mesh: Mesh,
    optimizer: optax.GradientTransformation,
    mean: bool,
) -> Any:
    if not (isinstance(apply_fn, functools.partial) and apply_fn.func is apply_graph):
        raise TypeError("the nnx.Optimizer steps need this module's model() (an NNX graphdef)")
    module = nnx.merge(apply_fn.args[0], replicated(params, mesh))
    tx = accumulate(optimizer, batch["inputs"].shape[1], mean)
    opt = nnx.Optimizer(module, tx, wrt=nnx.Param)
    micros = global_microbatches(batch, mesh)
    for micro in micros:
        updates = nnx_train_step(module, opt, micro)
    if not bool(tx.has_updated(nnx.as_pure(opt.opt_state))):
        raise RuntimeError(f"MultiSteps did not update after {len(micros)} micro-steps")
    return updates


def step_jit_mean(
    params: Any,
    apply_fn: Callable,
    batch: Batch,
    mesh: Mesh,
    optimizer: optax.GradientTransformation,
) -> Any:
    """jit + NamedSharding, global-microbatch token mean, MultiSteps(use_grad_mean=True)."""
    return _jit(params, apply_fn, batch, mesh, optimizer, True)


def step_jit_sum(
    params: Any,
    apply_fn: Callable,
    batch: Batch,
    mesh: Mesh,
    optimizer: optax.GradientTransformation,
) -> Any:
    """jit + NamedSharding, global-microbatch token mean, MultiSteps(use_grad_mean=False)."""
    return _jit(params, apply_fn, batch, mesh, optimizer, False)


def step_shard_map_mean(
    params: Any,
    apply_fn: Callable,
    batch: Batch,
    mesh: Mesh,
    optimizer: optax.GradientTransformation,
) -> Any:
    """shard_map, each device's token mean pmean'd, MultiSteps(use_grad_mean=True)."""
    return _shard_map(params, apply_fn, batch, mesh, optimizer, True)


def step_shard_map_sum(
    params: Any,
    apply_fn: Callable,
    batch: Batch,
    mesh: Mesh,
    optimizer: optax.GradientTransformation,
) -> Any:
    """shard_map, each device's token mean pmean'd, MultiSteps(use_grad_mean=False)."""
    return _shard_map(params, apply_fn, batch, mesh, optimizer, False)


def step_nnx_mean(
    params: Any,
    apply_fn: Callable,
    batch: Batch,
    mesh: Mesh,
    optimizer: optax.GradientTransformation,
) -> Any:
    """nnx.Optimizer + MultiSteps(use_grad_mean=True) under nnx.jit, sharded batch."""
    return _nnx(params, apply_fn, batch, mesh, optimizer, True)


def step_nnx_sum(
    params: Any,
    apply_fn: Callable,
    batch: Batch,
    mesh: Mesh,
    optimizer: optax.GradientTransformation,
) -> Any:
    """nnx.Optimizer + MultiSteps(use_grad_mean=False) under nnx.jit, sharded batch."""
    return _nnx(params, apply_fn, batch, mesh, optimizer, False)
