"""torch's reading of scheme specs (contract v2): parser, weights, and real DDP/FSDP2 updates.

In-process: the parser's defaults and messages; every rank's c_t = a_t / D_u / K
(``torch_impl.update.layout_weights``, the ranks' own code with the pre-pass summed by
hand) against the numpy oracle (``crosscheck.contract.spec``) and against weights worked out
by hand on a small batch built for the traps (a group over 2 ranks and 2 microbatches, a
document across a row and a microbatch boundary, a fully masked row, signed row weights);
layout invariance of every update-scope spec.

Multi-process (one gloo launch per world size, R in {1, 2, 4}, every case in it): v1's names
give the oracle's gradient, the accidental ones the mean-loss loop's and constant:C sum's over
C; every trainer mode and scope variant gives the oracle's gradient, under DDP with precount
and postnorm and under FSDP2 (precount).
"""

from __future__ import annotations

import functools
import itertools
import math

import numpy as np
import pytest
from mixed_alpha_specs import MIXED_ALPHA_SPECS, reader_weights

from crosscheck import builtin_fixture
from crosscheck.contract.fixture import Fixture
from crosscheck.contract.oracle import weighted_grad
from crosscheck.contract.row_fields import ROW_FIELD_KEYS
from crosscheck.contract.spec import get_spec as oracle_spec
from crosscheck.contract.spec_catalogue import known_spec_names
from crosscheck.judge.compare import assert_tree_close
from torch_impl.batch import BatchError, rank_microbatches
from torch_impl.harness.cases import UpdateCase, run_cases
from torch_impl.harness.launcher import launch
from torch_impl.optimizers import OptimizerSpec
from torch_impl.spec import NAMED_SPECS, DenominatorSpec, SchemeSpec, WeightSpec, get_spec
from torch_impl.update import layout_weights

# float64 throughout. Weights: the same counts, reciprocals and soft factors on both sides,
# summed in another order (D of a weight or power sum over <= 1000 terms): ~1e-15 relative.
# Gradients: sums of a few thousand O(1) products in another order: < 1e-13 (docs/contract.md,
# "Tolerances"); 1e-12 is the project's float64 tolerance.
RTOL = 1e-12
WORLD_SIZES = (1, 2, 4)
ACCUM_STEPS = (1, 2)
STRATEGIES = ("precount", "postnorm")
LAUNCH_TIMEOUT_S = 240.0
V1_FIXTURES = ("seed", "packed", "ragged", "empty-rank", "multimodal", "soft-weights")
V2_FIXTURES = ("rollouts", "continued-documents")
CONFIGURED = 4096.0
MODES = [*known_spec_names(), "constant:4096", "configured_rows_mean:6", "length_power:0.25"]


def _grid() -> list[dict]:
    """Scope variants of the group-counting kinds, and of the others with masks and softs."""
    out = []
    for group, count, scope, kind in itertools.product(
        ("group", "document", "microbatch", "rank", "row", "segment"),
        ("microbatch", "rank", "update"),
        ("microbatch", "rank", "update"),
        ("groups", "all_groups", "power_sum"),
    ):
        alpha = 0.5 if kind == "power_sum" else 1.0
        spec = {
            "weight": {"group": group, "count_scope": count, "alpha": alpha, "mask": "sample"},
            "denominator": {"kind": kind, "group": group, "alpha": alpha, "mask": "sample"},
            "scope": scope,
        }
        out.append(spec)
    for kind, scope, (mask, soft) in itertools.product(
        ("tokens", "weight_sum", "abs_row_weight_sum", "slots", "configured", "one"),
        ("microbatch", "rank", "update"),
        (("valid", "row"), ("sample", "token"), ("nonzero_weight", "none")),
    ):
        value = {"value": 7.0} if kind == "configured" else {}
        spec = {"weight": {"soft": soft}, "denominator": {"kind": kind, "mask": mask, **value}}
        out.append({**spec, "scope": scope})
    return out


def batch_of(fixture: Fixture) -> dict[str, np.ndarray]:
    keys = ("inputs", "targets", "segment_ids", "weights", *ROW_FIELD_KEYS)
    return {key: getattr(fixture, key) for key in keys}


def layouts(fixture: Fixture) -> list[tuple[int, int]]:
    return [(R, M) for R in WORLD_SIZES for M in ACCUM_STEPS if fixture.num_rows % (R * M) == 0]


def oracle_weights(spec, fixture: Fixture, R: int, M: int) -> np.ndarray:
    return oracle_spec(spec).effective_weights(fixture.layout(R, M)).reshape(fixture.targets.shape)


def assert_weights(got: np.ndarray, expected: np.ndarray, what: str) -> None:
    scale = float(np.abs(expected).max()) or 1.0
    err = float(np.abs(got - expected).max()) / scale
    assert math.isfinite(err) and err <= RTOL, f"{what}: max relative error {err:.3g}"


# -- the parser ---------------------------------------------------------------------------


def test_empty_spec_is_token_mean_and_names_round_trip() -> None:
    assert get_spec({}) == SchemeSpec() == get_spec("token_mean").__class__()
    assert get_spec({}).weight == WeightSpec() and get_spec({}).denominator == DenominatorSpec()
    for name in [*NAMED_SPECS, *MODES]:
        ours = get_spec(name)
        again = get_spec(ours.to_dict())
        assert again == ours, name
        # The oracle's JSON form (with its "name" key) reads as the same spec.
        theirs = get_spec(oracle_spec(name).to_dict())
        assert theirs.to_dict() == ours.to_dict() | {"name": theirs.name}, name
    assert get_spec("length_power").weight.alpha == 0.5
    assert get_spec("constant:10").denominator.value == 10.0


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"weights": {}}, r"unknown key\(s\) \['weights'\]; allowed: weight, denominator"),
        ({"weight": {"grup": "row"}}, r"spec weight has unknown key\(s\) \['grup'\]"),
        ({"weight": {"mask": "nonzero_weight"}}, "weight.mask must be one of valid, sample"),
        ({"weight": {"soft": "abs"}}, "weight.soft must be one of none, token, row"),
        ({"weight": {"alpha": True}}, "weight.alpha must be a finite number"),
        ({"weight": {"alpha": math.inf}}, "weight.alpha must be a finite number"),
        ({"weight": {"count_scope": "global"}}, "count_scope must be one of microbatch, rank"),
        ({"denominator": {"kind": "rows"}}, "denominator.kind must be one of tokens, groups"),
        ({"denominator": {"kind": "configured"}}, "value is required by kind 'configured'"),
        ({"denominator": {"kind": "configured", "value": 0}}, "value must be > 0"),
        ({"denominator": {"value": 3}}, "only read by kind 'configured', not 'tokens'"),
        ({"denominator": {"kind": "groups"}}, "counts groups: denominator.group must be"),
        ({"denominator": {"mask": "weights"}}, "mask must be one of valid, sample, nonzero"),
        ({"scope": "global"}, "spec .scope must be one of microbatch, rank, update"),
        ("rank_means", "unknown spec 'rank_means'; named specs: token_mean"),
        ("length_power:x", "'x' after ':' is not a number"),
        ("constant:-1", "must be finite and > 0"),
        ([], "a spec is a dict"),
    ],
)
def test_bad_specs_name_the_key_and_the_choices(spec, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        get_spec(spec)


def _hand_batch(**changes) -> dict[str, np.ndarray]:
    batch = {key: np.array(value) for key, value in batch_of(hand_fixture()).items()}
    for key, (index, value) in changes.items():
        batch[key][index] = value
    return batch


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"sample_mask": (5, 2)}, "rank 1, microbatch 0, row 1 (global row 5), position 0: sam"),
        ({"group_ids": (3, -1)}, "rank 0, microbatch 1, row 1 (global row 3), position 0: gro"),
        (
            {"document_ids": ((6, 2), 0)},
            "rank 1, microbatch 1, row 0 (global row 6), position 2: valid target in document 0",
        ),
        ({"row_weights": (0, math.nan)}, "row 0 (global row 0), position 0: row weight nan"),
    ],
)
def test_bad_row_fields_name_rank_microbatch_row(change: dict, message: str) -> None:
    with pytest.raises(BatchError) as failure:
        for rank in range(2):
            for batch in rank_microbatches(_hand_batch(**change), rank, 2, 2):
                batch.validate(40)
    assert message in str(failure.value)
    with pytest.raises(BatchError, match=r"group_ids has shape \(7,\), expected \(8,\)"):
        rank_microbatches(dict(_hand_batch(), group_ids=np.zeros(7, dtype=int)), 0, 2, 2)


# -- weights in one process ---------------------------------------------------------------


@pytest.mark.parametrize("fixture", V1_FIXTURES + V2_FIXTURES)
def test_named_specs_match_the_oracle(fixture: str) -> None:
    fx = builtin_fixture(fixture)
    for (R, M), name in itertools.product(layouts(fx), MODES):
        got = layout_weights(name, batch_of(fx), R, M).numpy()
        assert_weights(got, oracle_weights(name, fx, R, M), f"{fixture} R={R} M={M} {name}")


@pytest.mark.parametrize("fixture", V2_FIXTURES)
def test_scope_variants_match_the_oracle(fixture: str) -> None:
    fx = builtin_fixture(fixture)
    for (R, M), spec in itertools.product(layouts(fx), _grid()):
        got = layout_weights(spec, batch_of(fx), R, M).numpy()
        assert_weights(got, oracle_weights(spec, fx, R, M), f"{fixture} R={R} M={M} {spec}")


@pytest.mark.parametrize("fixture", V2_FIXTURES)
def test_power_sums_with_their_own_alpha_match_the_independent_reader(fixture: str) -> None:
    """D's exponent is the denominator's, not the weight's (tests/mixed_alpha_specs.py)."""
    fx = builtin_fixture(fixture)
    for (R, M), (name, spec) in itertools.product(layouts(fx), MIXED_ALPHA_SPECS.items()):
        got = layout_weights(spec, batch_of(fx), R, M).numpy()
        assert_weights(got, reader_weights(fx, spec, R, M), f"{fixture} R={R} M={M} {name}")


def test_update_scope_specs_are_layout_invariant() -> None:
    """The same c_t for every layout (R, M) of one batch, unless a spanning count is local."""
    checked = 0
    for fixture, spec in itertools.product((*V2_FIXTURES, "packed"), [*MODES, *_grid()]):
        if not oracle_spec(spec).layout_invariant:
            continue
        fx = builtin_fixture(fixture)
        reference = layout_weights(spec, batch_of(fx), 1, 1).numpy()
        for R, M in fx.valid_layouts(max_world_size=8, max_accum_steps=8):
            got = layout_weights(spec, batch_of(fx), R, M).numpy()
            assert_weights(got, reference, f"{fixture} R={R} M={M} {spec}")
            checked += 1
    assert checked > 1000


def hand_fixture() -> Fixture:
    """8 rows x 4, laid out (2, 2) as rows {0,1} {2,3} | {4,5} {6,7} (rank 0 | rank 1).

    valid tokens per row 4 4 3 2 0 4 3 4 (row 4 fully masked; row 2 ends in padding);
    group_ids 0 1 0 2 1 2 3 0: group 0 lies on rows 0, 2, 7 (both ranks, both microbatches of
    rank 0); document 5 runs from the end of row 1 into row 2 (a row and a microbatch
    boundary); row_weights of both signs; sample_mask drops rows 2 and 7.
    """
    base = builtin_fixture("packed")
    rng = np.random.default_rng(7)
    rank0 = [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]]
    valid = np.array([*rank0, [0, 0, 0, 0], [1, 1, 1, 1], [1, 0, 1, 1], [1, 1, 1, 1]])
    segments = np.ones((8, 4), dtype=np.int64)
    segments[1, 2:] = 2
    segments[2, 2] = 2
    segments[2, 3] = segments[3, 2:] = 0
    rank0 = [[1, 1, 1, 1], [2, 2, 5, 5], [5, 5, 6, 0], [7, 7, 0, 0]]
    documents = np.array([*rank0, [8] * 4, [9] * 4, [10] * 4, [11] * 4])
    return Fixture(
        name="hand",
        description="the traps of test_torch_spec, small enough to weigh by hand",
        inputs=np.where(segments > 0, rng.integers(0, 40, (8, 4)), 0),
        targets=np.where(valid == 1, rng.integers(0, 40, (8, 4)), -100),
        segment_ids=segments,
        weights=rng.uniform(0.5, 2.0, (8, 4)),
        embed=base.embed,
        unembed=base.unembed,
        group_ids=np.array([0, 1, 0, 2, 1, 2, 3, 0]),
        document_ids=documents,
        row_weights=np.array([1.0, -0.5, 2.0, 0.25, -1.5, 0.75, 1.0, -2.0]),
        sample_mask=np.array([1, 1, 0, 1, 1, 1, 1, 0]),
    )


#: c_t per row on its valid tokens (a float) or per token ([8][4]), worked out by hand at
#: layout (2, 2) from hand_fixture's docstring. Group valid counts: g0 4+3+4 = 11, g1 4,
#: g2 2+4 = 6, g3 3; 4 non-empty groups; 8 non-empty documents (doc 8 is row 4's, empty).
_LP = 2.0 + 2.0 / math.sqrt(3.0) + 1.0 / math.sqrt(2.0)  # sum over non-empty rows of n^-1/2
HAND: dict[str, tuple[str | dict, list]] = {
    "group_token_mean": (
        "group_token_mean",
        [1 / 44, 1 / 16, 1 / 44, 1 / 24, 0, 1 / 24, 1 / 12, 1 / 44],
    ),
    # The verl#2776 bug: counts per microbatch (g0: 4 | 3 | 4), D still 4 groups.
    "group_count_microbatch": (
        {
            "weight": {"group": "group", "count_scope": "microbatch"},
            "denominator": {"kind": "groups", "group": "group"},
        },
        [1 / 16, 1 / 16, 1 / 12, 1 / 8, 0, 1 / 16, 1 / 12, 1 / 16],
    ),
    "document_mean": (
        "document_mean",
        [
            *([1 / 32] * 4, [1 / 16, 1 / 16, 1 / 32, 1 / 32], [1 / 32, 1 / 32, 1 / 8, 0]),
            *([1 / 16, 1 / 16, 0, 0], [0] * 4, [1 / 32] * 4, [1 / 24, 0, 1 / 24, 1 / 24]),
            [1 / 32] * 4,
        ],
    ),
    # 6 rows with sample_mask = 1, row 4 (no valid token) included.
    "sample_rows_mean": ("sample_rows_mean", [1 / 24, 1 / 24, 0, 1 / 12, 0, 1 / 24, 1 / 18, 0]),
    "all_rows_mean": ("all_rows_mean", [1 / 32, 1 / 32, 1 / 24, 1 / 16, 0, 1 / 32, 1 / 24, 1 / 32]),
    # sum |row_weights| = 9, every row counted.
    "signed_row_weight_mean": (
        "signed_row_weight_mean",
        [1 / 36, -0.5 / 36, 2 / 27, 0.25 / 18, 0, 0.75 / 36, 1 / 27, -2 / 36],
    ),
    # numerator: every valid token; denominator: valid tokens of sample rows, 17.
    "zero_variance_excluded": ("zero_variance_excluded", [1 / 17] * 4 + [0] + [1 / 17] * 3),
    "length_power": (
        "length_power:0.5",
        [n**-0.5 / _LP if n else 0 for n in (4, 4, 3, 2, 0, 4, 3, 4)],
    ),
    # rank 0 holds 13 valid tokens, rank 1 11; K = 2.
    "rank_mean": ("rank_mean", [1 / 26] * 4 + [1 / 22] * 4),
    # power_sum over (microbatch, group) cells with microbatch counts: cells 4, 4 | 3, 2 |
    # (row 4: empty), 4 | 3, 4: D = 13/6, a_t = 1 / cell count (see _power_edge).
    "power_cells": (
        {
            "weight": {"group": "group", "count_scope": "microbatch"},
            "denominator": {"kind": "power_sum", "group": "group"},
        },
        [6 / 52, 6 / 52, 6 / 39, 6 / 26, 0, 6 / 52, 6 / 39, 6 / 52],
    ),
}


def hand_weights(table: list) -> np.ndarray:
    fx = hand_fixture()
    rows = [row if isinstance(row, list) else [row] * 4 for row in table]
    return np.where(fx.targets != -100, np.array(rows, dtype=np.float64), 0.0)


@pytest.mark.parametrize("case", HAND)
def test_hand_batch_weights(case: str) -> None:
    spec, table = HAND[case]
    got = layout_weights(spec, batch_of(hand_fixture()), 2, 2).numpy()
    assert_weights(got, hand_weights(table), case)


# -- real processes: one launch per world size ---------------------------------------------

SGD = OptimizerSpec(name="sgd", learning_rate=0.1)
V1_SCHEMES = ("token_mean", "sequence_mean", "row_mean", "weighted_mean", "constant", "sum")
#: Scope variants run in processes too (the in-process grid covers the rest): a group count
#: at every count scope, local denominators over spanning groups, a sibling-style local term.
PROCESS_GRID = [
    {
        "weight": {"group": "group", "count_scope": "rank"},
        "denominator": {"kind": "groups", "group": "group"},
    },
    {
        "weight": {"group": "document"},
        "denominator": {"kind": "all_groups", "group": "document"},
        "scope": "rank",
    },
    {
        "weight": {"group": "group", "alpha": 0.5},
        "denominator": {"kind": "power_sum", "group": "group", "alpha": 0.5},
    },
    {
        "weight": {"group": "group"},
        "denominator": {"kind": "power_sum", "group": "group"},
        "scope": "microbatch",
    },
    {
        "weight": {"soft": "row", "mask": "sample"},
        "denominator": {"kind": "weight_sum", "mask": "nonzero_weight"},
        "scope": "rank",
    },
    {"weight": {"group": "microbatch"}, "denominator": {"kind": "groups", "group": "rank"}},
]
FSDP_SPECS = ["group_token_mean", "document_mean", "length_power:0.5", "rank_mean", PROCESS_GRID[1]]


def _spec_case(fx: Fixture, label: str, spec, M: int, strategy: str, **kw) -> UpdateCase:
    """One update of `spec` (or the mean-loss loop), its reduced gradient before the step."""
    return UpdateCase(
        label=label,
        batch=batch_of(fx),
        params=fx.params(),
        scheme=spec,
        strategy=strategy,
        accum_steps=M,
        optimizer=SGD,
        num_updates=1,
        max_grad_norm=None,
        **kw,
    )


def _fixture(name: str) -> Fixture:
    return hand_fixture() if name == "hand" else builtin_fixture(name)


def cases_for(R: int) -> list:
    cases: list = []
    for name in V1_FIXTURES:
        fx = builtin_fixture(name)
        for M in (M for M in ACCUM_STEPS if fx.num_rows % (R * M) == 0):
            cases.append(_spec_case(fx, f"v1-{name}-{M}-mean_loss", "token_mean", M, "mean_loss"))
            for strategy in STRATEGIES:
                for spec in (
                    *V1_SCHEMES,
                    f"constant:{CONFIGURED:g}",
                    "rank_mean",
                    "microbatch_mean",
                ):
                    cases.append(
                        _spec_case(fx, f"spec-{name}-{M}-{spec}-{strategy}", spec, M, strategy)
                    )
    for name in (*V2_FIXTURES, "hand"):
        fx = _fixture(name)
        for M in (M for M in ACCUM_STEPS if fx.num_rows % (R * M) == 0):
            for strategy, (i, spec) in itertools.product(
                STRATEGIES, enumerate(MODES + PROCESS_GRID)
            ):
                cases.append(_spec_case(fx, f"mode-{name}-{M}-{i}-{strategy}", spec, M, strategy))
    if R > 1:
        fx = builtin_fixture("rollouts")
        for divide, (i, spec) in itertools.product((None, 1.0), enumerate(FSDP_SPECS)):
            cases.append(
                _spec_case(
                    fx,
                    f"fsdp-{divide}-{i}",
                    spec,
                    2,
                    "precount",
                    front_end="fsdp2",
                    fsdp_divide_factor=divide,
                )
            )
    if R > 1:
        # The ranks agree on the id bounds themselves (one MAX all-reduce before the pre-pass).
        for name, spec in (
            ("rollouts", "group_token_mean"),
            ("continued-documents", "document_mean"),
        ):
            fx = builtin_fixture(name)
            for strategy in STRATEGIES:
                label = f"agree-{name}-{strategy}"
                cases.append(_spec_case(fx, label, spec, 2, strategy, pass_id_bounds=False))
    if R == 2:
        fx = hand_fixture()
        for strategy, case in itertools.product(STRATEGIES, HAND):
            cases.append(_spec_case(fx, f"hand-{case}-{strategy}", HAND[case][0], 2, strategy))
    return cases


@functools.cache
def world(R: int) -> dict[str, list]:
    """label -> every rank's output, for every case of `cases_for(R)` (one launch)."""
    cases = cases_for(R)
    per_rank = launch(run_cases, R, (cases,), timeout_s=LAUNCH_TIMEOUT_S)
    return {case.label: [outputs[i] for outputs in per_rank] for i, case in enumerate(cases)}


@functools.cache
def oracle_grad(fixture: str, spec_key: str, R: int, M: int):
    fx = _fixture(fixture)
    spec = MODES[int(spec_key)] if spec_key.isdigit() and int(spec_key) < len(MODES) else None
    if spec is None:
        spec = PROCESS_GRID[int(spec_key) - len(MODES)] if spec_key.isdigit() else spec_key
    return weighted_grad(fx.params(), fx.inputs, fx.targets, oracle_weights(spec, fx, R, M))


def _grads(outputs: list) -> list[dict[str, np.ndarray]]:
    return [o.updates[0].grads for o in outputs]


@pytest.mark.parametrize("R", WORLD_SIZES)
def test_v1_names_give_the_oracle_and_the_mean_loss_loops_gradients(R: int) -> None:
    """v1's names read as specs: the oracle's gradient (until v1's own torch path was folded
    into the spec, this test held the two torch paths to each other); the accidental ones
    the mean-loss loop's, and constant:C sum's over C."""
    results, checked = world(R), 0
    for name in V1_FIXTURES:
        fx = builtin_fixture(name)
        for M in (M for M in ACCUM_STEPS if fx.num_rows % (R * M) == 0):
            mean_loss = _grads(results[f"v1-{name}-{M}-mean_loss"])
            for strategy in STRATEGIES:
                prefix = f"spec-{name}-{M}"
                for scheme in V1_SCHEMES:
                    want = oracle_grad(name, scheme, R, M)
                    for got in _grads(results[f"{prefix}-{scheme}-{strategy}"]):
                        assert_tree_close(
                            got, want, RTOL, f"R={R} {name} M={M} {scheme} {strategy}"
                        )
                # constant:C is sum's gradient over C.
                summed = _grads(results[f"{prefix}-sum-{strategy}"])
                for got, want in zip(
                    _grads(results[f"{prefix}-constant:{CONFIGURED:g}-{strategy}"]),
                    summed,
                    strict=True,
                ):
                    scaled = {k: v / CONFIGURED for k, v in want.items()}
                    assert_tree_close(got, scaled, RTOL, f"R={R} {name} M={M} constant:C")
                # reduction="mean" per microbatch is microbatch_mean, and rank_mean at M = 1.
                accidental = ["microbatch_mean"] + (["rank_mean"] if M == 1 else [])
                for s in accidental:
                    for got, want in zip(
                        _grads(results[f"{prefix}-{s}-{strategy}"]), mean_loss, strict=True
                    ):
                        assert_tree_close(got, want, RTOL, f"R={R} {name} M={M} {s} {strategy}")
                for got in _grads(results[f"{prefix}-rank_mean-{strategy}"]):
                    want = oracle_grad(name, "rank_mean", R, M)
                    assert_tree_close(got, want, RTOL, f"R={R} {name} M={M} rank_mean {strategy}")
                checked += 1
    assert checked >= {1: 12, 2: 11, 4: 5}[R]


@pytest.mark.parametrize("fixture", (*V2_FIXTURES, "hand"))
@pytest.mark.parametrize("R", WORLD_SIZES)
def test_modes_give_the_oracle_gradient(R: int, fixture: str) -> None:
    results, fx = world(R), _fixture(fixture)
    Ms = [M for M in ACCUM_STEPS if fx.num_rows % (R * M) == 0]
    for M, strategy, i in itertools.product(Ms, STRATEGIES, range(len(MODES + PROCESS_GRID))):
        label = f"mode-{fixture}-{M}-{i}-{strategy}"
        want = oracle_grad(fixture, str(i), R, M)
        for rank, got in enumerate(_grads(results[label])):
            assert_tree_close(got, want, RTOL, f"R={R} {label} rank {rank}")
    assert Ms


@pytest.mark.parametrize("R", (2, 4))
def test_fsdp2_precount_gives_the_oracle_gradient(R: int) -> None:
    fx, results = builtin_fixture("rollouts"), world(R)
    for divide, (i, spec) in itertools.product((None, 1.0), enumerate(FSDP_SPECS)):
        outputs = results[f"fsdp-{divide}-{i}"]
        assert {o.reduce_factor for o in outputs} == {1.0 if divide else float(R)}
        want = weighted_grad(fx.params(), fx.inputs, fx.targets, oracle_weights(spec, fx, R, 2))
        for o in outputs:
            assert_tree_close(o.updates[0].grads, want, RTOL, f"R={R} FSDP2 divide={divide} {spec}")


@pytest.mark.parametrize("R", (2, 4))
def test_ranks_agree_on_id_bounds_when_not_given(R: int) -> None:
    results = world(R)
    for (name, spec), strategy in itertools.product(
        (("rollouts", "group_token_mean"), ("continued-documents", "document_mean")), STRATEGIES
    ):
        fx = builtin_fixture(name)
        want = weighted_grad(fx.params(), fx.inputs, fx.targets, oracle_weights(spec, fx, R, 2))
        for o in results[f"agree-{name}-{strategy}"]:
            what = f"R={R} {name} {spec} {strategy} agreed"
            assert_tree_close(o.updates[0].grads, want, RTOL, what)


def test_hand_batch_in_processes() -> None:
    """R = 2, M = 2 against the hand-computed weights, with the D each rank reports."""
    fx, results = hand_fixture(), world(2)
    expected_D = {"group_token_mean": (4.0,), "document_mean": (8.0,), "length_power": (_LP,)}
    for case, strategy in itertools.product(HAND, STRATEGIES):
        want = weighted_grad(fx.params(), fx.inputs, fx.targets, hand_weights(HAND[case][1]))
        for o in results[f"hand-{case}-{strategy}"]:
            got = o.updates[0]
            assert_tree_close(got.grads, want, RTOL, f"hand {case} {strategy} rank {o.rank}")
            if case in expected_D:
                assert got.metrics.unit_denominators == pytest.approx(expected_D[case], rel=1e-15)
    rank_mean = [o.updates[0].metrics for o in results["hand-rank_mean-precount"]]
    # Scope rank: each rank's own D (13 and 11 valid tokens), K = 2.
    assert [m.unit_denominators for m in rank_mean] == [(13.0,), (11.0,)]
    assert {m.num_units for m in rank_mean} == {2}


#: Specs whose counts span ranks (a pre-pass on resume too) or are local to a unit.
RESUME_SPECS = ("group_token_mean", "document_mean", "rank_mean", "length_power:0.5")


def _finish(model, state, strategy: str, microbatches, spec, resume=None):
    """The rest of an update (all of it without `resume`) under `strategy`; DDP averages, so
    precount's s is R."""
    import torch.distributed as dist

    from torch_impl.update import accumulate_postnorm, accumulate_precount

    if strategy == "precount":
        return accumulate_precount(
            model, microbatches, spec, vocab_size=40, reduce_factor=dist.get_world_size(),
            resume=resume,
        )  # fmt: skip
    return accumulate_postnorm(
        model, microbatches, spec, vocab_size=40, hook_state=state, resume=resume
    )


def _window_resume(rank: int, world_size: int, batch: dict, params: dict) -> dict:
    """Every RESUME_SPECS x strategy at M = 4, stopped after 2 microbatches and resumed in the
    same process from the partial state and the local .grad, next to the update uninterrupted;
    and a precount resume handed another batch. Returns what each rank saw."""
    from torch.nn.parallel import DistributedDataParallel

    from torch_impl.comm_hooks import PostnormState, sum_and_carry_hook
    from torch_impl.model import BilinearLM, numpy_grads
    from torch_impl.partial import ResumeMismatchError
    from torch_impl.update import accumulate_partial

    assert int(params["embed"].shape[0]) == 40  # _finish's vocabulary
    microbatches = rank_microbatches(batch, rank, world_size, 4)
    out: dict = {}
    for strategy in STRATEGIES:
        model = DistributedDataParallel(BilinearLM.from_numpy(params))
        state = None
        if strategy == "postnorm":
            state = PostnormState(rank=rank, world_size=world_size)
            model.register_comm_hook(state, sum_and_carry_hook)
        for spec in RESUME_SPECS:
            model.zero_grad(set_to_none=True)
            whole = _finish(model, state, strategy, microbatches, spec)
            uninterrupted = numpy_grads(model)
            model.zero_grad(set_to_none=True)
            partial = accumulate_partial(
                model, microbatches, spec, strategy=strategy, vocab_size=40,
                num_microbatches=2, reduce_factor=world_size,
            )  # fmt: skip
            resumed = _finish(model, state, strategy, microbatches, spec, partial)
            out[spec, strategy] = (uninterrupted, numpy_grads(model), whole, resumed)
    # precount: a resume whose batch now counts differently is refused on every rank.
    model = DistributedDataParallel(BilinearLM.from_numpy(params))
    partial = accumulate_partial(
        model, microbatches, "token_mean", strategy="precount", vocab_size=40,
        num_microbatches=2, reduce_factor=world_size,
    )  # fmt: skip
    other = dict(batch, targets=np.where(batch["targets"] == 3, -100, batch["targets"]))
    changed = rank_microbatches(other, rank, world_size, 4)
    try:
        _finish(model, None, "precount", changed, "token_mean", partial)
        out["mismatch"] = None
    except ResumeMismatchError as exc:
        out["mismatch"] = str(exc)
    return out


def test_every_spec_resumes_inside_its_accumulation_window() -> None:
    """A spec update stopped after 2 of 4 microbatches and resumed from its partial state is
    the uninterrupted update bit for bit (the plan, pre-pass included, is recomputed from the
    labels), under precount and postnorm; precount refuses a batch that changed."""
    fx = builtin_fixture("rollouts")
    batch = batch_of(fx)
    per_rank = launch(_window_resume, 2, (batch, fx.params()), timeout_s=LAUNCH_TIMEOUT_S)
    for rank, out in enumerate(per_rank):
        for spec, strategy in itertools.product(RESUME_SPECS, STRATEGIES):
            uninterrupted, resumed, whole, again = out[spec, strategy]
            for key, grad in uninterrupted.items():
                assert np.array_equal(resumed[key], grad), f"rank {rank} {spec} {strategy} {key}"
            assert again == whole, f"rank {rank} {spec} {strategy}: {again} != {whole}"
        # And the resumed gradient is the oracle's (not merely equal to a shared mistake).
        want = weighted_grad(
            fx.params(), fx.inputs, fx.targets, oracle_weights("group_token_mean", fx, 2, 4)
        )
        assert_tree_close(out["group_token_mean", "postnorm"][1], want, RTOL, f"rank {rank}")
        assert "the resumed update does not see the batch it started on" in out["mismatch"]
