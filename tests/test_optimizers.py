"""The oracle's update math against optax and torch.optim, in float64.

The oracle writes clipping, SGD and AdamW out in numpy; these tests hold it to the libraries
it claims to match. optax needs jax_enable_x64, which is global, so it runs in a subprocess.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from crosscheck.contract.optimizers import (
    AdamWConfig,
    OptimizerState,
    SGDConfig,
    apply_update,
    clip_by_global_norm,
    global_norm,
    train,
)
from crosscheck.contract.oracle import loss_and_grad
from crosscheck.fixtures.builtin import builtin_fixture
from crosscheck.judge.compare import FLOAT64_RTOL, assert_tree_close

CONFIG = AdamWConfig(learning_rate=0.05, b1=0.8, b2=0.95, eps=1e-6, weight_decay=0.1)


def _gradient_sequence(num_steps: int) -> tuple[dict, list[dict]]:
    rng = np.random.default_rng(1)
    params = {"embed": rng.standard_normal((5, 3)), "unembed": rng.standard_normal((3, 5))}
    grads = [
        {k: rng.standard_normal(v.shape) * 10.0**-s for k, v in params.items()}
        for s in range(num_steps)
    ]
    return params, grads


def _oracle_adamw(params, grads_seq, max_norm, convention):
    state = OptimizerState()
    for grads in grads_seq:
        if max_norm is not None:
            grads, _ = clip_by_global_norm(grads, max_norm, convention)
        params, state = apply_update(params, grads, CONFIG, state)
    return params


@pytest.mark.parametrize("max_norm", [None, 0.5, 1e6])
def test_adamw_and_clipping_match_torch_in_float64(max_norm):
    params, grads_seq = _gradient_sequence(4)
    tensors = {k: torch.nn.Parameter(torch.tensor(v)) for k, v in params.items()}
    optimizer = torch.optim.AdamW(
        list(tensors.values()),
        lr=CONFIG.learning_rate,
        betas=(CONFIG.b1, CONFIG.b2),
        eps=CONFIG.eps,
        weight_decay=CONFIG.weight_decay,
    )
    for grads in grads_seq:
        for k, p in tensors.items():
            p.grad = torch.tensor(grads[k])
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(list(tensors.values()), max_norm)
        optimizer.step()
    expected = {k: p.detach().numpy() for k, p in tensors.items()}
    actual = _oracle_adamw(params, grads_seq, max_norm, "torch")
    # float64 end to end: only the order of a few roundings per element differs.
    assert_tree_close(actual, expected, FLOAT64_RTOL, "oracle AdamW vs torch.optim.AdamW")


OPTAX_SCRIPT = textwrap.dedent(
    """
    import sys
    import jax
    jax.config.update("jax_enable_x64", True)
    import numpy as np, optax
    data = np.load(sys.argv[1])
    max_norm = float(sys.argv[2])
    steps = int(sys.argv[3])
    params = {k: data[k] for k in ("embed", "unembed")}
    chain = [optax.clip_by_global_norm(max_norm)] if max_norm > 0 else []
    chain.append(optax.adamw(0.05, b1=0.8, b2=0.95, eps=1e-6, weight_decay=0.1))
    opt = optax.chain(*chain)
    state = opt.init(params)
    for s in range(steps):
        grads = {k: data[f"{k}_{s}"] for k in params}
        updates, state = opt.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    np.savez(sys.argv[4], **{k: np.asarray(v) for k, v in params.items()})
    """
)


@pytest.mark.parametrize("max_norm", [None, 0.5])
def test_adamw_and_clipping_match_optax_in_float64(max_norm, tmp_path):
    params, grads_seq = _gradient_sequence(4)
    arrays = dict(params)
    for s, grads in enumerate(grads_seq):
        arrays |= {f"{k}_{s}": v for k, v in grads.items()}
    np.savez(tmp_path / "in.npz", **arrays)
    subprocess.run(
        [
            sys.executable,
            "-c",
            OPTAX_SCRIPT,
            str(tmp_path / "in.npz"),
            str(max_norm or 0.0),
            str(len(grads_seq)),
            str(tmp_path / "out.npz"),
        ],
        check=True,
        timeout=120,
    )
    with np.load(tmp_path / "out.npz") as out:
        expected = {k: out[k] for k in out.files}
    actual = _oracle_adamw(params, grads_seq, max_norm, "optax")
    assert_tree_close(actual, expected, FLOAT64_RTOL, "oracle AdamW vs optax.adamw")


def test_clip_conventions_differ_by_torchs_epsilon():
    grads = {"embed": np.array([3.0, 4.0]), "unembed": np.zeros(1)}
    optax_style, norm = clip_by_global_norm(grads, 1.0, "optax")
    torch_style, _ = clip_by_global_norm(grads, 1.0, "torch")
    assert norm == 5.0
    assert global_norm(optax_style) == pytest.approx(1.0, abs=1e-15)
    assert optax_style["embed"][0] / torch_style["embed"][0] == pytest.approx(
        1 + 1e-6 / 5, rel=1e-12
    )
    below, _ = clip_by_global_norm(grads, 10.0, "optax")
    assert np.array_equal(below["embed"], grads["embed"])  # untouched below the threshold


def test_sgd_is_a_plain_gradient_step():
    fixture = builtin_fixture("packed")
    grads = loss_and_grad(fixture, "token_mean").grads
    records = train(fixture, "token_mean", num_updates=1, optimizer=SGDConfig(learning_rate=0.5))
    expected = {k: fixture.params()[k] - 0.5 * grads[k] for k in grads}
    assert_tree_close(records[0].params, expected, 0.0, "SGD step")


def test_train_clips_the_full_update_gradient_and_records_norms():
    fixture = builtin_fixture("ragged")
    free = train(fixture, "sum", 2, 2, num_updates=2)
    clipped = train(fixture, "sum", 2, 2, num_updates=2, max_grad_norm=1.0)
    assert free[0].grad_norm == free[0].clipped_grad_norm > 1.0
    assert clipped[0].grad_norm == free[0].grad_norm
    assert clipped[0].clipped_grad_norm == pytest.approx(1.0, rel=1e-12)
    assert clipped[1].result.loss != free[1].result.loss  # the first update differed
    # Two updates on the same batch: the second starts from the first's params.
    second = loss_and_grad(fixture, "sum", 2, 2, params=free[0].params)
    assert second.loss == free[1].result.loss
