"""A hypothesis fuzz over random fixtures, layouts, ignore patterns and weights (issue 13).

Each example is a `crosscheck.fixtures.builtin.random_fixture` (rows packing 1-4 documents, a random
fraction of ignored targets up to all of them, rows without any valid target, soft weights
with zeros or none), optionally with one whole rank emptied of valid targets or every weight
zero, laid out over (R, M) with R in {1, 2, 4}, M in {1, 2, 3} and 1-2 rows per microbatch.
For every intended scheme:

* the oracle's gradient is finite, and the same (<= 1e-12) at every layout of the fixture
  (`test_oracle_is_finite_and_layout_invariant`: ORACLE_EXAMPLES examples, in process);
* torch_impl's update (DDP on real gloo ranks, precount and postnorm) and jax_impl's step
  (pmap, shard_map and the global-view jit in turn, every strategy and collective, on 8 fake
  CPU devices, float64) give the oracle's gradient and D at 1e-12, never a NaN
  (FRAMEWORK_EXAMPLES examples each).

Processes are the expensive part, so each framework runs all its examples in one launch: the
examples are drawn by hypothesis first, deterministically (``derandomize=True``, no example
database; every tenth of a pool of 240, see `drawn_examples`), then torch runs them in one
process group of 4 ranks (sub-groups of 1 and 2 ranks for R < 4) and JAX in one worker process
(x64 is global in JAX, so not this one). Each launch has a time limit (TORCH_TIMEOUT_S,
JAX_TIMEOUT_S); the whole file takes about 35 s on the 2-core machine, most of it XLA
compiling one program per front-end and batch shape.
"""

from __future__ import annotations

import argparse
import functools
import pickle
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from child_env import jax_env, run_script
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from crosscheck import FLOAT64_RTOL, INTENDED_SCHEMES, assert_tree_close
from crosscheck.contract.fixture import NPZ_KEYS, Fixture
from crosscheck.contract.layout import IGNORE_INDEX
from crosscheck.contract.oracle import loss_and_grad
from crosscheck.fixtures.builtin import random_fixture
from crosscheck.launch.workers import SMALL_PROGRAM_XLA_FLAGS

ROOT = Path(__file__).resolve().parents[1]
#: Examples run through torch and JAX (each framework runs every one of them).
FRAMEWORK_EXAMPLES = 24
#: Examples of the in-process oracle property (cheap: numpy only).
ORACLE_EXAMPLES = 200
TORCH_WORLD_SIZE = 4
WORLD_SIZES = (1, 2, 4)
#: Time limits of the two launches (each takes well under a third of its limit here).
TORCH_TIMEOUT_S = 120.0
JAX_TIMEOUT_S = 180.0
#: JAX variants, as (strategy, collective); the global-view jit has no collective to choose.
JAX_VARIANTS = {
    "pmap": (("precount", "psum"), ("precount", "pmean"), ("postnorm", "psum")),
    "shard_map": (("precount", "psum"), ("precount", "pmean"), ("postnorm", "psum")),
    "jit": (("precount", "psum"), ("postnorm", "psum")),
}


@dataclass(frozen=True, slots=True)
class Example:
    """One drawn case: how to build its fixture, and its layout."""

    seed: int
    world_size: int
    accum_steps: int
    rows_per_microbatch: int
    seq_len: int
    max_segments: int
    ignore_fraction: float
    empty_row_fraction: float
    soft_weights: bool
    #: A rank whose rows carry no valid target at all (None: no such rank).
    empty_rank: int | None
    #: Every weight zero: weighted_mean's D is 0 and its gradient must be exactly zero.
    zero_weights: bool

    @property
    def num_rows(self) -> int:
        return self.world_size * self.accum_steps * self.rows_per_microbatch

    def fixture(self) -> Fixture:
        base = random_fixture(
            self.seed,
            self.num_rows,
            self.seq_len,
            max_segments=self.max_segments,
            ignore_fraction=self.ignore_fraction,
            empty_row_fraction=self.empty_row_fraction,
            soft_weights=self.soft_weights,
        )
        arrays = {key: np.array(getattr(base, key)) for key in NPZ_KEYS}
        if self.empty_rank is not None:
            per_rank = self.num_rows // self.world_size
            rows = slice(self.empty_rank * per_rank, (self.empty_rank + 1) * per_rank)
            arrays["targets"][rows] = IGNORE_INDEX
        if self.zero_weights:
            arrays["weights"][:] = 0.0
        return Fixture(name=str(self), description="fuzz example", **arrays)


@st.composite
def examples(draw: st.DrawFn, world_sizes: Sequence[int] = WORLD_SIZES) -> Example:
    world_size = draw(st.sampled_from(world_sizes))
    return Example(
        seed=draw(st.integers(0, 2**20)),
        world_size=world_size,
        accum_steps=draw(st.integers(1, 3)),
        rows_per_microbatch=draw(st.integers(1, 2)),
        # Two lengths only: every JAX batch shape is a compile, and the lengths are not
        # where the normalization can go wrong (the ignore pattern and the layout are).
        seq_len=draw(st.sampled_from((5, 8))),
        max_segments=draw(st.integers(1, 4)),
        ignore_fraction=draw(st.sampled_from((0.0, 0.3, 0.7, 1.0))),
        empty_row_fraction=draw(st.sampled_from((0.0, 0.25, 0.6))),
        soft_weights=draw(st.booleans()),
        empty_rank=draw(st.none() | st.integers(0, world_size - 1)),
        zero_weights=draw(st.integers(0, 5)) == 0,
    )


#: Examples hypothesis draws for the pool the framework examples are taken from.
POOL_SIZE = 10 * FRAMEWORK_EXAMPLES


@functools.cache
def drawn_examples() -> tuple[Example, ...]:
    """FRAMEWORK_EXAMPLES examples, the same on every run (hypothesis, derandomized).

    Hypothesis starts from its simplest draws (all ignored, R = M = 1, ...), so the first
    examples are alike; a pool of POOL_SIZE is drawn and every k-th distinct one kept, which
    spreads the examples over layouts, ignore patterns and weights.
    """
    pool: list[Example] = []

    @settings(
        max_examples=POOL_SIZE,
        derandomize=True,
        database=None,
        phases=[Phase.generate],
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(example=examples())
    def collect(example: Example) -> None:
        if example not in pool:
            pool.append(example)

    collect()
    stride = len(pool) // FRAMEWORK_EXAMPLES
    return tuple(pool[::stride][:FRAMEWORK_EXAMPLES])


def _oracle(fixture: Fixture, scheme: str, R: int, M: int):
    return loss_and_grad(fixture, scheme, R, M)


def _check_against_oracle(
    label: str, example: Example, scheme: str, grads: dict, denominator: float
) -> None:
    expected = _oracle(example.fixture(), scheme, example.world_size, example.accum_steps)
    assert_tree_close(grads, expected.grads, FLOAT64_RTOL, f"{label} {example} {scheme}")
    D = float(denominator)
    # D = 0 (nothing carries weight) is reported as 0 by every implementation.
    assert abs(D - expected.denominator) <= FLOAT64_RTOL * abs(expected.denominator), (
        f"{label} {example} {scheme}: D = {D!r}, oracle {expected.denominator!r}"
    )


# ---- the oracle -----------------------------------------------------------------------------


@settings(
    max_examples=ORACLE_EXAMPLES,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(example=examples(world_sizes=(1, 2, 3, 4)))
def test_oracle_is_finite_and_layout_invariant(example: Example) -> None:
    """ORACLE_EXAMPLES examples: every intended scheme's gradient is finite at every layout
    (R <= 8, M <= 4) of the fixture and equal to the (1, 1) gradient within 1e-12."""
    fixture = example.fixture()
    layouts = fixture.valid_layouts(max_world_size=8, max_accum_steps=4)
    for scheme in INTENDED_SCHEMES:
        reference = _oracle(fixture, scheme, 1, 1)
        for name, grad in reference.grads.items():
            assert np.isfinite(grad).all(), f"{example} {scheme}: {name} not finite"
        if reference.denominator == 0:
            assert all(not grad.any() for grad in reference.grads.values()), (example, scheme)
        for R, M in layouts:
            out = _oracle(fixture, scheme, R, M)
            assert_tree_close(
                out.grads, reference.grads, FLOAT64_RTOL, f"{example} {scheme} R={R} M={M}"
            )
            assert out.denominator == reference.denominator or abs(
                out.denominator - reference.denominator
            ) <= FLOAT64_RTOL * abs(reference.denominator), (example, scheme, R, M)


# ---- torch: every example in one process group ----------------------------------------------


def _torch_rank(rank: int, world_size: int, cases: list[tuple[Example, dict, dict]]) -> dict:
    """Every example whose R includes this rank, both strategies, every intended scheme.

    R < world_size runs on the sub-group of ranks [0, R); the others skip that example.
    Returns {(example index, strategy, scheme): (grads, D)}.
    """
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from torch_impl.batch import rank_microbatches
    from torch_impl.comm_hooks import PostnormState, sum_and_carry_hook
    from torch_impl.model import BilinearLM, numpy_grads
    from torch_impl.update import accumulate_postnorm, accumulate_precount

    # Every rank creates every group, in the same order (new_group is collective).
    groups = {R: dist.new_group(list(range(R))) for R in WORLD_SIZES if world_size > R}
    out: dict[tuple[int, str, str], tuple[dict, float]] = {}
    for index, (example, batch, params) in enumerate(cases):
        R, M = example.world_size, example.accum_steps
        if rank >= R:
            continue
        group = groups.get(R)  # None: the whole world
        microbatches = rank_microbatches(batch, rank, R, M)
        vocab_size = int(params["embed"].shape[0])
        for strategy in ("precount", "postnorm"):
            model = DistributedDataParallel(BilinearLM.from_numpy(params), process_group=group)
            state = None
            if strategy == "postnorm":
                state = PostnormState(rank=rank, world_size=R, process_group=group)
                model.register_comm_hook(state, sum_and_carry_hook)
            for scheme_name in INTENDED_SCHEMES:
                model.zero_grad(set_to_none=True)
                if strategy == "precount":
                    # DDP averages over the R ranks of its group: s = R.
                    done = accumulate_precount(
                        model, microbatches, scheme_name, vocab_size=vocab_size, reduce_factor=R,
                        group=group,
                    )  # fmt: skip
                else:
                    done = accumulate_postnorm(
                        model, microbatches, scheme_name, vocab_size=vocab_size, hook_state=state
                    )
                out[index, strategy, scheme_name] = (numpy_grads(model), done.global_denominator)
    return out


def test_torch_matches_the_oracle_on_every_example() -> None:
    """FRAMEWORK_EXAMPLES examples x 6 intended schemes x {precount, postnorm}, on every rank
    of each example's layout, in one launch of 4 gloo ranks: the oracle's gradient and D at
    1e-12, no NaN."""
    from torch_impl.harness.launcher import launch

    examples_ = drawn_examples()
    assert len(examples_) == FRAMEWORK_EXAMPLES
    cases = []
    for example in examples_:
        fixture = example.fixture()
        batch = {key: fixture.__getattribute__(key) for key in NPZ_KEYS[:4]}
        cases.append((example, batch, fixture.params()))
    per_rank = launch(_torch_rank, TORCH_WORLD_SIZE, (cases,), timeout_s=TORCH_TIMEOUT_S)
    checked = 0
    for rank, results in enumerate(per_rank):
        for (index, strategy, scheme), (grads, D) in results.items():
            _check_against_oracle(
                f"torch {strategy} rank {rank}", examples_[index], scheme, grads, D
            )
            checked += 1
    expected = sum(e.world_size for e in examples_) * 2 * len(INTENDED_SCHEMES)
    assert checked == expected


# ---- JAX: every example in one worker process -----------------------------------------------


def test_jax_matches_the_oracle_on_every_example(tmp_path: Path) -> None:
    """FRAMEWORK_EXAMPLES examples x 6 intended schemes x every strategy and collective of
    one front-end per example (pmap, shard_map, jit in turn), float64 under x64, in one worker
    process with 8 fake devices: the oracle's gradient and D at 1e-12, no NaN."""
    examples_ = drawn_examples()
    cases = []
    for example in examples_:
        fixture = example.fixture()
        cases.append((example, {key: getattr(fixture, key) for key in NPZ_KEYS}))
    job, out = tmp_path / "job.pkl", tmp_path / "out.pkl"
    job.write_bytes(pickle.dumps(cases))
    # Cheaper code generation for these tiny programs, as tests/jax_matrix.py's runners use
    # (no change to the HLO passes or to floating-point semantics).
    env = jax_env(f"--xla_force_host_platform_device_count=8 {SMALL_PROGRAM_XLA_FLAGS}")
    arguments = ("--jax", str(job), "--out", str(out))
    run_script(__file__, *arguments, env=env, timeout=JAX_TIMEOUT_S, what="JAX worker")
    results = pickle.loads(out.read_bytes())
    expected = sum(
        len(JAX_VARIANTS[_front_end(i)]) * len(INTENDED_SCHEMES) for i in range(len(examples_))
    )
    assert len(results) == expected
    for (index, front_end, variant, scheme), (grads, D) in results.items():
        _check_against_oracle(f"jax {front_end} {variant}", examples_[index], scheme, grads, D)


def _front_end(index: int) -> str:
    return tuple(JAX_VARIANTS)[index % len(JAX_VARIANTS)]


def _jax_worker(cases: list[tuple[Example, dict[str, np.ndarray]]]) -> dict[tuple, Any]:
    """Run every case on its front-end; {(index, front-end, variant, scheme): (grads, D)}."""
    import jax

    jax.config.update("jax_enable_x64", True)
    import jax_impl

    jax_impl.require_devices(max(WORLD_SIZES))  # fail, never skip, without the devices
    sweeps: dict[tuple[str, int], Any] = {}
    results: dict[tuple, Any] = {}
    for index, (example, arrays) in enumerate(cases):
        front_end, R = _front_end(index), example.world_size
        variants = JAX_VARIANTS[front_end]
        if (front_end, R) not in sweeps:
            import optax

            # Every scheme's variants side by side: one sweep, one program per batch shape.
            configs = [
                jax_impl.StepConfig(
                    optimizer=optax.sgd(1.0), scheme=scheme, strategy=s, collective=c
                )
                for scheme in INTENDED_SCHEMES
                for s, c in variants
            ]
            if front_end == "pmap":
                sweeps[front_end, R] = jax_impl.make_pmap_sweep(configs, R)
            elif front_end == "shard_map":
                sweeps[front_end, R] = jax_impl.make_shard_map_sweep(configs, jax_impl.data_mesh(R))
            else:
                sweeps[front_end, R] = jax_impl.make_global_sweep(configs, jax_impl.data_mesh(R))
        batch = jax_impl.lay_out_global_batch(
            {key: arrays[key] for key in NPZ_KEYS[:4]},
            R,
            example.accum_steps,
            vocab_size=int(arrays["embed"].shape[0]),
        )
        params = jax_impl.params_from_numpy(
            {"embed": arrays["embed"], "unembed": arrays["unembed"]}, jax.numpy.float64
        )
        reduced = sweeps[front_end, R]([params] * len(INTENDED_SCHEMES) * len(variants), batch)
        for i, scheme in enumerate(INTENDED_SCHEMES):
            own = reduced[i * len(variants) : (i + 1) * len(variants)]
            for (strategy, collective), out in zip(variants, own, strict=True):
                grads = {name: np.asarray(value) for name, value in out.grads.items()}
                D = float(np.asarray(out.global_denominator))
                results[index, front_end, f"{strategy}-{collective}", scheme] = (grads, D)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    """The JAX worker: `python tests/test_fuzz.py --jax JOB.pkl --out OUT.pkl`."""
    parser = argparse.ArgumentParser(description="the JAX side of the fuzz, in its own process")
    parser.add_argument("--jax", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    results = _jax_worker(pickle.loads(args.jax.read_bytes()))
    args.out.write_bytes(pickle.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
