"""The JAX transformer, and the seed's test on it: a shard_map update equals the objective.

In this process (float32, x64 off): positions and the attention mask on a hand-made row, a
packed document's logits equal the same document's alone, shapes refused, float64 refused
without x64.

In one x64 subprocess (tests/transformer_jax_runner.py, a mesh of R fake CPU devices): the
project's per-rank step (``jax_impl.accumulate.rank_gradients``, given the transformer's
``token_losses`` through ``StepConfig(token_losses_fn=...)``) under ``shard_map``, precount
(with pmean: s = R) and postnorm, for token_mean and sequence_mean on ``packed`` and
``group_token_mean`` on ``rollouts``, R in {1, 2, 4}, M in {1, 2}, and under context parallel
(every row split over C = 2 ranks of a ("data", "context") mesh, each shard's queries
attending to every shard's keys and values) at (R, M) = (1, 2) zigzag and (2, 1)
contiguous: the reduced gradient must equal the single-process gradient of the intended
objective. Then that single-process gradient must equal torch's.
"""

from __future__ import annotations

import json
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from child_env import ROOT, TESTS, jax_env
from jax_matrix import RUNNER_XLA_FLAGS
from transformer_reference import intended_weights

from crosscheck import builtin_fixture
from crosscheck.fixtures.transformer_weights import TRANSFORMER_CONFIG, initial_weights
from crosscheck.judge.compare import tree_rel_err
from crosscheck.launch.worker_processes import run_workers
from jax_impl import transformer
from torch_impl import transformer as torch_transformer

# float64 against float64: the same model and weights, summed in another order (R M
# microbatches, then ranks; D before or after), a few hundred O(1) terms per gradient entry
# through softmax and layer norm. Seen: below 2e-15; 1e-12 is the project's float64
# tolerance (docs/contract.md), and token_mean and sequence_mean differ by ~0.9 here.
RTOL = 1e-12
#: The runner compiles one sweep per layout and case kind (12 programs); ~15 s of CPU, more
#: wall time on 2 busy cores. This only stops a hang.
RUNNER_TIMEOUT_S = 300
LAYOUTS = [(R, M) for R in (1, 2, 4) for M in (1, 2)]
#: Rows split over C context ranks, attention across the shards (tests/transformer_jax_runner.py).
CONTEXT_LAYOUTS = [(1, 2, 2, "zigzag"), (2, 1, 2, "contiguous")]
STRATEGIES = ("precount-pmean", "postnorm-psum")
CASES = (("packed", "token_mean"), ("packed", "sequence_mean"), ("rollouts", "group_token_mean"))


@pytest.fixture(scope="module")
def runner_output(tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("transformer_jax")
    command = [sys.executable, str(TESTS / "transformer_jax_runner.py"), "--out", str(work)]
    env = jax_env(RUNNER_XLA_FLAGS)  # 8 fake CPU devices; the runner turns x64 on itself
    run_workers([command], timeout_s=RUNNER_TIMEOUT_S, log_dir=work, env=env, cwd=ROOT)
    records = json.loads((work / "records.json").read_text())
    with np.load(work / "single_process.npz") as data:
        single = {key: np.array(data[key]) for key in data.files}
    return records, single


def test_shard_map_update_equals_the_single_process_objective(runner_output) -> None:
    records, _ = runner_output
    seen = {(r["fixture"], r["scheme"], r["R"], r["M"], r["C"], r["strategy"]) for r in records}
    layouts = [(R, M, 1) for R, M in LAYOUTS] + [(R, M, C) for R, M, C, _ in CONTEXT_LAYOUTS]
    expected = {(*case, *layout, s) for case in CASES for layout in layouts for s in STRATEGIES}
    assert seen == expected and len(records) == len(expected)
    # NaN or inf is recorded as inf, and inf <= RTOL is False: it never passes.
    bad = [r for r in records if not (math.isfinite(r["err"]) and r["err"] <= RTOL)]
    assert bad == []


def test_torch_and_jax_single_process_gradients_agree(runner_output) -> None:
    """The same objective (token_mean on packed) differentiated by each framework's own
    model: two independent writings of the architecture must give the same gradient."""
    _, jax_grads = runner_output
    fixture = builtin_fixture("packed")
    model = torch_transformer.TinyTransformer()
    ids = {k: torch.tensor(getattr(fixture, k), dtype=torch.long) for k in ("inputs", "targets")}
    losses = torch_transformer.token_losses(
        model, ids["inputs"], ids["targets"], torch.tensor(fixture.segment_ids).long()
    )
    (torch.tensor(intended_weights("packed", "token_mean")) * losses).sum().backward()
    torch_grads = torch_transformer.named_grads(model)
    worst = tree_rel_err(jax_grads, torch_grads)
    assert math.isfinite(worst.max_rel_err) and worst.max_rel_err <= RTOL, worst.describe()
    # And not trivially: the gradient is not zero anywhere it should carry a signal.
    assert all(np.abs(torch_grads[k]).max() > 1e-3 for k in torch_grads)


def test_positions_and_mask_on_a_hand_made_row() -> None:
    segments = jnp.array([[1, 1, 1, 2, 2, 0, 0]])
    assert transformer.segment_positions(segments).tolist() == [[0, 1, 2, 0, 1, 0, 0]]
    assert transformer.attention_mask(segments)[0].astype(int).tolist() == [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [0, 0, 0, 1, 0, 0, 0],
        [0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 0, 1, 0],  # padding sees itself only: no empty softmax row
        [0, 0, 0, 0, 0, 0, 1],
    ]


def test_a_packed_document_is_computed_as_if_alone() -> None:
    """B packed after A in a row gives B's logits alone (positions restart, no attention
    across documents); float32 here: O(10) logits through ~20 roundings, atol 1e-4. Every
    row is 17 tokens, so one compiled program serves the three calls."""
    params = {k: jnp.asarray(v, jnp.float32) for k, v in initial_weights().items()}
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, TRANSFORMER_CONFIG.vocab, size=(2, 9))
    packed = jnp.array([[*a, *b[:6], 0, 0]])
    segments = jnp.array([[1] * 9 + [2] * 6 + [0, 0]])
    alone = jnp.array([[*b[:6]] + [0] * 11])
    logits = jax.jit(transformer.transformer_logits)
    together = logits(params, packed, segments)[0, 9:15]
    by_itself = logits(params, alone, jnp.array([[3] * 6 + [0] * 11]))[0, :6]
    np.testing.assert_allclose(together, by_itself, rtol=0, atol=1e-4)
    leaked = logits(params, packed, jnp.ones_like(packed))[0, 9:15]
    assert np.abs(leaked - by_itself).max() > 1e-2


def test_shapes_and_float64_without_x64_are_refused() -> None:
    params = {k: jnp.asarray(v, jnp.float32) for k, v in initial_weights().items()}
    with pytest.raises(ValueError, match=r"must both be \[B, T\], got \(1, 2\) and \(1, 3\)"):
        transformer.transformer_logits(params, jnp.zeros((1, 2), int), jnp.ones((1, 3), int))
    with pytest.raises(ValueError, match=r"rows of 129 tokens exceed the 128 positions"):
        transformer.transformer_logits(params, jnp.zeros((1, 129), int), jnp.ones((1, 129), int))
    with pytest.raises(ValueError, match=r"float64 needs jax.config.update"):
        transformer.initial_params(jnp.float64)
