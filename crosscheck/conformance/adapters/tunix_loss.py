"""google-tunix 0.1.7: ``aggregate_loss`` in the ``PeftTrainer`` loop, one verify step per mode.

Every step runs tunix's own training loop for one optimizer update: ``PeftTrainer.train``
(tunix/sft/peft_trainer.py:589-755, the loop the RL ``Trainer`` of tunix/rl/trainer.py
inherits), whose micro-steps are accumulated by the ``optax.MultiSteps`` the trainer wraps
around the optimizer it is given when ``gradient_accumulation_steps`` is set
(peft_trainer.py:212-215: ``optimizer = optax.MultiSteps(optimizer,
training_config.gradient_accumulation_steps)``; the RL cluster sets it to ``mini_batch_size //
train_micro_batch_size``, rl_cluster.py:121-143). One call of the trainer's jitted
``_train_step`` (peft_trainer.py:331-359: ``nnx.value_and_grad(self.loss_fn)``, then
``optimizer.update(model, grads)``) takes one *global* microbatch: the trainer places it on the
mesh with ``sharding_utils.shard_input(train_example, data_sharding_axis)``
(peft_trainer.py:664-667; sharding_utils.py:24-73), so device r holds its rows and the loss is
one GSPMD program over all devices. The loss is tunix's ``aggregate_loss``
(tunix/rl/common.py:533-596), called the way the GRPO loss calls it (tunix/rl/algo_core.py:472-
474: ``common.aggregate_loss(per_token_loss, completion_mask, loss_aggregation_mode)``, no
``norm``), on each target's cross-entropy. The gradient of the GRPO token loss ``-A * ratio``
at ratio 1 (on-policy: ``old_per_token_logps`` is ``stop_gradient(per_token_logps)``,
algo_core.py:403-404) with unit advantages is the gradient of ``-log p``, so the cross-entropy
stands for the policy loss without changing the weighting under test.

The modes (common.py, with the comments and docs that say what each means):

* ``token-mean`` (common.py:554-559): "sum all the token loss, and average by total number of
  completion tokens in the batch"; DAPO's default (tunix/rl/grpo/dapo_learner.py:58).
* ``sequence-mean-token-mean`` (common.py:560-565): each sequence's token mean, summed over
  sequences and divided by ``non_zero_rows``, the rows with a completion token
  (common.py:552); GRPO's default (grpo_learner.py:54-57, 85: "Default:
  `sequence-mean-token-mean`").
* ``sequence-mean-token-scale`` (common.py:566-574): "Scale by maximum response length instead
  of actual response length": each row's token sum over ``per_token_loss.shape[-1]`` (no
  ``norm`` given), averaged over the non-empty rows; Dr. GRPO's default
  (drgrpo_learner.py:35).
* ``seq-mean-token-sum`` (common.py:575-580): "1) sum token losses within each sequence 2)
  average only across sequences that have at least one valid token".
* ``sequence-mean-token-sum-norm`` (common.py:581-588): "Sum the per-sequence sums and
  normalize", by ``norm``, which defaults to ``non_zero_rows``: without ``norm`` (as
  algo_core.py:472 calls it) the same weighting as ``seq-mean-token-sum``.

Every count of the modes is taken over the microbatch one ``_train_step`` sees, and
``MultiSteps`` averages the M micro-step gradients (optax's ``MultiSteps`` keeps the running
mean of the gradients), so for M > 1 each microbatch's mean weighs 1 / M whatever its size:
what the code reading predicts for a scheme whose count belongs to the whole update.

What ``crosscheck verify`` says (packed, ragged; R in 1, 2; M in 1, 2; float32-level): at M = 1
every mode matches its scheme, at R = 2 too (the GSPMD loss counts every device's rows); at
M = 2 every mode whose counts differ between the microbatches fails: one factor per global
microbatch, the same on every rank, named microstep-mean where the intended scheme is
a named one (token_mean, row_mean), and by its family, microbatch-skew, for a spec. Only
``sequence-mean-token-scale`` on packed (every microbatch the same T x rows) passes at M = 2.
Upstream: google/tunix#1744 (open: "Normalizing each microbatch independently biases gradients
when microbatches contain different numbers or fractional weights of valid tokens").

The analytic model's params (or a ``--model``'s) are held as ``nnx.Param`` leaves of a small
``nnx.Module`` (the trainer's ``optimizer = nnx.Optimizer(model, optimizer, wrt=nnx.Param)``,
peft_trainer.py:218-219, needs one); its forward is the ``apply_fn`` verify hands the step.

Deviations: CPU devices of verify's JAX worker instead of TPU; the trainer's mesh is verify's
1-D mesh, its data axis ``"data"`` given as ``data_sharding_axis=("data",)`` (the default is
``("fsdp",)``); no checkpoint directory, no metrics backend; ``gradient_accumulation_steps``
is M, so M = 1 still runs through ``MultiSteps`` with k = 1 (an identity on the gradient); no
gradient clipping (the trainer has none of its own; the optimizer is verify's
``optax.sgd(1.0)``). ``MultiSteps``' accumulator is optax's default, as tunix leaves it, and
``aggregate_loss`` casts the token losses to float32 (common.py:550): float32-level at best.

The step returns the params after the update minus before: the ``optax.sgd(1.0)`` update the
trainer applied. That the trainer's sharding handed device r exactly rank r's rows of each
microbatch is checked with tunix's own ``shard_input`` under the same mesh (raises otherwise).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh
from tunix.rl.common import aggregate_loss
from tunix.sft import peft_trainer, sharding_utils

IGNORE_INDEX = -100
#: verify's mesh axis, the trainer's data sharding axis.
DATA_AXIS = ("data",)

Batch = dict[str, np.ndarray]

# The intended schemes (crosscheck.conformance.settings): ``seq-mean-token-sum`` and
# ``sequence-mean-token-sum-norm`` without ``norm`` are NONEMPTY_ROWS_TOKEN_SUM (every valid
# token weighs 1, over the rows that hold one); ``sequence-mean-token-mean`` is the
# catalogue's ``row_mean``; ``sequence-mean-token-scale`` is ``configured_rows_sum:C`` with C
# = T x the non-empty rows of the fixture (ragged: 24 x 121 = 2904).


class ParamsModule(nnx.Module):
    """The params verify hands the step, as ``nnx.Param`` leaves the trainer can optimize."""

    def __init__(self, params: Any) -> None:
        leaves, self.treedef = jax.tree.flatten(params)
        self.leaves = nnx.List([nnx.Param(jnp.asarray(leaf)) for leaf in leaves])

    def params(self) -> Any:
        return jax.tree.unflatten(self.treedef, [leaf[...] for leaf in self.leaves])


def make_loss_fn(apply_fn: Callable, mode: str) -> Callable[..., jax.Array]:
    """The trainer's ``loss_fn(model, **inputs)``: tunix's ``aggregate_loss`` of the
    microbatch's token cross-entropies. A plain function of positional-or-keyword arguments:
    ``nnx.value_and_grad`` resolves the trainer's keyword inputs to positions."""

    def loss_fn(model: ParamsModule, inputs: jax.Array, targets: jax.Array) -> jax.Array:
        logits = apply_fn(model.params(), inputs)
        valid = targets != IGNORE_INDEX
        per_token_loss = optax.softmax_cross_entropy_with_integer_labels(
            logits, jnp.where(valid, targets, 0)
        )
        # An int mask, as the RL learners' completion_mask is.
        return aggregate_loss(per_token_loss, valid.astype(jnp.int32), mode)

    return loss_fn


def global_microbatches(batch: Batch) -> list[dict[str, np.ndarray]]:
    """The M global microbatches in the trainer's order: rank r's rows at [r B, (r + 1) B)."""
    R, M, B, T = batch["inputs"].shape
    keys = ("inputs", "targets")
    return [{key: batch[key][:, m].reshape(R * B, T) for key in keys} for m in range(M)]


def check_sharding(example: dict[str, np.ndarray], batch: Batch, m: int) -> None:
    """Raise unless tunix's ``shard_input`` gives device r exactly rank r's microbatch m."""
    sharded = sharding_utils.shard_input(example, DATA_AXIS)
    R = batch["inputs"].shape[0]
    for key, array in sharded.items():
        shards = sorted(array.addressable_shards, key=lambda s: s.index[0].start or 0)
        if len(shards) != R:
            raise AssertionError(f"tunix sharded {key} over {len(shards)} devices, not {R}")
        for r, shard in enumerate(shards):
            if not np.array_equal(np.asarray(shard.data), batch[key][r, m]):
                raise AssertionError(f"tunix fed device {r} other rows of {key} at micro-step {m}")


def train_one_update(
    params: Any, apply_fn: Callable, batch: Batch, mesh: Mesh, optimizer: Any, mode: str
) -> Any:
    """``PeftTrainer.train`` on the M global microbatches, GA = M; returns the update."""
    accum_steps = batch["inputs"].shape[1]
    model = ParamsModule(params)
    before = model.params()
    config = peft_trainer.TrainingConfig(
        eval_every_n_steps=10**9,
        max_steps=1,
        gradient_accumulation_steps=accum_steps,
        data_sharding_axis=DATA_AXIS,
        pbar_description=None,
    )
    trainer = peft_trainer.PeftTrainer(model, optimizer, config)
    trainer.with_loss_fn(make_loss_fn(apply_fn, mode))
    examples = global_microbatches(batch)
    with mesh:
        for m, example in enumerate(examples):
            check_sharding(example, batch, m)
        trainer.train(examples)
    if trainer.train_steps != 1:
        raise AssertionError(f"tunix made {trainer.train_steps} updates, not 1")
    after = model.params()
    return jax.tree.map(lambda new, old: np.asarray(new) - np.asarray(old), after, before)


def step_token_mean(
    params: Any, apply_fn: Callable, batch: Batch, mesh: Mesh, optimizer: Any
) -> Any:
    """``loss_agg_mode="token-mean"`` (DAPO's default)."""
    return train_one_update(params, apply_fn, batch, mesh, optimizer, "token-mean")


def step_sequence_mean_token_mean(
    params: Any, apply_fn: Callable, batch: Batch, mesh: Mesh, optimizer: Any
) -> Any:
    """``loss_agg_mode="sequence-mean-token-mean"`` (GRPO's default)."""
    return train_one_update(params, apply_fn, batch, mesh, optimizer, "sequence-mean-token-mean")


def step_sequence_mean_token_scale(
    params: Any, apply_fn: Callable, batch: Batch, mesh: Mesh, optimizer: Any
) -> Any:
    """``loss_agg_mode="sequence-mean-token-scale"`` (Dr. GRPO's default), no ``norm``."""
    return train_one_update(params, apply_fn, batch, mesh, optimizer, "sequence-mean-token-scale")


def step_seq_mean_token_sum(
    params: Any, apply_fn: Callable, batch: Batch, mesh: Mesh, optimizer: Any
) -> Any:
    """``loss_agg_mode="seq-mean-token-sum"``."""
    return train_one_update(params, apply_fn, batch, mesh, optimizer, "seq-mean-token-sum")


def step_sequence_mean_token_sum_norm(
    params: Any, apply_fn: Callable, batch: Batch, mesh: Mesh, optimizer: Any
) -> Any:
    """``loss_agg_mode="sequence-mean-token-sum-norm"``, no ``norm`` (the non-empty rows)."""
    return train_one_update(
        params, apply_fn, batch, mesh, optimizer, "sequence-mean-token-sum-norm"
    )
