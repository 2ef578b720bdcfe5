"""Context parallel in torch (docs/contract.md#context-parallel) vs the oracle, float64.

A process holds its data-parallel rank's rows at its context rank's positions
(``torch_impl.batch.context_microbatches``); rows and segments then cross processes and are
counted by global id in the count pre-pass (``torch_impl.spec_counts``). In one process:
every scheme of the catalogue's weights c_t at DP x CP layouts in both orders
(``torch_impl.update.layout_weights``, the processes' own code with the pre-pass summed by
hand). On real gloo processes (one launch per process count, R C <= 4): DDP over all R C
processes, precount and postnorm, and FSDP2 over the flattened dimensions of a 2-D
("dp", "cp") DeviceMesh with the counts over its group, every scheme, on ``packed``,
``rollouts`` and ``continued-documents``, the gradient against the oracle's.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from context_parallel_cases import FIELDS, FIXTURES, STRATEGIES, scheme_names
from torch.nn.parallel import DistributedDataParallel

from crosscheck.contract.layout import Layout
from crosscheck.contract.oracle import loss_and_grad
from crosscheck.contract.spec import get_spec as oracle_spec
from crosscheck.fixtures.builtin import builtin_fixture
from torch_impl.batch import BatchError, context_microbatches, context_positions
from torch_impl.comm_hooks import PostnormState, sum_and_carry_hook
from torch_impl.fsdp import context_parallel_mesh, shard_fsdp2
from torch_impl.harness.launcher import launch
from torch_impl.model import BilinearLM, numpy_grads
from torch_impl.update import accumulate_postnorm, accumulate_precount, layout_weights

# float64 on both sides from the same exact counts; sums in another order: ~1e-15 relative.
RTOL = 1e-12
LAUNCH_TIMEOUT_S = 240.0
#: (R, M, C, order) of the in-process weights.
WEIGHT_LAYOUTS = [
    (R, M, C, order)
    for R in (1, 2)
    for M in (1, 2)
    for C in (2, 4)
    for order in ("contiguous", "zigzag")
]
#: Real launches, by process count R C: both orders, C in {2, 4}, DP and accumulation beside.
LAUNCHES = {2: [(1, 2, 2, "zigzag")], 4: [(2, 1, 2, "contiguous"), (1, 1, 4, "zigzag")]}
#: DDP over every process, precount and postnorm; FSDP2 on a 2-D mesh, precount.
FRONT_ENDS = (*STRATEGIES, "fsdp2")


def batch_of(fixture_name: str) -> dict[str, np.ndarray]:
    fixture = builtin_fixture(fixture_name)
    return {key: getattr(fixture, key) for key in FIELDS}


def test_positions_go_to_the_contracts_context_ranks() -> None:
    """torch_impl's own position rule agrees with the contract's (written independently)."""
    for C in (1, 2, 4):
        for order in ("contiguous", "zigzag"):
            owner = np.empty(64, dtype=np.int64)
            for c, held in enumerate(context_positions(64, C, order)):
                owner[held] = c
            assert owner.tolist() == Layout(1, 1, C, order).context_ranks(64).tolist()
    with pytest.raises(BatchError, match="not divisible by 24"):
        context_positions(64, 12, "zigzag")


@pytest.mark.parametrize("fixture_name", FIXTURES)
def test_every_schemes_weights_under_context_parallel_are_the_oracles(fixture_name: str) -> None:
    fixture, batch = builtin_fixture(fixture_name), batch_of(fixture_name)
    problems = []
    for (R, M, C, order), name in (
        (layout, name) for layout in WEIGHT_LAYOUTS for name in scheme_names()
    ):
        laid = fixture.layout(R, M, C, order)
        want = laid.to_global(oracle_spec(name).effective_weights(laid))
        got = layout_weights(name, batch, R, M, C, order).numpy()
        error = float(np.abs(got - want).max() / np.abs(want).max())
        if not error <= RTOL:
            problems.append(f"{name} at R={R} M={M} C={C} {order}: {error:.2e}")
    assert not problems, "\n".join(problems)


def _run_updates(process: int, processes: int, layouts: list[tuple]) -> dict:
    """On each process: every fixture, scheme and strategy at every layout, one update each on
    DDP over all the processes (DDP averages: precount's s is the process count), and precount
    on FSDP2 over the flattened ("dp", "cp") dimensions of a 2-D DeviceMesh, its counts over
    that mesh's group (FSDP2 averages too: s is again the process count)."""
    out = {}
    meshes = {(R, C): context_parallel_mesh(R, C)[1] for R, _, C, _ in layouts}
    for fixture_name in FIXTURES:
        fixture, batch = builtin_fixture(fixture_name), batch_of(fixture_name)
        plain = DistributedDataParallel(BilinearLM.from_numpy(fixture.params()))
        hooked = DistributedDataParallel(BilinearLM.from_numpy(fixture.params()))
        hook_state = PostnormState(rank=process, world_size=processes)
        hooked.register_comm_hook(hook_state, sum_and_carry_hook)
        for R, M, C, order in layouts:
            microbatches = context_microbatches(batch, process, R, C, M, order)
            dp_cp = meshes[R, C]
            sharded = shard_fsdp2(
                BilinearLM.from_numpy(fixture.params()), world_size=processes, mesh=dp_cp
            )
            for name in scheme_names():
                for strategy in FRONT_ENDS:
                    model = {"precount": plain, "postnorm": hooked, "fsdp2": sharded}[strategy]
                    model.zero_grad(set_to_none=True)
                    common = dict(vocab_size=fixture.vocab_size)
                    if strategy == "postnorm":
                        accumulate_postnorm(
                            model, microbatches, name, hook_state=hook_state, **common
                        )
                    else:
                        group = dp_cp.get_group() if strategy == "fsdp2" else None
                        accumulate_precount(
                            model,
                            microbatches,
                            name,
                            reduce_factor=float(processes),
                            group=group,
                            **common,
                        )
                    out[fixture_name, R, M, C, order, name, strategy] = numpy_grads(model)
    return out


@functools.cache
def launched(processes: int) -> list[dict]:
    torch.set_num_threads(1)
    return launch(_run_updates, processes, (LAUNCHES[processes],), timeout_s=LAUNCH_TIMEOUT_S)


@pytest.mark.parametrize("fixture_name", FIXTURES)
@pytest.mark.parametrize(
    ("R", "M", "C", "order"), [layout for layouts in LAUNCHES.values() for layout in layouts]
)
def test_ddp_and_fsdp2_over_every_process_give_the_oracles_gradient(R, M, C, order, fixture_name):
    fixture = builtin_fixture(fixture_name)
    outputs = launched(R * C)
    problems = []
    for name in scheme_names():
        expected = loss_and_grad(fixture, name, R, M, context_size=C, context_order=order).grads
        for strategy in FRONT_ENDS:
            key = (fixture_name, R, M, C, order, name, strategy)
            got = outputs[0][key]
            for leaf, g in expected.items():
                error = float(np.abs(got[leaf] - g).max() / np.abs(g).max())
                if not error <= RTOL:
                    problems.append(f"{name} {strategy} {leaf}: {error:.2e}")
            # DDP leaves every process the same reduced gradient (FSDP2's is gathered whole).
            if not all(np.array_equal(out[key][k], got[k]) for out in outputs for k in got):
                problems.append(f"{name} {strategy}: processes disagree")
    assert not problems, "\n".join(problems)
