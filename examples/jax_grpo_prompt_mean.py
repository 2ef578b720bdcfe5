r"""A GRPO-style prompt-group mean in JAX's global view, counted over the update or per
microbatch (the torch twin, with the math, is ``examples/torch_grpo_prompt_mean.py``).

``step`` sees the whole update as [R, M, B, T] arrays, so the group counts are one
``segment_sum`` over every row: n_g is the group's count over all ranks and microbatches, G
the number of non-empty groups, and ``jax.grad`` of
:math:`\frac{1}{G}\sum_t v_t l_t / n_{g(t)}` is the update (jit places the sums; no collective
to get wrong). ``crosscheck verify examples.jax_grpo_prompt_mean:step --framework jax
--scheme group_token_mean`` passes it.

``step_microbatch_count`` counts each group inside its microbatch, as a loop over
accumulation steps that computes the group mean per step does; verify names it
``local-group-count``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from examples._jax_common import Batch, token_losses


def _loss(params: Any, apply_fn: Callable, batch: dict[str, jax.Array], local: bool) -> jax.Array:
    losses, mask = token_losses(params, apply_fn, batch)  # [R, M, B, T]
    groups = batch["group_ids"]  # [R, M, B]
    size = int(groups.max()) + 1
    row_counts = mask.sum(axis=-1)  # [R, M, B]
    total = jax.ops.segment_sum(row_counts.ravel(), groups.ravel(), size)
    num_groups = jnp.sum(total > 0)
    if local:  # one count vector per (rank, microbatch): [R, M, size]
        per_mb = jax.vmap(jax.vmap(lambda c, g: jax.ops.segment_sum(c, g, size)))
        counts = per_mb(row_counts, groups)
        n = jnp.take_along_axis(counts, groups, axis=-1)
    else:
        n = total[groups]
    weights = mask / jnp.maximum(n, 1)[..., None]
    return jnp.sum(weights * losses) / num_groups


def step(params: Any, apply_fn: Callable, batch: Batch, mesh: Mesh) -> Any:
    """The group mean with every group's count over the whole update (correct)."""
    arrays = {k: jnp.asarray(v) for k, v in batch.items()}
    return jax.grad(_loss)(params, apply_fn, arrays, False)


def step_microbatch_count(params: Any, apply_fn: Callable, batch: Batch, mesh: Mesh) -> Any:
    """Each group counted inside its microbatch (the local-group-count bug)."""
    arrays = {k: jnp.asarray(v) for k, v in batch.items()}
    return jax.grad(_loss)(params, apply_fn, arrays, True)
