"""Runner of tests/test_transformer_jax.py's float64 checks (jax_enable_x64 is global: own process).

``python tests/transformer_jax_runner.py --out DIR`` writes

* ``DIR/records.json``: one record per compared case, ``{"fixture", "scheme", "R", "M",
  "strategy", "err", "leaf"}``, err being ``tree_rel_err`` (max |a - b| / max |b|, worst
  parameter) of the distributed update's gradient against the single-process gradient of the
  intended objective; inf when a gradient holds NaN or inf;
* ``DIR/single_process.npz``: the single-process gradient of token_mean on ``packed``, for the
  test to compare with torch's.

The distributed updates are the project's own steps under ``shard_map`` on a mesh of R fake
CPU devices, given the transformer's per-token losses (``StepConfig(token_losses_fn=...)``,
which ``jax_impl.accumulate.rank_gradients`` runs): one sweep per layout holds token_mean
and sequence_mean in both strategies (one compiled program for the four), another the group
mean on ``rollouts``. The single-process reference is ``jax.grad`` of sum_t c_t l_t over the
whole global batch, with c_t = a_t / D from the numpy oracle's scheme objects.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402  (x64 must be on before any array exists)
import numpy as np  # noqa: E402
import optax  # noqa: E402
from transformer_reference import intended_weights  # noqa: E402

from crosscheck import builtin_fixture  # noqa: E402
from crosscheck.judge.compare import tree_rel_err  # noqa: E402
from jax_impl import transformer  # noqa: E402
from jax_impl.accumulate import Collective, Strategy  # noqa: E402
from jax_impl.batch import lay_out_global_batch  # noqa: E402
from jax_impl.context_parallel import (  # noqa: E402
    context_mesh,
    lay_out_context_parallel,
    make_context_parallel_sweep,
)
from jax_impl.shard_map_step import data_mesh, make_shard_map_sweep  # noqa: E402
from jax_impl.update import StepConfig  # noqa: E402

LAYOUTS = [(R, M) for R in (1, 2, 4) for M in (1, 2)]
#: (R, M, C, order) of the context-parallel updates: both orders, DP and accumulation beside.
CONTEXT_LAYOUTS = [(1, 2, 2, "zigzag"), (2, 1, 2, "contiguous")]
#: (strategy, gradient collective): precount with pmean (s = R: the scale a psum would not
#: need, so both the count and the factor are exercised) and postnorm (one psum of gradient
#: sums and counts, then / D). Precount with psum is the same program with s = 1; compiling
#: it too would cost a third more and check no other reduction.
VARIANTS = (
    (Strategy.PRECOUNT, Collective.PMEAN),
    (Strategy.POSTNORM, Collective.PSUM),
)
V1_CASES = (("packed", "token_mean"), ("packed", "sequence_mean"))
GROUP_CASE = ("rollouts", "group_token_mean")
TOKEN_KEYS = ("inputs", "targets", "segment_ids", "weights")
ROW_FIELDS = ("group_ids", "document_ids", "row_weights", "sample_mask")


@jax.jit
def single_process_gradient(params, inputs, targets, segment_ids, c):
    """grad of sum_t c_t l_t over the whole [N, T] batch in one process: the objective."""

    def objective(p):
        return jnp.sum(c * transformer.token_losses(p, inputs, targets, segment_ids))

    return jax.grad(objective)(params)


def reference(fixture_name: str, scheme: str, params) -> dict[str, np.ndarray]:
    fixture = builtin_fixture(fixture_name)
    grads = single_process_gradient(
        params,
        fixture.inputs,
        fixture.targets,
        fixture.segment_ids,
        intended_weights(fixture_name, scheme),
    )
    return transformer.numpy_params(grads)


def record(fixture: str, scheme: str, R: int, M: int, variant, grads, want, C: int = 1) -> dict:
    got = transformer.numpy_params(grads)
    worst = tree_rel_err(got, want)
    finite = all(np.isfinite(v).all() for v in got.values())
    strategy, collective = variant
    return {
        "fixture": fixture,
        "scheme": scheme,
        "R": R,
        "M": M,
        "C": C,
        "strategy": f"{strategy.value}-{collective.value}",
        "err": worst.max_rel_err if finite else float("inf"),
        "leaf": worst.leaf,
    }


def step_configs(scheme: str, token_losses_fn=transformer.token_losses) -> list[StepConfig]:
    """`scheme` in every variant, on the transformer's per-token losses."""
    return [
        StepConfig(
            optimizer=optax.sgd(0.1),
            scheme=scheme,
            strategy=strategy,
            collective=collective,
            token_losses_fn=token_losses_fn,
        )
        for strategy, collective in VARIANTS
    ]


def run(out: Path) -> None:
    params = transformer.initial_params(jnp.float64)
    references = {case: reference(*case, params) for case in (*V1_CASES, GROUP_CASE)}
    np.savez(out / "single_process.npz", **references[("packed", "token_mean")])
    v1_configs = [config for _, scheme in V1_CASES for config in step_configs(scheme)]
    group_configs = step_configs(GROUP_CASE[1])
    packed, rollouts = builtin_fixture("packed"), builtin_fixture("rollouts")
    vocab = transformer.TRANSFORMER_CONFIG.vocab
    records = []
    for R, M in LAYOUTS:
        mesh = data_mesh(R)
        batch = lay_out_global_batch(
            {k: getattr(packed, k) for k in TOKEN_KEYS}, R, M, vocab_size=vocab
        )
        outs = iter(make_shard_map_sweep(v1_configs, mesh)([params] * len(v1_configs), batch))
        for fixture, scheme in V1_CASES:
            want = references[(fixture, scheme)]
            records += [record(fixture, scheme, R, M, v, next(outs).grads, want) for v in VARIANTS]
        group_batch = lay_out_global_batch(
            {k: getattr(rollouts, k) for k in (*TOKEN_KEYS, *ROW_FIELDS)}, R, M, vocab_size=vocab
        )
        sweep = make_shard_map_sweep(group_configs, mesh)
        outs = sweep([params] * len(group_configs), group_batch)
        want = references[GROUP_CASE]
        records += [
            record(*GROUP_CASE, R, M, v, o.grads, want) for v, o in zip(VARIANTS, outs, strict=True)
        ]
    # Context parallel: every row split over C ranks of a ("data", "context") mesh, attention
    # across the shards (keys and values gathered over the context axis).
    for R, M, C, order in CONTEXT_LAYOUTS:
        losses = transformer.context_parallel_token_losses(order)
        mesh = context_mesh(R, C)
        for fixture, schemes, keys in (
            (packed, [s for _, s in V1_CASES], TOKEN_KEYS),
            (rollouts, [GROUP_CASE[1]], (*TOKEN_KEYS, *ROW_FIELDS)),
        ):
            configs = [config for scheme in schemes for config in step_configs(scheme, losses)]
            arrays = {k: getattr(fixture, k) for k in keys}
            batch = lay_out_context_parallel(arrays, R, M, C, order, vocab_size=vocab)
            outs = iter(make_context_parallel_sweep(configs, mesh)([params] * len(configs), batch))
            for scheme in schemes:
                want = references[(fixture.name, scheme)]
                records += [
                    record(fixture.name, scheme, R, M, v, next(outs).grads, want, C)
                    for v in VARIANTS
                ]
    (out / "records.json").write_text(json.dumps(records, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    run(parser.parse_args().out)


if __name__ == "__main__":
    main()
