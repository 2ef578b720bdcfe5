"""The JAX side of a harness run, in its own process: ``python -m crosscheck.run.jax_worker``.

x64 is global in JAX and the fake-device count is fixed at import, so the in-process front-ends
(pmap, shard_map, global jit) run here, one process per dtype, with eight CPU devices: x64 on
for float64, off for float32 and bfloat16. The dtype is the params'; the soft weights are laid
out in the denominator dtype (float64 under x64, else float32), never in bfloat16
(`jax_impl.denominators`). Each
front-end and world size builds one sweep, a single compiled program computing every strategy
side by side with the scheme as a traced index; every fixture, layout and scheme of that
world size goes through it. Output is plain numpy, pickled, judged by the parent.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable, Sequence

import numpy as np

from crosscheck.contract.cases import Case, CaseOutput, RankMetrics, TrainSettings
from crosscheck.contract.fixture import BATCH_KEYS
from crosscheck.contract.row_fields import ROW_FIELD_KEYS
from crosscheck.contract.schemes import SCHEMES as V1_SCHEMES
from crosscheck.contract.schemes import resolve_scheme
from crosscheck.fixtures.builtin import builtin_fixture
from crosscheck.launch.workers import serve_job

FRONT_ENDS = {"jax-pmap": "pmap", "jax-shard_map": "shard_map", "jax-jit": "jit"}
ACCIDENTAL = ("rank_mean", "microbatch_mean")


def _variants(impl: str) -> dict[str, dict]:
    """Strategy name -> StepConfig arguments. precount uses pmean, so s = R as under DDP;
    global-view jit writes the global sum directly and has no collective to choose."""
    import jax_impl

    variants = {
        "precount": {
            "strategy": "precount",
            "collective": "psum" if impl == "jax-jit" else "pmean",
        },
        "postnorm": {"strategy": "postnorm", "collective": "psum"},
    }
    if impl != "jax-jit":
        variants["rank_mean"] = {"gradients": jax_impl.rank_mean_gradients}
        variants["microbatch_mean"] = {"gradients": jax_impl.microbatch_mean_gradients}
    return variants


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
    mesh = jax_impl.data_mesh(world_size)
    make = jax_impl.make_shard_map_sweep if impl == "jax-shard_map" else jax_impl.make_global_sweep
    return make(configs, mesh), lambda batch, params: (
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


def run_group(
    impl: str, world_size: int, cases: Sequence[Case], settings: TrainSettings, dtype: str
) -> dict[Case, CaseOutput]:
    """Every case of one front-end and world size through one compiled sweep."""
    import optax

    import jax_impl

    spec = settings.optimizer_spec()
    optimizer = optax.sgd(**spec) if spec.pop("name") == "sgd" else optax.adamw(**spec)
    variants = _variants(impl)
    names = list(variants)
    configs = [
        jax_impl.StepConfig(optimizer=optimizer, max_grad_norm=settings.max_grad_norm, **kw)
        for kw in variants.values()
    ]
    sweep, place = placed_sweep(impl, configs, world_size)
    results: dict[Case, CaseOutput] = {}
    by_batch: dict[tuple[str, int], list[Case]] = {}
    for case in cases:
        by_batch.setdefault((case.fixture, case.accum_steps), []).append(case)
    for (fixture_name, M), group in sorted(by_batch.items()):
        fixture = builtin_fixture(fixture_name)
        batch, params0 = place(
            jax_impl.lay_out_global_batch(
                {k: np.asarray(getattr(fixture, k)) for k in BATCH_KEYS},
                world_size,
                M,
                # weights_dtype left to its default, the denominator dtype: not the params'.
                vocab_size=fixture.vocab_size,
            ),
            jax_impl.params_from_numpy(fixture.params(), dtype),
        )
        # Accidental configs ignore the scheme index: any intended scheme's call serves them.
        schemes = sorted({c.scheme for c in group if c.scheme not in ACCIDENTAL}) or ["token_mean"]
        for scheme in schemes:
            params = [params0] * len(configs)
            states = [jax_impl.init_opt_state(optimizer, params0)] * len(configs)
            histories: list[list] = [[] for _ in configs]
            for _ in range(settings.num_updates):
                reduced = sweep(params, batch, scheme)
                for v, config in enumerate(configs):
                    out = jax_impl.apply_optimizer(reduced[v], params[v], states[v], config)
                    params[v], states[v] = out.params, out.opt_state
                    histories[v].append(out)
            for case in group:
                if case.scheme == scheme:
                    results[case] = _outputs(world_size, histories[names.index(case.strategy)])
                elif case.scheme in ACCIDENTAL and scheme == schemes[0]:
                    results[case] = _outputs(world_size, histories[names.index(case.scheme)])
    return results


def run_spec_group(
    impl: str, world_size: int, cases: Sequence[Case], settings: TrainSettings
) -> dict[Case, CaseOutput]:
    """Every trainer-mode case (a scheme spec) of one front-end and world size, float64.

    One compiled sweep holds every spec of the group in both strategies
    (``jax_impl.spec_step.spec_step_config``); the batches of v2's fixtures are laid out
    with one id space (`num_groups`, `num_documents`, static in the program), so that one
    program per layout serves them all."""
    import optax

    import jax_impl
    from jax_impl.spec_batch import lay_out_spec_batch
    from jax_impl.spec_step import spec_step_config

    spec = settings.optimizer_spec()
    optimizer = optax.sgd(**spec) if spec.pop("name") == "sgd" else optax.adamw(**spec)
    variants = _variants(impl)
    schemes = sorted({c.scheme for c in cases})
    strategies = ("precount", "postnorm")
    configs = [
        spec_step_config(
            resolve_scheme(scheme).to_dict(),
            optimizer,
            max_grad_norm=settings.max_grad_norm,
            **variants[strategy],
        )
        for scheme in schemes
        for strategy in strategies
    ]
    sweep, place = placed_sweep(impl, configs, world_size)
    fixtures = {c.fixture: builtin_fixture(c.fixture) for c in cases}
    num_groups = max(int(f.group_ids.max()) + 1 for f in fixtures.values())
    num_documents = max(int(f.document_ids.max()) + 1 for f in fixtures.values())
    results: dict[Case, CaseOutput] = {}
    for fixture_name, M in sorted({(c.fixture, c.accum_steps) for c in cases}):
        fixture = fixtures[fixture_name]
        arrays = {k: np.asarray(getattr(fixture, k)) for k in (*BATCH_KEYS, *ROW_FIELD_KEYS)}
        batch, params0 = place(
            lay_out_spec_batch(
                arrays,
                world_size,
                M,
                vocab_size=fixture.vocab_size,
                num_groups=num_groups,
                num_documents=num_documents,
            ),
            jax_impl.params_from_numpy(fixture.params(), "float64"),
        )
        params = [params0] * len(configs)
        states = [jax_impl.init_opt_state(optimizer, params0)] * len(configs)
        histories: list[list] = [[] for _ in configs]
        for _ in range(settings.num_updates):
            reduced = sweep(params, batch, "token_mean")  # the scheme index is unused
            for v, config in enumerate(configs):
                out = jax_impl.apply_optimizer(reduced[v], params[v], states[v], config)
                params[v], states[v] = out.params, out.opt_state
                histories[v].append(out)
        for case in cases:
            if (case.fixture, case.accum_steps) == (fixture_name, M):
                v = schemes.index(case.scheme) * len(strategies) + strategies.index(case.strategy)
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
            v1 = [c for c in cases if c.scheme in V1_SCHEMES]
            specs = [c for c in cases if c.scheme not in V1_SCHEMES]
            if v1:
                results.update(run_group(impl, world_size, v1, job["settings"], job["dtype"]))
            if specs:
                results.update(run_spec_group(impl, world_size, specs, job["settings"]))
        except Exception:  # one failed group fails its cases by name, the others still run
            message = traceback.format_exc(limit=8)
            results.update({case: message for case in cases})
    return results


def main(argv: Sequence[str]) -> int:
    return serve_job(argv, run_job)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
