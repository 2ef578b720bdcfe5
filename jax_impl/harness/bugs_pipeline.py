r"""The pipeline step of the bug catalogue in JAX: a count that stays on the last stage.

``pp-unsent-count`` is postnorm through the two-stage pipeline of
`jax_impl.pipeline` with ``count_to_first_stage=False``: the last stage divides its gradient by
D after the backward, stage 0 is never told D and keeps :math:`\sum_t v_t \nabla l_t`, D times
its intended gradient (torchtitan#4194's shape; torchtitan#2972). The torch loop is
``torch_impl.harness.bugs_windows.pp_unsent_count``, written apart.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from jax_impl.batch import lay_out_global_batch
from jax_impl.harness.bugs_sweep import BugResult
from jax_impl.model import params_from_numpy
from jax_impl.pipeline import make_pipeline_sweep, pipeline_config, pipeline_mesh

#: Pattern id (crosscheck.diagnosis.patterns.PATTERNS) -> its update through the pipeline.
PIPELINE_BUG_CONFIGS = {
    # BUG: postnorm whose count never leaves the last stage.
    "pp-unsent-count": pipeline_config("token_mean", "postnorm", count_to_first_stage=False),
}


def run_pipeline_bug_step(
    pattern: str,
    batch: Mapping[str, np.ndarray],
    params: Mapping[str, np.ndarray],
    world_size: int,
    accum_steps: int,
    *,
    num_windows: int = 2,
) -> BugResult:
    """One pipeline pattern on a global batch laid out over R data ranks of 2 stages and M
    microbatches, `num_windows` windows on the same params (no state: every window is the
    same); the whole gradient (each stage's part) and D as the last stage logs it."""
    if pattern not in PIPELINE_BUG_CONFIGS:
        raise ValueError(
            f"unknown pipeline bug pattern {pattern!r}; known: {', '.join(PIPELINE_BUG_CONFIGS)}"
        )
    laid_out = lay_out_global_batch(
        batch, world_size, accum_steps, vocab_size=int(np.shape(params["embed"])[0])
    )
    sweep = make_pipeline_sweep([PIPELINE_BUG_CONFIGS[pattern]], pipeline_mesh(world_size))
    for _ in range(num_windows):
        (out,) = sweep(params_from_numpy(params, "float64"), laid_out)
    grads = {leaf: np.asarray(out[leaf], dtype=np.float64) for leaf in ("embed", "unembed")}
    return BugResult(grads, float(np.asarray(out["denominators"])[0, 1]))
