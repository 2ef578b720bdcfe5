"""One trace for every batch shape (`jax_impl.harness.traced_once.TracedOnce`): a sweep
exported once with symbolic M, B and T gives, on every shape, the bits the sweep traced for
that shape gives, and is traced once per kind of arguments, not once per shape.

In this process (float32, x64 off, eight CPU devices from conftest), under the GSPMD
partitioner as the harness's workers run (`crosscheck.launch.workers.SMALL_PROGRAM_JAX_CONFIG`);
the float64 default matrix runs through it in `crosscheck run`.
"""

from __future__ import annotations

from collections.abc import Iterator

import jax
import numpy as np
import optax
import pytest

import jax_impl
from crosscheck import builtin_fixture
from crosscheck.contract.fixture import BATCH_KEYS
from crosscheck.contract.row_fields import ROW_FIELD_KEYS
from jax_impl.harness.traced_once import TracedOnce

# Two shapes of fixture ([8, 64] and [144, 24] rows x positions) at M = 1 and 2: four batch
# shapes, each its own compile, one trace.
FIXTURES = ("packed", "ragged")
SPECS = ("token_mean", "sequence_mean", "group_token_mean", "length_power:0.5")


@pytest.fixture
def gspmd() -> Iterator[None]:
    """The GSPMD partitioner for the test, as the harness's in-process workers run."""
    before = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", False)
    yield
    jax.config.update("jax_use_shardy_partitioner", before)


def _held(held: list[TracedOnce]):
    """A `compile_with` that keeps the TracedOnce it makes in `held`."""

    def traced_once(jitted):
        held.append(TracedOnce(jitted))
        return held[-1]

    return traced_once


def _configs(front_end: str = "shard_map") -> list[jax_impl.StepConfig]:
    """Every spec of SPECS in both strategies (precount with pmean, s = R, where the front-end
    has a collective to choose; global-view jit has none)."""
    precount = "psum" if front_end == "jit" else "pmean"
    return [
        jax_impl.StepConfig(
            optimizer=optax.sgd(0.1), scheme=name, strategy=strategy, collective=collective
        )
        for name in SPECS
        for strategy, collective in (("precount", precount), ("postnorm", "psum"))
    ]


def _batches(R: int) -> list[tuple[jax_impl.Batch, dict]]:
    fixtures = [builtin_fixture(name) for name in FIXTURES]
    space = {
        "num_groups": max(int(f.group_ids.max()) + 1 for f in fixtures),
        "num_documents": max(int(f.document_ids.max()) + 1 for f in fixtures),
    }
    out = []
    for fixture in fixtures:
        arrays = {k: np.asarray(getattr(fixture, k)) for k in (*BATCH_KEYS, *ROW_FIELD_KEYS)}
        for M in (1, 2):
            batch = jax_impl.lay_out_global_batch(
                arrays, R, M, vocab_size=fixture.vocab_size, **space
            )
            out.append((batch, jax_impl.params_from_numpy(fixture.params(), "float32")))
    return out


@pytest.mark.parametrize("front_end", ["shard_map", "jit"])
def test_a_sweep_traced_once_gives_the_bits_of_one_traced_per_shape(
    front_end: str, gspmd: None
) -> None:
    R = 2
    assert jax.device_count() >= R, "conftest asks for eight CPU devices"
    make = {"shard_map": jax_impl.make_shard_map_sweep, "jit": jax_impl.make_global_sweep}[
        front_end
    ]
    configs = _configs(front_end)
    mesh = jax_impl.data_mesh(R)
    held: list[TracedOnce] = []
    per_shape = make(configs, mesh)
    once = make(configs, mesh, compile_with=_held(held))
    batches = _batches(R)
    assert len({b.targets.shape for b, _ in batches}) == 4
    for batch, params in batches:
        expected = jax.tree.map(np.asarray, per_shape([params] * len(configs), batch))
        got = jax.tree.map(np.asarray, once([params] * len(configs), batch))
        for e, g in zip(jax.tree.leaves(expected), jax.tree.leaves(got), strict=True):
            assert e.dtype == g.dtype and e.shape == g.shape
            assert np.array_equal(e, g), f"{front_end} {batch.targets.shape}: bits differ"
            assert np.all(np.isfinite(g))
    (program,) = held
    assert program.traces == 1, f"{program.traces} traces for 4 batch shapes, expected 1"


def test_another_kind_of_arguments_is_traced_again(gspmd: None) -> None:
    """Params of another shape (a larger vocabulary) are another export, not a wrong call."""
    R = 2
    configs = _configs()[:2]
    mesh = jax_impl.data_mesh(R)
    held: list[TracedOnce] = []
    sweep = jax_impl.make_shard_map_sweep(configs, mesh, compile_with=_held(held))
    batch, params = _batches(R)[0]
    sweep([params] * len(configs), batch)
    wider = {k: np.pad(np.asarray(v), [(0, 8), (0, 0)] if k == "embed" else [(0, 0), (0, 8)])
             for k, v in params.items()}  # fmt: skip
    out = sweep([wider] * len(configs), batch)
    assert held[0].traces == 2
    assert out[0].grads["embed"].shape == wider["embed"].shape


def test_under_shardy_every_shape_is_traced_as_jit_traces_it() -> None:
    """jaxlib 0.10.2 crashes refining a shape-polymorphic module with Shardy's ops: with
    Shardy on (jax's default, this process's) nothing is exported, and the results are
    jax.jit's."""
    R = 2
    assert jax.config.jax_use_shardy_partitioner
    configs = _configs()[:2]
    mesh = jax_impl.data_mesh(R)
    held: list[TracedOnce] = []
    once = jax_impl.make_shard_map_sweep(configs, mesh, compile_with=_held(held))
    per_shape = jax_impl.make_shard_map_sweep(configs, mesh)
    for batch, params in _batches(R)[:2]:
        got = jax.tree.map(np.asarray, once([params] * len(configs), batch))
        expected = jax.tree.map(np.asarray, per_shape([params] * len(configs), batch))
        for e, g in zip(jax.tree.leaves(expected), jax.tree.leaves(got), strict=True):
            assert np.array_equal(e, g)
    assert held[0].traces == 0
