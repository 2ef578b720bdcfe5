"""Context parallel in JAX (jax_impl.context_parallel) vs the oracle, float64, 1e-12.

Every scheme of the catalogue (v1's, the trainer modes and the accidental ones), in both
strategies, on ``packed`` (several documents per row: segments cut by the context split),
``rollouts`` (prompt groups across ranks) and ``continued-documents`` (documents across rows
and ranks), at DP x CP layouts in both orders: under ``jax.shard_map`` over a
("data", "context") mesh and as one global-view ``jax.jit`` over the batch placed with
NamedSharding on that mesh, against `crosscheck.contract.oracle.loss_and_grad` with the same
context layout. x64 is global to a process and the mesh needs 8 host devices, so the JAX side
runs in its own process (this file as a script); the fixtures share one shape, so one
program per layout serves all three.
"""

from __future__ import annotations

import numpy as np
import pytest
from child_env import write_worker_results, x64_worker_results
from context_parallel_cases import FIELDS, FIXTURES, STRATEGIES, scheme_names

from crosscheck.contract.oracle import loss_and_grad
from crosscheck.fixtures.builtin import builtin_fixture

# Both sides compute in float64 from the same exact counts; they differ in the order of their
# sums and where they divide: a few ulps (measured <= 2e-15).
RTOL = 1e-12
#: (R, M, C, order): both orders, C in {2, 4}, data parallel and accumulation beside CP.
LAYOUTS = [(2, 1, 2, "zigzag"), (1, 2, 4, "zigzag"), (2, 2, 2, "contiguous")]
#: shard_map over the ("data", "context") mesh, and one global-view jit over the batch placed
#: with NamedSharding on the same mesh.
FRONT_ENDS = ("shard_map", "jit")


def jax_results() -> dict:
    """Run in the child: every scheme and strategy at every layout and fixture, as numpy."""
    import jax
    import optax

    jax.config.update("jax_enable_x64", True)
    from jax_impl.context_parallel import (
        context_mesh,
        lay_out_context_parallel,
        make_context_parallel_global_sweep,
        make_context_parallel_sweep,
    )
    from jax_impl.update import StepConfig

    cases = [(index, strategy) for index in range(len(scheme_names())) for strategy in STRATEGIES]
    configs = [
        StepConfig(optimizer=optax.sgd(0.1), scheme=scheme_names()[index], strategy=strategy)
        for index, strategy in cases
    ]
    fixtures = [builtin_fixture(name) for name in FIXTURES]
    sizes = {
        "num_groups": max(int(f.group_ids.max()) + 1 for f in fixtures),
        "num_documents": max(int(f.document_ids.max()) + 1 for f in fixtures),
    }
    results = {}
    for (R, M, C, order), front_end in [(layout, f) for layout in LAYOUTS for f in FRONT_ENDS]:
        make_sweep = {
            "shard_map": make_context_parallel_sweep,
            "jit": make_context_parallel_global_sweep,
        }[front_end]
        sweep = make_sweep(configs, context_mesh(R, C))
        for fixture in fixtures:
            arrays = {key: getattr(fixture, key) for key in FIELDS}
            batch = lay_out_context_parallel(
                arrays, R, M, C, order, vocab_size=fixture.vocab_size, **sizes
            )
            outs = sweep([fixture.params()] * len(configs), batch)
            for (index, strategy), out in zip(cases, outs, strict=True):
                results[front_end, fixture.name, R, M, C, order, strategy, index] = {
                    "grads": {k: np.asarray(v) for k, v in out.grads.items()},
                    "loss": float(out.loss),
                    "rank_valid_tokens": np.asarray(out.rank_valid_tokens),
                }
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return x64_worker_results(
        __file__, tmp_path_factory.mktemp("jax_context_parallel"), timeout=300
    )


def rel_err(actual: np.ndarray, expected: np.ndarray) -> float:
    scale = np.abs(expected).max()
    return float(np.abs(actual - expected).max() / scale) if scale else float(np.abs(actual).max())


@pytest.mark.parametrize("front_end", FRONT_ENDS)
@pytest.mark.parametrize("fixture_name", FIXTURES)
@pytest.mark.parametrize(("R", "M", "C", "order"), LAYOUTS)
def test_every_scheme_under_context_parallel_matches_the_oracle(
    results, fixture_name, R, M, C, order, front_end
):
    fixture = builtin_fixture(fixture_name)
    problems = []
    for index, name in enumerate(scheme_names()):
        expected = loss_and_grad(fixture, name, R, M, context_size=C, context_order=order)
        for strategy in STRATEGIES:
            got = results[front_end, fixture_name, R, M, C, order, strategy, index]
            errors = [rel_err(got["grads"][k], g) for k, g in expected.grads.items()]
            if not max(errors) <= RTOL:
                problems.append(f"{name} {strategy}: gradient {max(errors):.2e} from the oracle")
            if not abs(got["loss"] - expected.loss) <= RTOL * abs(expected.loss):
                problems.append(f"{name} {strategy}: loss {got['loss']} vs {expected.loss}")
            # Each process's valid tokens, process r C + c at [r, c]: counts, exact.
            if got["rank_valid_tokens"].ravel().tolist() != expected.rank_valid_tokens.tolist():
                problems.append(f"{name} {strategy}: per-process valid tokens")
    assert not problems, "\n".join(problems)


def test_positions_go_to_the_contracts_context_ranks():
    """jax_impl's own position rule agrees with the contract's (written independently)."""
    from crosscheck.contract.layout import Layout
    from jax_impl.context_parallel import context_positions

    for C in (1, 2, 4):
        for order in ("contiguous", "zigzag"):
            positions = context_positions(64, C, order)
            owner = np.empty(64, dtype=np.int64)
            for c, held in enumerate(positions):
                owner[held] = c
            assert owner.tolist() == Layout(1, 1, C, order).context_ranks(64).tolist()
    with pytest.raises(ValueError, match="not divisible by 24"):
        context_positions(64, 12, "zigzag")


def test_the_global_view_refuses_a_model_whose_tokens_interact():
    """Its shards are rows of their own there: right for the bilinear model only."""
    import optax

    from jax_impl import transformer
    from jax_impl.context_parallel import context_mesh, make_context_parallel_global_sweep
    from jax_impl.update import StepConfig

    config = StepConfig(optimizer=optax.sgd(0.1), token_losses_fn=transformer.token_losses)
    with pytest.raises(ValueError, match="needs the context axis"):
        make_context_parallel_global_sweep([config], context_mesh(1, 2))


if __name__ == "__main__":
    write_worker_results(jax_results)
