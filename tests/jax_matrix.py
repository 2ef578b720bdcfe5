"""The JAX test matrix: every intended scheme x front-end x layout x strategy x dtype.

For each built-in fixture and every layout (R, M) its rows allow, two consecutive AdamW updates
(and SGD for token_mean) run from the fixture's params; each update's reduced gradient, loss,
denominator, per-rank metrics and gradient norms, and the params after it, are compared with
`crosscheck.contract.optimizers.train` (clip_convention="optax").

The in-process front-ends (pmap, shard_map, jit) run in one runner process per dtype, the two
concurrently: `python tests/jax_matrix.py --dtype D --oracle O --out R.json` (float64 needs
jax_enable_x64, which is global). Compilation dominates the run, so each front-end is built
once per world size as a sweep of every (scheme, strategy) side by side (one program per
batch shape), and the runner processes compile with cheaper code generation
(RUNNER_XLA_FLAGS): these programs are tiny and compiling them is most of the run; neither
flag changes the HLO optimization passes or floating-point semantics (no fast-math). The oracle
is computed once by the parent and shared as a pickle. Multi-process workers
(jax_impl.harness.multiprocess) return raw arrays, compared here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pickle
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
from child_env import ROOT, jax_env

import jax_impl
from crosscheck import (
    BUILTIN_FIXTURES,
    FLOAT32_RTOL,
    FLOAT64_RTOL,
    INTENDED_SCHEMES,
    AdamWConfig,
    SGDConfig,
    builtin_fixture,
    train,
    tree_rel_err,
)
from crosscheck.contract.optimizers import UpdateRecord
from crosscheck.judge.compare import leaf_rel_err
from crosscheck.launch.worker_processes import run_workers
from crosscheck.launch.workers import SMALL_PROGRAM_XLA_FLAGS
from crosscheck.run.jax_worker import placed_sweep

RTOL = {
    "float32": FLOAT32_RTOL,
    "float64": FLOAT64_RTOL,
}  # why these sizes: crosscheck.judge.compare
VARIANTS: dict[str, tuple[tuple[str, str], ...]] = {
    "pmap": (("precount", "psum"), ("precount", "pmean"), ("postnorm", "psum")),
    "shard_map": (("precount", "psum"), ("precount", "pmean"), ("postnorm", "psum")),
    # Global-view jit has no collective to choose, hence no reduction factor to vary.
    "jit": (("precount", "psum"), ("postnorm", "psum")),
    "multiprocess": (("precount", "psum"), ("precount", "pmean"), ("postnorm", "psum")),
}
WORLD_SIZES = {"pmap": (1, 2, 4, 8), "shard_map": (1, 2, 4, 8), "jit": (1, 2, 4, 8)}
PROCESS_COUNTS = (2, 4)
ACCUM_STEPS = (1, 2, 4)
DTYPES = ("float32", "float64")
NUM_UPDATES = 2
ADAMW = AdamWConfig()
SGD = SGDConfig()
# Between the gradient norms of the mean schemes (~0.1-0.5) and those of sum and constant on
# the larger fixtures (~1-100), so both branches of optax's clip run in every front-end.
MAX_GRAD_NORM = 1.0
SGD_FIXTURE = "packed"
# Compile-time flags of the runner processes (see the module docstring).
RUNNER_XLA_FLAGS = f"--xla_force_host_platform_device_count=8 {SMALL_PROGRAM_XLA_FLAGS}"

OracleKey = tuple[str, str, int, int, str]  # fixture, scheme, R, M, optimizer
OracleTable = Mapping[OracleKey, tuple[UpdateRecord, ...]]


def layouts(world_sizes: Sequence[int]) -> Iterator[tuple[str, int, int]]:
    """(fixture, R, M) for every built-in fixture and every layout its row count allows."""
    for name in BUILTIN_FIXTURES:
        num_rows = builtin_fixture(name).num_rows
        for world_size in world_sizes:
            for accum_steps in ACCUM_STEPS:
                if num_rows % (world_size * accum_steps) == 0:
                    yield name, world_size, accum_steps


def sizes_of(front_end: str) -> tuple[int, ...]:
    return PROCESS_COUNTS if front_end == "multiprocess" else WORLD_SIZES[front_end]


def runs_on(fixture: str, front_end: str) -> list[tuple[str, str]]:
    """(scheme, optimizer) pairs run on every layout of `fixture`.

    Every intended scheme with AdamW; SGD (token_mean) on the packed fixture's layouts, which
    cover every world size: the optimizer step does not depend on the scheme or the batch.
    """
    runs = [(scheme, "adamw") for scheme in INTENDED_SCHEMES]
    if fixture == SGD_FIXTURE and front_end != "multiprocess":
        runs.append(("token_mean", "sgd"))
    return runs


def oracle_keys(front_end: str) -> list[OracleKey]:
    """Every oracle run a front-end's matrix compares with."""
    return [
        (name, scheme, R, M, optimizer)
        for name, R, M in layouts(sizes_of(front_end))
        for scheme, optimizer in runs_on(name, front_end)
    ]


def expected_cases(front_end: str) -> int:
    """Records a front-end's matrix must produce per dtype (a shortfall is a failure)."""
    return len(oracle_keys(front_end)) * len(VARIANTS[front_end])


@cache
def oracle(fixture: str, scheme: str, R: int, M: int, optimizer: str) -> tuple[UpdateRecord, ...]:
    """The oracle's consecutive updates (cached: every front-end and strategy shares them)."""
    return tuple(
        train(
            builtin_fixture(fixture),
            scheme,
            R,
            M,
            num_updates=NUM_UPDATES,
            optimizer=ADAMW if optimizer == "adamw" else SGD,
            max_grad_norm=MAX_GRAD_NORM,
            clip_convention="optax",
        )
    )


def write_oracle(keys: Sequence[OracleKey], path: Path) -> Path:
    path.write_bytes(pickle.dumps({key: oracle(*key) for key in keys}))
    return path


def _scalar_err(actual: Any, expected: Any) -> float:
    return leaf_rel_err(np.asarray(actual, dtype=np.float64), np.asarray(expected, np.float64))[0]


def compare_update(got: Mapping[str, Any], want: UpdateRecord) -> dict[str, float]:
    """Relative error of every quantity of one update (inf on NaN: NaN never passes).

    `got` holds numpy values: grads and params (trees), rank_valid_tokens and rank_loss_sums
    (all ranks, or only the ranks listed in got["ranks"]), global_denominator, loss,
    grad_norm, clipped_grad_norm.
    """
    result = want.result
    ranks = got.get("ranks", slice(None))
    counts_equal = np.array_equal(got["rank_valid_tokens"], result.rank_valid_tokens[ranks])
    return {
        "grads": tree_rel_err(got["grads"], result.grads).max_rel_err,
        "params": tree_rel_err(got["params"], want.params).max_rel_err,
        "loss": _scalar_err(got["loss"], result.loss),
        "global_denominator": _scalar_err(got["global_denominator"], result.denominator),
        "grad_norm": _scalar_err(got["grad_norm"], want.grad_norm),
        "clipped_grad_norm": _scalar_err(got["clipped_grad_norm"], want.clipped_grad_norm),
        "rank_loss_sums": _scalar_err(got["rank_loss_sums"], result.rank_loss_sums[ranks]),
        # Counts are integers: exact or wrong.
        "rank_valid_tokens": 0.0 if counts_equal else float("inf"),
    }


def verdict(case: dict[str, Any], history: Sequence[Mapping], want: Sequence[UpdateRecord]):
    """A case's record: the worst error per quantity over its updates, and what failed."""
    rtol = RTOL[case["dtype"]]
    updates = [compare_update(got, w) for got, w in zip(history, want, strict=True)]
    worst = {key: max(u[key] for u in updates) for key in updates[0]}
    failed = sorted(key for key, err in worst.items() if not err <= rtol)
    return {**case, "max_rel_err": max(worst.values()), "errors": worst, "failed": failed}


def failures(records: Sequence[Mapping]) -> list[str]:
    """One line per failing case: what it was and which quantities missed by how much."""
    lines = []
    for r in records:
        if r["failed"]:
            what = ", ".join(f"{key} {r['errors'][key]:.2e}" for key in r["failed"])
            lines.append(
                f"{r['front_end']} {r['dtype']} {r['fixture']}/{r['scheme']} {r['strategy']} "
                f"{r['optimizer']} R={r['world_size']} M={r['accum_steps']}: {what}"
            )
    return lines


def to_numpy(out: jax_impl.UpdateResult) -> dict[str, Any]:
    """An UpdateResult (already fetched to host) as a dict of numpy values."""
    return {
        "grads": {k: np.asarray(v) for k, v in out.grads.items()},
        "params": {k: np.asarray(v) for k, v in out.params.items()},
        **{k: np.asarray(v) for k, v in out.metrics._asdict().items()},
    }


def build_sweep(front_end: str, configs: list, world_size: int) -> tuple[Callable, Callable]:
    """The front-end's sweep of `configs`, and how to place (batch, params) for it once: the
    matrix worker's own (`crosscheck.run.jax_worker.placed_sweep`)."""
    return placed_sweep(f"jax-{front_end}", configs, world_size)


def run_updates(
    sweep: Callable, configs: Sequence[jax_impl.StepConfig], params0: Any, batch: Any
) -> list[list[dict[str, Any]]]:
    """NUM_UPDATES consecutive updates per sweep config, every config from `params0`.

    `configs[v]` supplies config v's optimizer step (its gradient is the sweep's v-th, of the
    scheme and strategy the sweep was built with); all share one optimizer object. Returns,
    per config, one numpy record per update.
    """
    import jax

    params = [params0] * len(configs)
    states = [jax_impl.init_opt_state(configs[0].optimizer, params0)] * len(configs)
    outs: list[list[jax_impl.UpdateResult]] = [[] for _ in configs]
    for _ in range(NUM_UPDATES):
        reduced = sweep(params, batch)
        for v, config in enumerate(configs):
            out = jax_impl.apply_optimizer(reduced[v], params[v], states[v], config)
            params[v], states[v] = out.params, out.opt_state
            outs[v].append(out)
    # Read back only after every update was dispatched (no host sync between updates), in one
    # batched transfer.
    return [[to_numpy(out) for out in variant] for variant in jax.device_get(outs)]


def adamw() -> Any:
    import optax

    return optax.adamw(
        ADAMW.learning_rate,
        b1=ADAMW.b1,
        b2=ADAMW.b2,
        eps=ADAMW.eps,
        weight_decay=ADAMW.weight_decay,
    )


def run_in_process(front_end: str, dtype: str, table: OracleTable | None = None) -> list[dict]:
    """Every case of one in-process front-end at one dtype; one record per case."""
    import optax

    lookup = (lambda key: table[key]) if table is not None else (lambda key: oracle(*key))
    keys = [(scheme, s, c) for scheme in INTENDED_SCHEMES for s, c in VARIANTS[front_end]]
    configs = [
        jax_impl.StepConfig(
            optimizer=optimizer,
            scheme=scheme,
            strategy=s,
            collective=c,
            max_grad_norm=MAX_GRAD_NORM,
        )
        for optimizer in [adamw()]  # one object: its program compiles once per placement
        for scheme, s, c in keys
    ]
    sgd = optax.sgd(SGD.learning_rate)
    # SGD reuses the compiled gradient sweep; only the optimizer program differs.
    by_optimizer = {
        "adamw": configs,
        "sgd": [dataclasses.replace(config, optimizer=sgd) for config in configs],
    }
    # One id space for every fixture (static in the program): fixtures of one shape then
    # share the compiled program of each layout, whatever their own group and document ids.
    fixtures = [builtin_fixture(name) for name in BUILTIN_FIXTURES]
    id_space = {
        "num_groups": max(f.num_rows for f in fixtures),
        "num_documents": max(int(jax_impl.default_document_ids(f.segment_ids).max()) + 1
                             for f in fixtures),
    }  # fmt: skip
    records = []
    for world_size in WORLD_SIZES[front_end]:
        sweep, place = build_sweep(front_end, configs, world_size)
        for name, R, M in layouts([world_size]):
            fixture = builtin_fixture(name)
            arrays = {
                k: getattr(fixture, k) for k in ("inputs", "targets", "segment_ids", "weights")
            }
            batch, params0 = place(
                jax_impl.lay_out_global_batch(
                    arrays,
                    R,
                    M,
                    vocab_size=fixture.vocab_size,
                    weights_dtype=dtype,
                    **id_space,
                ),
                jax_impl.params_from_numpy(fixture.params(), dtype),
            )
            runs = runs_on(name, front_end)
            histories = {
                optimizer: run_updates(sweep, by_optimizer[optimizer], params0, batch)
                for optimizer in sorted({optimizer for _, optimizer in runs})
            }
            for scheme, optimizer in runs:
                want = lookup((name, scheme, R, M, optimizer))
                for strategy, collective in VARIANTS[front_end]:
                    history = histories[optimizer][keys.index((scheme, strategy, collective))]
                    case = {
                        "front_end": front_end,
                        "dtype": dtype,
                        "fixture": name,
                        "scheme": scheme,
                        "strategy": f"{strategy}-{collective}",
                        "optimizer": optimizer,
                        "world_size": R,
                        "accum_steps": M,
                    }
                    records.append(verdict(case, history, want))
    return records


def run_front_ends(
    front_ends: Sequence[str], work_dir: Path, oracle_path: Path, timeout_s: float
) -> dict[str, list[dict]]:
    """Every in-process front-end at both dtypes: one runner process per dtype, concurrently.

    One process runs all front-ends of its dtype, so pmap and shard_map share the traces of
    their common per-rank pieces and the start-up cost is paid once. Returns {dtype: records};
    a runner that fails or outlives `timeout_s` raises
    crosscheck.launch.worker_processes.LaunchError after every runner has been stopped.
    """
    commands = [
        [sys.executable, __file__, "--front-ends", ",".join(front_ends), "--dtype", dtype,
         "--oracle", str(oracle_path), "--out", str(work_dir / f"{dtype}.json")]
        for dtype in DTYPES
    ]  # fmt: skip
    run_workers(
        commands, timeout_s=timeout_s, log_dir=work_dir, env=jax_env(RUNNER_XLA_FLAGS), cwd=ROOT
    )
    return {dtype: json.loads((work_dir / f"{dtype}.json").read_text()) for dtype in DTYPES}


def smallest_multiprocess_spec(directory: Path, **extra: object) -> dict:
    """The smallest job of jax.distributed processes (jax_impl.harness.multiprocess): one SGD
    update of `packed` (saved under `directory`), token_mean, precount with psum, float32,
    M = 1; `extra` adds or replaces keys."""
    fixture = builtin_fixture("packed").save(directory / "packed.npz")
    return {
        "optimizer": {"name": "sgd", "learning_rate": 0.1},
        "num_updates": 1,
        "variants": [["precount", "psum"]],
        "schemes": ["token_mean"],
        "dtypes": ["float32"],
        "cases": [{"fixture": str(fixture), "accum_steps": 1}],
        **extra,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Runner entry point: some front-ends at one dtype, records written as JSON."""
    parser = argparse.ArgumentParser(description="front-ends x one dtype of the JAX matrix")
    parser.add_argument("--front-ends", default=",".join(WORLD_SIZES), help="comma-separated")
    parser.add_argument("--dtype", choices=DTYPES, required=True)
    parser.add_argument("--oracle", type=Path, help="pickled oracle table (default: compute)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    front_ends = args.front_ends.split(",")
    unknown = sorted(set(front_ends) - set(WORLD_SIZES))
    if unknown:
        parser.error(f"unknown front-ends {unknown}; known: {sorted(WORLD_SIZES)}")
    import jax

    jax.config.update("jax_enable_x64", args.dtype == "float64")
    # Fail, never skip, when the devices are missing.
    jax_impl.require_devices(max(max(WORLD_SIZES[f]) for f in front_ends))
    table = pickle.loads(args.oracle.read_bytes()) if args.oracle else None
    records = [r for f in front_ends for r in run_in_process(f, args.dtype, table)]
    args.out.write_text(json.dumps(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
