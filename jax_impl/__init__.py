"""JAX/Flax reference implementation of the normalization contract.

One normalization type: a scheme spec (docs/schemes-as-data.md; `parse_spec`, `named_spec`),
the v1 names (token_mean, ..., the accidental rank_mean and microbatch_mean) among its
catalogue entries. A `StepConfig` carries the spec, the strategy (precount or postnorm) and
the collective; the update step runs under pmap, shard_map, global-view jit and
multi-process jax.distributed, on a laid-out `Batch` (`lay_out_global_batch`). A
token-weighted accumulation transformation for optax takes each micro-step's
`microbatch_loss`. Params may be float64 (under ``jax_enable_x64``), float32 or bfloat16;
counts, d, D, the loss sums and g / D never take the params' dtype (`jax_impl.denominators`:
int32 counts, float64 under x64 else float32 for the rest). Independent of `crosscheck` on
purpose: the harness imports this package, never the reverse.
"""

from jax_impl.accumulate import Collective, RankGradients, Strategy, rank_gradients, reduce_factor
from jax_impl.batch import (
    IGNORE_INDEX,
    Batch,
    default_document_ids,
    lay_out_global_batch,
    rank_slice,
    validate_global_batch,
)
from jax_impl.context_parallel import (
    context_mesh,
    lay_out_context_parallel,
    make_context_parallel_gradients,
    make_context_parallel_sweep,
)
from jax_impl.denominators import denominator_dtype
from jax_impl.devices import require_devices
from jax_impl.global_step import make_global_gradients, make_global_sweep, make_global_update
from jax_impl.losses import local_mean_loss, token_losses
from jax_impl.model import BilinearLM, params_from_numpy
from jax_impl.pmap_step import make_pmap_gradients, make_pmap_sweep, make_pmap_update
from jax_impl.shard_map_step import (
    data_mesh,
    init_opt_state,
    make_shard_map_gradients,
    make_shard_map_sweep,
    make_shard_map_update,
    replicate,
    shard_batch,
)
from jax_impl.spec import SchemeSpec, named_spec, parse_spec
from jax_impl.token_weighted import (
    MicrobatchLoss,
    TokenWeightedState,
    microbatch_loss,
    token_weighted_accumulation,
)
from jax_impl.update import (
    ReducedGradients,
    StepConfig,
    UpdateMetrics,
    UpdateResult,
    apply_clipped_update,
    apply_optimizer,
)

__all__ = [
    "IGNORE_INDEX",
    "Batch",
    "BilinearLM",
    "Collective",
    "MicrobatchLoss",
    "RankGradients",
    "ReducedGradients",
    "SchemeSpec",
    "StepConfig",
    "Strategy",
    "TokenWeightedState",
    "UpdateMetrics",
    "UpdateResult",
    "apply_clipped_update",
    "apply_optimizer",
    "context_mesh",
    "data_mesh",
    "default_document_ids",
    "denominator_dtype",
    "init_opt_state",
    "lay_out_context_parallel",
    "lay_out_global_batch",
    "local_mean_loss",
    "make_context_parallel_gradients",
    "make_context_parallel_sweep",
    "make_global_gradients",
    "make_global_sweep",
    "make_global_update",
    "make_pmap_gradients",
    "make_pmap_sweep",
    "make_pmap_update",
    "make_shard_map_gradients",
    "make_shard_map_sweep",
    "make_shard_map_update",
    "microbatch_loss",
    "named_spec",
    "params_from_numpy",
    "parse_spec",
    "rank_gradients",
    "rank_slice",
    "reduce_factor",
    "replicate",
    "require_devices",
    "shard_batch",
    "token_losses",
    "token_weighted_accumulation",
    "validate_global_batch",
]
