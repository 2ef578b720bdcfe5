"""Pipeline parallel in JAX (jax_impl.pipeline) vs the oracle, float64, 1e-12.

Two stages on a ("data", "stage") mesh (``embed`` on stage 0; ``unembed``, the labels and the
loss on stage 1; activations and their gradients through ``lax.ppermute``), R = 1 and 2, M = 2:
every scheme of the catalogue in precount, and the update-scope ones in postnorm (D sent from
the last stage to the first), on ``packed``, ``rollouts`` and ``continued-documents``. A count
that stays on the last stage leaves the first stage's gradient D times too big (torchtitan#4194's
shape). x64 is global to a process and the mesh needs 4 host devices: the JAX side runs in its
own process (this file as a script).
"""

from __future__ import annotations

import numpy as np
import pytest
from child_env import write_worker_results, x64_worker_results
from context_parallel_cases import FIELDS, FIXTURES, scheme_names

from crosscheck.contract.oracle import loss_and_grad
from crosscheck.contract.spec import get_spec
from crosscheck.fixtures.builtin import builtin_fixture

# float64 on both sides from the same exact counts; sums in another order: a few ulps.
RTOL = 1e-12
ACCUM_STEPS = 2
DATA_PARALLEL = (1, 2)
BUG = "count-on-last-stage-only"


def cases() -> list[tuple[str, str]]:
    """(scheme, strategy): precount for every scheme, postnorm for those of update scope."""
    return [
        (name, strategy)
        for name in scheme_names()
        for strategy in ("precount", "postnorm")
        if strategy == "precount" or get_spec(name).scope == "update"
    ]


def jax_results() -> dict:
    """Run in the child: every case at every R and fixture, and the bug, as numpy."""
    import jax

    jax.config.update("jax_enable_x64", True)
    import jax_impl
    from jax_impl.pipeline import make_pipeline_sweep, pipeline_config, pipeline_mesh

    configs = [pipeline_config(name, strategy) for name, strategy in cases()]
    configs.append(pipeline_config("token_mean", "postnorm", count_to_first_stage=False))
    fixtures = [builtin_fixture(name) for name in FIXTURES]
    sizes = {
        "num_groups": max(int(f.group_ids.max()) + 1 for f in fixtures),
        "num_documents": max(int(f.document_ids.max()) + 1 for f in fixtures),
    }
    results = {}
    for R in DATA_PARALLEL:
        sweep = make_pipeline_sweep(configs, pipeline_mesh(R))
        for fixture in fixtures:
            arrays = {key: getattr(fixture, key) for key in FIELDS}
            batch = jax_impl.lay_out_global_batch(
                arrays, R, ACCUM_STEPS, vocab_size=fixture.vocab_size, **sizes
            )
            outs = sweep(fixture.params(), batch)
            for case, out in zip([*cases(), BUG], outs, strict=True):
                results[fixture.name, R, case] = {k: np.asarray(v) for k, v in out.items()}
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return x64_worker_results(__file__, tmp_path_factory.mktemp("jax_pipeline"), timeout=300)


def rel_err(actual: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(actual - expected).max() / np.abs(expected).max())


@pytest.mark.parametrize("fixture_name", FIXTURES)
@pytest.mark.parametrize("R", DATA_PARALLEL)
def test_every_stage_holds_the_oracles_gradient(results, R: int, fixture_name: str) -> None:
    fixture = builtin_fixture(fixture_name)
    problems = []
    for name, strategy in cases():
        expected = loss_and_grad(fixture, name, R, ACCUM_STEPS)
        got = results[fixture_name, R, (name, strategy)]
        for leaf in ("embed", "unembed"):
            error = rel_err(got[leaf], expected.grads[leaf])
            if not error <= RTOL:
                problems.append(f"{name} {strategy} {leaf}: {error:.2e}")
        # D on the last stage of every pipeline; on stage 0 too under postnorm (sent there).
        D = got["denominators"]
        known = D[:, 1] if strategy == "precount" else D
        if get_spec(name).scope == "update" and not np.allclose(
            known, expected.denominator, rtol=1e-14, atol=0
        ):
            problems.append(f"{name} {strategy}: D {D.tolist()} vs {expected.denominator}")
    assert not problems, f"{len(problems)} problem(s):\n" + "\n".join(problems[:30])


@pytest.mark.parametrize("R", DATA_PARALLEL)
def test_a_count_that_reaches_the_last_stage_only_inflates_the_first(results, R: int) -> None:
    for fixture_name in FIXTURES:
        expected = loss_and_grad(builtin_fixture(fixture_name), "token_mean", R, ACCUM_STEPS)
        got = results[fixture_name, R, BUG]
        D = expected.denominator
        assert rel_err(got["embed"], D * expected.grads["embed"]) <= RTOL
        assert rel_err(got["unembed"], expected.grads["unembed"]) <= RTOL
        assert (got["denominators"][:, 0] == 0).all()  # stage 0 never heard of D


def test_a_local_scope_in_postnorm_and_the_bug_in_precount_are_refused() -> None:
    from jax_impl.pipeline import pipeline_config

    with pytest.raises(ValueError, match="use precount"):
        pipeline_config("rank_mean", "postnorm")
    with pytest.raises(ValueError, match="postnorm's bug"):
        pipeline_config("token_mean", "precount", count_to_first_stage=False)


if __name__ == "__main__":
    write_worker_results(jax_results)
