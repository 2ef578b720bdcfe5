"""The torch transformer, and the seed's test on it: a DDP update equals the objective.

In-process: where each token sits in its segment, what it may attend to, a packed document's
logits equal the same document's alone (no attention across documents), bad input named, the
weights' names mapping one-to-one to the shared file's.

Multi-process (real DDP on gloo, one launch per world size R in {1, 2, 4}, every case in it):
the project's reference update steps (precount, and postnorm with its comm hook) train the
transformer through ``per_token_losses``; the reduced gradient, for token_mean and
sequence_mean on ``packed`` (rows of several documents, ignored targets at the boundaries)
and the group mean ``group_token_mean`` on ``rollouts`` (prompt groups across ranks and
microbatches), at M in {1, 2}, must equal the single-process gradient of the intended
objective: the same model over the whole global batch, sum_t c_t l_t with c_t = a_t / D from
the numpy oracle's scheme objects.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from torch.func import functional_call
from torch.nn.functional import cross_entropy
from transformer_reference import intended_weights

from crosscheck import builtin_fixture
from crosscheck.fixtures.transformer_weights import (
    TRANSFORMER_CONFIG,
    TransformerConfig,
    draw_weights,
    initial_weights,
)
from crosscheck.judge.compare import tree_rel_err
from torch_impl.harness.launcher import launch
from torch_impl.harness.transformer_cases import (
    TransformerCase,
    TransformerOutput,
    run_transformer_cases,
)
from torch_impl.transformer import (
    TinyTransformer,
    attention_allowed,
    named_grads,
    named_weights,
    segment_positions,
    token_losses,
    transformer_param_name,
)

# float64 on both sides, the same model and weights; what differs is the order of the sums:
# the distributed update adds R M microbatch gradients (each a sum over its ~30-500 tokens) and
# reduces them across ranks, the reference sums all 512 tokens at once, and D is applied
# before (precount) or after (postnorm) the sums. Each gradient entry is a few hundred O(1)
# terms through two layers (softmax, layer norm: a handful of roundings each), so the
# relative error is ~1e-15 (seen: below 2e-15); 1e-12 is the project's float64 tolerance
# (docs/contract.md) and still 10^10 below what a mis-weighted token does (> 1e-2 here).
RTOL = 1e-12
WORLD_SIZES = (1, 2, 4)
ACCUM_STEPS = (1, 2)
STRATEGIES = ("precount", "postnorm")
#: (fixture, scheme spec, with contract v2's row fields): the group mean reads group_ids.
CASES = (
    ("packed", "token_mean", False),
    ("packed", "sequence_mean", False),
    ("rollouts", "group_token_mean", True),
)
ROW_FIELDS = ("group_ids", "document_ids", "row_weights", "sample_mask")
#: A launch of R ranks running 12 updates takes ~5-15 s on 2 busy cores; this stops a hang.
LAUNCH_TIMEOUT_S = 240.0


def _global_batch(fixture_name: str, with_row_fields: bool) -> dict[str, np.ndarray]:
    fixture = builtin_fixture(fixture_name)
    keys = ("inputs", "targets", "segment_ids", "weights")
    keys += ROW_FIELDS if with_row_fields else ()
    return {key: np.asarray(getattr(fixture, key)) for key in keys}


def _long(array: np.ndarray) -> torch.Tensor:
    return torch.tensor(np.asarray(array), dtype=torch.long)


@functools.cache
def single_process_gradient(fixture_name: str, scheme: str) -> dict[str, np.ndarray]:
    """grad of sum_t c_t l_t: the same model in one process over the whole global batch."""
    fixture = builtin_fixture(fixture_name)
    model = TinyTransformer()
    losses = token_losses(
        model, _long(fixture.inputs), _long(fixture.targets), _long(fixture.segment_ids)
    )
    c = torch.tensor(intended_weights(fixture_name, scheme))
    (c * losses).sum().backward()
    return named_grads(model)


def _label(fixture: str, scheme: str, M: int, strategy: str) -> str:
    return f"{fixture}-{scheme}-M{M}-{strategy}"


@functools.cache
def world_outputs(
    world_size: int, context_size: int = 1, context_order: str = "contiguous"
) -> tuple[list[TransformerOutput], ...]:
    """Every case on R processes, or on R C with every row split over C context ranks, in
    one launch: per process, one output per case."""
    cases = [
        TransformerCase(
            label=_label(fixture, scheme, M, strategy),
            batch=_global_batch(fixture, row_fields),
            scheme=scheme,
            strategy=strategy,
            accum_steps=M,
            context_size=context_size,
            context_order=context_order,
        )
        for fixture, scheme, row_fields in CASES
        for M in ACCUM_STEPS
        for strategy in STRATEGIES
    ]
    processes = world_size * context_size
    return tuple(launch(run_transformer_cases, processes, (cases,), timeout_s=LAUNCH_TIMEOUT_S))


def failures_of(per_process: Sequence[list[TransformerOutput]], where: str) -> list[str]:
    """Every process must hold process 0's update bit for bit, and process 0's must be the
    single-process gradient of the intended objective."""
    expected = {_label(f, s, M, st) for f, s, _ in CASES for M in ACCUM_STEPS for st in STRATEGIES}
    failures = []
    for process, outputs in enumerate(per_process):
        if {o.label for o in outputs} != expected:
            failures.append(f"{where} process {process} ran other cases")
        for out in outputs:
            # The all-reduce hands each process the same reduced bucket, and the division by
            # D is the same on every process. NaN != 0.0 too: NaN never passes.
            if out.max_diff_from_rank0 != 0.0:
                failures.append(
                    f"{where} {out.label} process {process}: off by {out.max_diff_from_rank0!r}"
                )
    for out in per_process[0]:
        fixture, scheme = out.label.split("-")[:2]
        worst = tree_rel_err(out.grads, single_process_gradient(fixture, scheme))
        if not (math.isfinite(worst.max_rel_err) and worst.max_rel_err <= RTOL):
            failures.append(f"{where} {out.label}: {worst.describe()}")
    return failures


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ddp_update_equals_the_single_process_objective(world_size: int) -> None:
    per_rank = world_outputs(world_size)
    assert len(per_rank) == world_size
    assert failures_of(per_rank, f"R={world_size}") == []


#: (R, C, order) of the context-parallel launches: attention across the shards of a row.
CONTEXT_LAYOUTS = ((1, 2, "zigzag"), (2, 2, "contiguous"))


@pytest.mark.parametrize(("R", "C", "order"), CONTEXT_LAYOUTS)
def test_context_parallel_attention_gives_the_single_process_gradient(R, C, order) -> None:
    """Rows split over C context ranks: each shard's queries attend to every shard's keys and
    values (gathered over the row's context group, their gradient summed back), positions
    and the document mask from the whole rows; DDP over all R C processes."""
    per_process = world_outputs(R, C, order)
    assert len(per_process) == R * C
    assert failures_of(per_process, f"R={R} C={C} {order}") == []


def test_the_comparison_tells_the_schemes_apart() -> None:
    """The check has teeth: token_mean's and sequence_mean's gradients on packed differ by
    far more than RTOL, so a step that weighted tokens the wrong way would fail it."""
    a = single_process_gradient("packed", "token_mean")
    b = single_process_gradient("packed", "sequence_mean")
    assert tree_rel_err(a, b).max_rel_err > 1e-2


def test_positions_restart_per_segment_and_attention_stays_inside_it() -> None:
    segments = torch.tensor([[1, 1, 1, 2, 2, 0, 0]])
    assert segment_positions(segments).tolist() == [[0, 1, 2, 0, 1, 0, 0]]
    allowed = attention_allowed(segments)[0].int().tolist()
    assert allowed == [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [0, 0, 0, 1, 0, 0, 0],
        [0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 0, 1, 0],  # padding sees itself only: no empty softmax row
        [0, 0, 0, 0, 0, 0, 1],
    ]


def test_a_packed_document_is_computed_as_if_alone() -> None:
    """Rows packing documents A, B and padding: B's logits equal B's alone at the start of a
    row (its positions restart, it cannot see A). Attention across documents would fail it."""
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, TRANSFORMER_CONFIG.vocab, size=(2, 9))
    packed = torch.tensor([[*a, *b[:6], 0, 0]])
    segments = torch.tensor([[1] * 9 + [2] * 6 + [0, 0]])
    alone = torch.tensor([[*b[:6]] + [0] * 11])
    model = TinyTransformer()
    with torch.no_grad():
        together = model(packed, segments)[0, 9:15]
        by_itself = model(alone, torch.tensor([[3] * 6 + [0] * 11]))[0, :6]
    # The same numbers in the same order, except that the softmax rows carry -inf entries
    # (exactly 0 after exp): float64 rounding only, a few ulps of O(10) logits.
    torch.testing.assert_close(together, by_itself, rtol=0, atol=1e-12)
    assert not torch.equal(model(packed, torch.ones_like(packed))[0, 9:15], by_itself)


def test_weights_map_one_to_one_to_the_shared_file() -> None:
    weights = initial_weights()
    model = TinyTransformer()
    assert {transformer_param_name(k) for k in weights} == {n for n, _ in model.named_parameters()}
    got = named_weights(model)
    assert all(np.array_equal(got[k], weights[k]) for k in weights)
    with pytest.raises(ValueError, match=r"'layer9.qkv' is not a parameter"):
        transformer_param_name("layer9.qkv")


@pytest.mark.parametrize(
    ("inputs", "segments", "message"),
    [
        ([[0, 40]], [[1, 1]], r"input token 40 at row 0, position 1 is outside the vocabulary"),
        ([[0, 1]], [[1, -1]], r"segment id -1 at row 0, position 1 is negative"),
        ([[0, 1]], [[1, 1, 1]], r"must both be \[B, T\], got \(1, 2\) and \(1, 3\)"),
        ([[0] * 129], [[1] * 129], r"rows of 129 tokens exceed the 128 positions"),
    ],
)
def test_bad_input_is_named(inputs, segments, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TinyTransformer()(torch.tensor(inputs), torch.tensor(segments))
    with pytest.raises(
        ValueError, match=r"inputs must be an integer tensor \(int64 or int32\), got torch.float64"
    ):
        TinyTransformer()(torch.zeros(1, 2, dtype=torch.float64), torch.ones(1, 2).long())


def test_the_model_gradient_matches_finite_differences() -> None:
    """A third computation of the derivative: autograd against central differences, on a small
    config so that it is cheap (gradcheck's float64 defaults: eps 1e-6, so truncation ~1e-12
    and rounding ~1e-10 relative, far below its atol 1e-5 and rtol 1e-3)."""
    config = TransformerConfig(vocab=5, width=8, layers=1, heads=2, mlp=8, max_positions=6)
    model = TinyTransformer(config, draw_weights(1, config))
    inputs = torch.tensor([[1, 2, 3, 4, 0, 1]])
    targets = torch.tensor([[2, 3, -100, 0, -100, -100]])
    segments = torch.tensor([[1, 1, 1, 2, 2, 0]])
    state = {name: p.detach() for name, p in model.named_parameters()}
    for name in ("layer0.qkv", "layer0.ln1.scale", "layer0.down", "positions", "embed"):

        def loss(value: torch.Tensor, name: str = name) -> torch.Tensor:
            logits = functional_call(model, state | {name: value}, (inputs, segments))
            return cross_entropy(
                logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum"
            )

        assert torch.autograd.gradcheck(loss, (state[name].clone().requires_grad_(True),))
