"""JAX/Flax reference implementation of the normalization contract.

Per-scheme losses (`microbatch_loss`: each microbatch's sum of a_t l_t and its denominator
contribution d), the update step under pmap, shard_map, global-view jit and multi-process
jax.distributed with the precount and postnorm strategies, and a token-weighted accumulation
transformation for optax. Params may be float64 (under ``jax_enable_x64``), float32 or
bfloat16; counts, d, D, the loss sums and g / D never take the params' dtype
(`jax_impl.denominators`: int32 counts, float64 under x64 else float32 for the rest).
Contract v2's scheme specs (docs/schemes-as-data.md): `parse_spec`, `lay_out_spec_batch`
and `spec_step_config` (`jax_impl.spec`, `spec_batch`, `spec_counts`, `spec_step`).
Independent of `crosscheck` on purpose: the harness imports this package, never the reverse.
"""

from jax_impl.accidental import microbatch_mean_gradients, rank_mean_gradients
from jax_impl.accumulate import Collective, RankGradients, Strategy, rank_gradients, reduce_factor
from jax_impl.batch import lay_out_global_batch, rank_slice, validate_global_batch
from jax_impl.denominators import denominator_dtype
from jax_impl.devices import require_devices
from jax_impl.global_step import make_global_gradients, make_global_sweep, make_global_update
from jax_impl.losses import (
    Microbatch,
    MicrobatchLoss,
    local_mean_loss,
    microbatch_loss,
    token_losses,
)
from jax_impl.model import BilinearLM, params_from_numpy
from jax_impl.pmap_step import make_pmap_gradients, make_pmap_sweep, make_pmap_update
from jax_impl.schemes import IGNORE_INDEX, Scheme, scheme_terms
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
from jax_impl.spec_batch import SpecBatch, lay_out_spec_batch
from jax_impl.spec_step import SpecGradients, spec_step_config
from jax_impl.token_weighted import TokenWeightedState, token_weighted_accumulation
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
    "BilinearLM",
    "Collective",
    "Microbatch",
    "MicrobatchLoss",
    "RankGradients",
    "ReducedGradients",
    "Scheme",
    "SchemeSpec",
    "SpecBatch",
    "SpecGradients",
    "StepConfig",
    "Strategy",
    "TokenWeightedState",
    "UpdateMetrics",
    "UpdateResult",
    "apply_clipped_update",
    "apply_optimizer",
    "data_mesh",
    "denominator_dtype",
    "init_opt_state",
    "lay_out_global_batch",
    "lay_out_spec_batch",
    "local_mean_loss",
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
    "microbatch_mean_gradients",
    "named_spec",
    "params_from_numpy",
    "parse_spec",
    "rank_gradients",
    "rank_mean_gradients",
    "rank_slice",
    "reduce_factor",
    "replicate",
    "require_devices",
    "scheme_terms",
    "shard_batch",
    "spec_step_config",
    "token_losses",
    "token_weighted_accumulation",
    "validate_global_batch",
]
