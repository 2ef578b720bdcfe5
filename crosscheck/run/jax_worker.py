"""The JAX side of a harness run, in its own process: ``python -m crosscheck.run.jax_worker``.

x64 is global in JAX and the fake-device count is fixed at import, so the in-process front-ends
(pmap, shard_map, global jit) run here, one process per dtype, with eight CPU devices: x64 on
for float64, off for float32 and bfloat16. The dtype is the params'; the soft weights are laid
out in the denominator dtype (float64 under x64, else float32), never in bfloat16
(`jax_impl.denominators`). Each
front-end, world size and dtype builds one sweep per set of (scheme spec, strategy) its
fixtures run (v1's eight names on v1's fixtures, the trainer modes on v2's), a single compiled
program per batch shape computing those configs side by side; every fixture and layout of that
world size goes through its set's sweep. Output is plain numpy, pickled, judged by the parent.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable, Sequence

import numpy as np

from crosscheck.contract.cases import Case, CaseOutput, RankMetrics, TrainSettings
from crosscheck.contract.fixture import BATCH_KEYS
from crosscheck.contract.row_fields import ROW_FIELD_KEYS
from crosscheck.contract.schemes import resolve_scheme
from crosscheck.fixtures.builtin import builtin_fixture
from crosscheck.launch.workers import serve_job

FRONT_ENDS = {"jax-pmap": "pmap", "jax-shard_map": "shard_map", "jax-jit": "jit"}


def _variants(impl: str) -> dict[str, dict]:
    """Strategy name -> StepConfig arguments. precount uses pmean, so s = R as under DDP;
    global-view jit writes the global sum directly and has no collective to choose. "naive"
    is an accidental scheme's loop: precount under pmean (each unit's own mean, averaged)."""
    precount = {"strategy": "precount", "collective": "psum" if impl == "jax-jit" else "pmean"}
    return {
        "precount": precount,
        "postnorm": {"strategy": "postnorm", "collective": "psum"},
        "naive": {"strategy": "precount", "collective": "pmean"},
    }


def placed_sweep(impl: str, configs: list, world_size: int) -> tuple[Callable, Callable]:
    """The in-process front-end's sweep of `configs` ("jax-pmap", "jax-shard_map" or
    "jax-jit"), and how to place (batch, params) for it.

    Params are placed where every update leaves them (committed to device 0 for pmap,
    replicated over the mesh otherwise), so that the first and later calls share one
    compiled program: jit and pmap key their caches on where inputs live, not only on shapes.
    """
    import jax

    import jax_impl

    if impl == "jax-pmap":
        device = jax_impl.require_devices(world_size)[0]
        sweep = jax_impl.make_pmap_sweep(configs, world_size)
        return sweep, lambda batch, params: (batch, jax.device_put(params, device))
    from jax_impl.harness.traced_once import TracedOnce

    mesh = jax_impl.data_mesh(world_size)
    make = jax_impl.make_shard_map_sweep if impl == "jax-shard_map" else jax_impl.make_global_sweep
    # Traced once for every fixture and layout of the sweep, compiled per batch shape.
    return make(configs, mesh, compile_with=TracedOnce), lambda batch, params: (
        jax_impl.shard_batch(batch, mesh),
        jax_impl.replicate(params, mesh),
    )


def _host(x) -> np.ndarray:
    """A jax array as numpy; bfloat16 widened to float32 (exact), so that the parent, which
    never imports JAX, needs no bfloat16 type to read it."""
    value = np.asarray(x)
    return value.astype(np.float32) if value.dtype.name == "bfloat16" else value


def _outputs(R: int, history: list) -> CaseOutput:
    """One config's consecutive UpdateResults as a CaseOutput."""
    metrics = []
    for update, out in enumerate(history):
        m = out.metrics
        for rank in range(R):
            metrics.append(
                RankMetrics(
                    rank=rank,
                    update=update,
                    valid_tokens=int(np.asarray(m.rank_valid_tokens)[rank]),
                    loss_sum=float(np.asarray(m.rank_loss_sums)[rank]),
                    denominator=float(m.global_denominator),
                    objective=float(m.loss),
                    grad_norm=float(m.grad_norm),
                    clipped_grad_norm=float(m.clipped_grad_norm),
                )
            )
    return CaseOutput(
        grads={k: _host(v) for k, v in history[0].grads.items()},
        params=[{k: _host(v) for k, v in out.params.items()} for out in history],
        metrics=metrics,
    )


def id_space(fixture_names: Sequence[str]) -> dict[str, int]:
    """One id space for the fixtures of a sweep or launch: their largest group and document
    ids + 1 (static in a compiled program, so that fixtures of one shape share it)."""
    fixtures = [builtin_fixture(name) for name in set(fixture_names)]
    return {
        "num_groups": max(int(f.group_ids.max()) + 1 for f in fixtures),
        "num_documents": max(int(f.document_ids.max()) + 1 for f in fixtures),
    }


def _configs(impl: str, cases: Sequence[Case], settings: TrainSettings) -> tuple[list, list]:
    """One StepConfig per (scheme, strategy) of `cases`, and those keys in the same order.

    An accidental scheme (rank_mean, microbatch_mean) has no strategy of its own: it is the
    naive loop, each unit's own mean under DDP's averaging collective, which the precount
    path computes with s = R."""
    import optax

    import jax_impl

    spec = settings.optimizer_spec()
    optimizer = optax.sgd(**spec) if spec.pop("name") == "sgd" else optax.adamw(**spec)
    variants = _variants(impl)
    keys = sorted({(c.scheme, c.strategy) for c in cases})
    configs = [
        jax_impl.StepConfig(
            optimizer=optimizer,
            scheme=resolve_scheme(scheme).to_dict(),
            max_grad_norm=settings.max_grad_norm,
            **(variants["naive"] if strategy == "naive" else variants[strategy]),
        )
        for scheme, strategy in keys
    ]
    return configs, keys


def run_group(
    impl: str, world_size: int, cases: Sequence[Case], settings: TrainSettings, dtype: str
) -> dict[Case, CaseOutput]:
    """Every case of one front-end, world size and dtype, through one compiled sweep per set
    of (scheme, strategy) that its fixtures run.

    A sweep holds those configs side by side; the batches are laid out with one id space
    (`num_groups`, `num_documents`, static in the program), so that one program per batch
    shape serves every fixture of the sweep. v1's fixtures run v1's eight names and v2's the
    trainer modes (`crosscheck.run.plan.Plan.pairs`): one sweep of both would trace, compile
    and run every config of the other set on every fixture and throw it away."""
    fixtures = {c.fixture: builtin_fixture(c.fixture) for c in cases}
    space = id_space(list(fixtures))
    wanted: dict[str, set[tuple[str, str]]] = {}
    for case in cases:
        wanted.setdefault(case.fixture, set()).add((case.scheme, case.strategy))
    sweeps: dict[frozenset, list[str]] = {}
    for fixture_name, keys in sorted(wanted.items()):
        sweeps.setdefault(frozenset(keys), []).append(fixture_name)
    results: dict[Case, CaseOutput] = {}
    for names in sweeps.values():
        members = [c for c in cases if c.fixture in names]
        results.update(
            _run_sweep(
                impl, world_size, members, settings, dtype, {n: fixtures[n] for n in names}, space
            )
        )
    return results


def _run_sweep(
    impl: str,
    world_size: int,
    cases: Sequence[Case],
    settings: TrainSettings,
    dtype: str,
    fixtures: dict,
    space: dict[str, int],
) -> dict[Case, CaseOutput]:
    """`cases` (every one a (scheme, strategy) of the sweep) through one sweep."""
    import jax_impl

    configs, keys = _configs(impl, cases, settings)
    sweep, place = placed_sweep(impl, configs, world_size)
    results: dict[Case, CaseOutput] = {}
    for fixture_name, M in sorted({(c.fixture, c.accum_steps) for c in cases}):
        fixture = fixtures[fixture_name]
        arrays = {k: np.asarray(getattr(fixture, k)) for k in (*BATCH_KEYS, *ROW_FIELD_KEYS)}
        batch, params0 = place(
            jax_impl.lay_out_global_batch(
                arrays,
                world_size,
                M,
                vocab_size=fixture.vocab_size,
                # weights_dtype left to its default, the denominator dtype: not the params'.
                **space,
            ),
            jax_impl.params_from_numpy(fixture.params(), dtype),
        )
        params = [params0] * len(configs)
        states = [jax_impl.init_opt_state(configs[0].optimizer, params0)] * len(configs)
        histories: list[list] = [[] for _ in configs]
        for _ in range(settings.num_updates):
            reduced = sweep(params, batch)
            for v, config in enumerate(configs):
                out = jax_impl.apply_optimizer(reduced[v], params[v], states[v], config)
                params[v], states[v] = out.params, out.opt_state
                histories[v].append(out)
        for case in cases:
            if (case.fixture, case.accum_steps) == (fixture_name, M):
                v = keys.index((case.scheme, case.strategy))
                results[case] = _outputs(world_size, histories[v])
    return results


def run_job(job: dict) -> dict[Case, CaseOutput | str]:
    """Every case of the job, by front-end and world size; a failed group's cases get its
    traceback."""
    groups: dict[tuple[str, int], list[Case]] = {}
    for case in job["cases"]:
        groups.setdefault((case.impl, case.world_size), []).append(case)
    results: dict[Case, CaseOutput | str] = {}
    for (impl, world_size), cases in sorted(groups.items()):
        try:
            results.update(run_group(impl, world_size, cases, job["settings"], job["dtype"]))
        except Exception:  # one failed group fails its cases by name, the others still run
            message = traceback.format_exc(limit=8)
            results.update({case: message for case in cases})
    return results


def main(argv: Sequence[str]) -> int:
    return serve_job(argv, run_job)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
