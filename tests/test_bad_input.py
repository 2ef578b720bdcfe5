"""Bad input is named with what, where and why, in all three implementations (issue 13).

Each implementation validates on its own (no shared code): the numpy fixture and layout
(`crosscheck.contract.fixture`, `crosscheck.contract.layout`), torch (`torch_impl.batch`, and the
pre-check of `torch_impl.update`, on real gloo ranks) and JAX (`jax_impl.batch`). Every case asserts
the exception type and its message: the array, the row and position (and under a layout the rank
and microbatch), and why the value is refused.

Then what only shows while running: a NaN or inf loss sum or gradient is reported with the rank
and microbatch where it first appeared (torch raises inside the update; JAX checks after the
compiled step, outside jit), and torch ranks handed different numbers of microbatches fail
before any other collective, naming every rank's count, instead of deadlocking.

jax_impl's multi-process worker cannot be handed different microbatch counts per process:
every process reads the same spec (one ``accum_steps`` per case) and lays out the same global
batch file, then takes its own rank's rows (`jax_impl.harness.multiprocess_worker.run_spec`).
"""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
from torch.nn.parallel import DistributedDataParallel

from crosscheck.contract.fixture import NPZ_KEYS, Fixture, FixtureError
from crosscheck.contract.layout import Layout, lay_out
from crosscheck.fixtures.builtin import builtin_fixture
from torch_impl.batch import BATCH_KEYS, BatchError, TokenBatch, rank_microbatches
from torch_impl.comm_hooks import PostnormState, sum_and_carry_hook
from torch_impl.harness.launcher import RankFailedError, launch
from torch_impl.model import BilinearLM
from torch_impl.update import (
    NonFiniteError as TorchNonFiniteError,
)
from torch_impl.update import (
    RankMismatchError,
    accumulate_partial,
    accumulate_postnorm,
    accumulate_precount,
)

V = 40  # the built-in fixtures' vocabulary
#: A token whose first use as an input is row 5 of `packed`: at (R, M) = (2, 2) that is rank 1,
#: microbatch 0 (rows 4-5), so a NaN from its embedding first appears there.
LATE_TOKEN = 5
#: Every launch here does one small update; failures are bounded by the pre-check timeout.
LAUNCH_TIMEOUT_S = 60.0


def _packed_arrays() -> dict[str, np.ndarray]:
    fixture = builtin_fixture("packed")
    return {key: np.array(getattr(fixture, key)) for key in NPZ_KEYS}


def _valid_position(arrays: dict[str, np.ndarray], row: int) -> int:
    """The first position of `row` whose target carries a loss."""
    return int(np.flatnonzero(arrays["targets"][row] != -100)[0])


# ---- what is refused, and the words for it: one table for all three implementations ---------

#: (case id, change to the packed arrays) -> the change is applied by `_bad`.
#: Each change is (key, row, position, value), or (key, None, None, array) for a whole array.
CHANGES = {
    "target-too-big": ("targets", 3, "valid", 40),
    "target-below-ignore": ("targets", 3, "valid", -101),
    "target-negative": ("targets", 3, "valid", -5),
    "input-negative": ("inputs", 6, 2, -1),
    "input-too-big": ("inputs", 6, 2, 40),
    "segment-negative": ("segment_ids", 1, 4, -2),
    "weight-negative": ("weights", 7, 3, -0.5),
    "weight-inf": ("weights", 2, 0, np.inf),
    "weight-nan": ("weights", 0, 1, np.nan),
    "targets-float-whole": ("targets", None, None, "float-whole"),
    "targets-float-fraction": ("targets", None, None, "float-fraction"),
    "inputs-float-whole": ("inputs", None, None, "float-whole"),
    "weights-integer": ("weights", None, None, "integer"),
    "weights-short": ("weights", None, None, "short"),
    "segments-short": ("segment_ids", None, None, "short"),
    "inputs-1d": ("inputs", None, None, "flat"),
}


def _bad(change: str) -> tuple[dict[str, np.ndarray], int | None, int | None]:
    """The packed arrays with one change; returns them and the (row, position) changed."""
    arrays = _packed_arrays()
    key, row, pos, value = CHANGES[change]
    if row is not None:
        pos = _valid_position(arrays, row) if pos == "valid" else pos
        arrays[key][row, pos] = value
        return arrays, row, pos
    array = arrays[key]
    if value == "float-whole":
        arrays[key] = array.astype(np.float64)
    elif value == "float-fraction":
        arrays[key] = array.astype(np.float64)
        arrays[key][2, 5] = 2.5
    elif value == "integer":
        arrays[key] = np.ones(array.shape, dtype=np.int64)
    elif value == "short":
        arrays[key] = array[:, :-1]
    elif value == "flat":
        arrays[key] = array.ravel()
    return arrays, None, None


def _numpy_expected(change: str, row: int | None, pos: int | None) -> str:
    """The numpy fixture's message (its own words: it knows no ranks)."""
    where = f"at row {row}, position {pos}"
    return {
        "target-too-big": f"target 40 {where} is neither -100 (ignored) nor in the vocabulary",
        "target-below-ignore": f"target -101 {where} is neither -100 (ignored) nor in",
        "target-negative": f"target -5 {where} is neither -100 (ignored) nor in",
        "input-negative": f"input token -1 {where} is outside the vocabulary [0, 40)",
        "input-too-big": f"input token 40 {where} is outside the vocabulary [0, 40)",
        "segment-negative": f"negative segment id {where}",
        "weight-negative": f"weight -0.5 {where} must be finite and >= 0",
        "weight-inf": f"weight inf {where} must be finite and >= 0",
        "weight-nan": f"weight nan {where} must be finite and >= 0",
        "targets-float-whole": "targets must be an integer array, got float64 holding whole "
        "numbers: cast it with .astype(np.int64)",
        "targets-float-fraction": "targets must be an integer array, got float64 with the "
        "non-integer value 2.5 at row 2, position 5",
        "inputs-float-whole": "inputs must be an integer array, got float64 holding whole",
        "weights-integer": "weights must be a floating-point array (soft per-token weights), "
        "got int64",
        "weights-short": "weights has shape (8, 63), targets have (8, 64)",
        "segments-short": "segment_ids has shape (8, 63), targets have (8, 64)",
        "inputs-1d": "inputs has shape (512,), targets have (8, 64)",
    }[change]


@pytest.mark.parametrize("change", CHANGES)
def test_numpy_fixture_names_what_where_and_why(change: str) -> None:
    arrays, row, pos = _bad(change)
    with pytest.raises(FixtureError) as failure:
        Fixture(name="user", description="", **arrays)
    message = str(failure.value)
    assert message.startswith("fixture 'user': ")
    assert _numpy_expected(change, row, pos) in message


def test_numpy_layout_refuses_mismatched_arrays_and_non_integer_layouts() -> None:
    arrays = _packed_arrays()
    with pytest.raises(ValueError, match=r"lay_out: weights has shape \(8, 63\), targets have"):
        lay_out(
            arrays["inputs"],
            arrays["targets"],
            arrays["segment_ids"],
            arrays["weights"][:, :-1],
            Layout(2, 2),
        )
    with pytest.raises(ValueError, match=r"lay_out: targets must be \[N, T\], got shape \(512,\)"):
        flat = {key: value.ravel() for key, value in arrays.items()}
        lay_out(flat["inputs"], flat["targets"], flat["segment_ids"], flat["weights"], Layout(1, 1))
    with pytest.raises(ValueError, match=r"layout world_size must be an integer, got 2\.0"):
        Layout(2.0, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="layout accum_steps must be an integer, got True"):
        Layout(1, True)


# ---- torch: per microbatch, with rank and microbatch ------------------------------------------


def _torch_expected(change: str, row: int | None, pos: int | None) -> str:
    """torch's message: the rank and microbatch at (R, M) = (2, 2), B = 2 rows each."""
    if row is not None:
        block, local = divmod(row, 2)
        rank, step = divmod(block, 2)
        where = f"rank {rank}, microbatch {step}, row {local} (global row {row}), position {pos}"
        neither = "is neither -100 (ignored) nor in the vocabulary [0, 40)"
        why = {
            "target-too-big": f"target 40 {neither}",
            "target-below-ignore": f"target -101 {neither}",
            "target-negative": f"target -5 {neither}",
            "input-negative": "input token -1 is outside [0, 40)",
            "input-too-big": "input token 40 is outside [0, 40)",
            "segment-negative": "segment id -2 is negative",
            "weight-negative": "weight -0.5 must be finite and >= 0",
            "weight-inf": "weight inf must be finite and >= 0",
            "weight-nan": "weight nan must be finite and >= 0",
        }[change]
        return f"{where}: {why}"
    return {
        "targets-float-whole": "targets must be integers, got float64 holding whole numbers: "
        "cast it with .astype(np.int64)",
        "targets-float-fraction": "targets must be integers, got float64 with the non-integer "
        "value 2.5 at global row 2, position 5",
        "inputs-float-whole": "inputs must be integers, got float64 holding whole numbers",
        "weights-integer": "weights must be floating point (soft per-token weights), got int64",
        "weights-short": "weights has shape (8, 63), targets have (8, 64)",
        "segments-short": "segment_ids has shape (8, 63), targets have (8, 64)",
        "inputs-1d": "inputs has shape (512,), targets have (8, 64)",
    }[change]


@pytest.mark.parametrize("change", CHANGES)
def test_torch_names_rank_microbatch_row_position_and_why(change: str) -> None:
    """Keys, shapes and dtypes fail in `rank_microbatches` (the whole batch, before any
    split); token values in `TokenBatch.validate`, the check every update runs first."""
    arrays, row, pos = _bad(change)
    batch = {key: arrays[key] for key in BATCH_KEYS}
    with pytest.raises(BatchError) as failure:
        for rank in range(2):
            for microbatch in rank_microbatches(batch, rank, 2, 2):
                microbatch.validate(V)
    assert _torch_expected(change, row, pos) in str(failure.value)


def test_torch_token_batch_refuses_wrong_dtypes_it_is_handed_directly() -> None:
    """A TokenBatch built by hand (not through rank_microbatches) is checked too."""
    good = rank_microbatches(
        {k: v for k, v in _packed_arrays().items() if k in BATCH_KEYS}, 1, 2, 2
    )
    batch = good[1]
    cases = [
        (batch._replace(targets=batch.targets.double()), "targets must be an integer tensor, "
         "got torch.float64 holding whole numbers: convert it with .long()"),
        (batch._replace(inputs=batch.inputs.bool()), "inputs must be an integer tensor, got "
         "torch.bool"),
        (batch._replace(weights=batch.weights.long()), "weights must be a floating-point "
         "tensor (soft per-token weights), got torch.int64"),
        (batch._replace(weights=batch.weights[:, :-1]), "weights has shape (2, 63), targets "
         "have (2, 64)"),
    ]  # fmt: skip
    for bad, message in cases:
        with pytest.raises(BatchError) as failure:
            bad.validate(V)
        assert str(failure.value) == f"rank 1, microbatch 1: {message}"
    with pytest.raises(BatchError, match=r"the batch is missing \['weights'\]"):
        rank_microbatches(
            {k: v for k, v in _packed_arrays().items() if k in BATCH_KEYS[:3]}, 0, 1, 1
        )


# ---- torch on real ranks: found before any collective, reported on every rank ----------------


def _model(params: dict[str, np.ndarray], strategy: str, rank: int, world_size: int):
    """A DDP model for `strategy` and its postnorm hook state (None for precount)."""
    ddp = DistributedDataParallel(BilinearLM.from_numpy(params))
    if strategy == "precount":
        return ddp, None
    state = PostnormState(rank=rank, world_size=world_size)
    ddp.register_comm_hook(state, sum_and_carry_hook)
    return ddp, state


def _update(
    rank: int,
    world_size: int,
    microbatches: list[TokenBatch],
    params: dict[str, np.ndarray],
    strategy: str,
    timeout_s: float = 30.0,
) -> float:
    """One token_mean update of `strategy` on this rank; returns D."""
    model, state = _model(params, strategy, rank, world_size)
    scheme = "token_mean"
    if strategy == "precount":
        done = accumulate_precount(
            model,
            microbatches,
            scheme,
            vocab_size=V,
            reduce_factor=world_size,
            precheck_timeout_s=timeout_s,
        )
    elif strategy == "postnorm":
        done = accumulate_postnorm(
            model,
            microbatches,
            scheme,
            vocab_size=V,
            hook_state=state,
            precheck_timeout_s=timeout_s,
        )
    else:  # a partial precount update: the pre-check runs there too
        accumulate_partial(
            model,
            microbatches,
            scheme,
            strategy="precount",
            vocab_size=V,
            num_microbatches=1,
            reduce_factor=world_size,
            precheck_timeout_s=timeout_s,
        )
        return float("nan")
    return done.global_denominator


def _caught(rank: int, world_size: int, fn_args: tuple, microbatch_counts: tuple[int, ...]):
    """Run `_update` with this rank's first `microbatch_counts[rank]` microbatches of a
    (R, max M) layout; return (exception type name, message) instead of raising, so that the
    test sees what *every* rank said."""
    arrays, params, strategy = fn_args
    microbatches = rank_microbatches(arrays, rank, world_size, max(microbatch_counts))
    try:
        _update(rank, world_size, microbatches[: microbatch_counts[rank]], params, strategy)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return None


@pytest.mark.parametrize("strategy", ["precount", "postnorm", "partial"])
def test_torch_bad_token_on_one_rank_is_named_on_every_rank(strategy: str) -> None:
    arrays = {key: _packed_arrays()[key] for key in BATCH_KEYS}
    row = 6  # rank 1, microbatch 1, row 0 at (2, 2)
    pos = _valid_position(arrays, row)
    arrays["targets"][row, pos] = 999
    params = builtin_fixture("packed").params()
    start = time.monotonic()
    said = launch(_caught, 2, ((arrays, params, strategy), (2, 2)), timeout_s=LAUNCH_TIMEOUT_S)
    root = (
        f"rank 1, microbatch 1, row 0 (global row 6), position {pos}: target 999 is neither "
        "-100 (ignored) nor in the vocabulary [0, 40)"
    )
    assert said[1] == ("BatchError", root)
    assert said[0] == (
        "BatchError",
        f"rank 0: stopping, rank(s) 1 hold bad input; rank 1 reports: {root}",
    )
    assert time.monotonic() - start < 20  # no collective timeout was waited out


@pytest.mark.parametrize("strategy", ["precount", "postnorm", "partial"])
def test_torch_different_microbatch_counts_fail_up_front_on_every_rank(strategy: str) -> None:
    """Rank 0 holds 2 microbatches, rank 1 holds 3: named, not a deadlock or a mixed update."""
    arrays = {key: v for key, v in _packed_arrays().items() if key in BATCH_KEYS}
    arrays = {key: np.concatenate([v, v, v])[:12] for key, v in arrays.items()}  # 12 rows
    params = builtin_fixture("packed").params()
    start = time.monotonic()
    said = launch(_caught, 2, ((arrays, params, strategy), (2, 3)), timeout_s=LAUNCH_TIMEOUT_S)
    for rank in range(2):
        assert said[rank] == (
            RankMismatchError.__name__,
            f"rank {rank}: the ranks hold different numbers of microbatches for this update "
            "(rank 0: 2, rank 1: 3); every rank must accumulate the same number, since each "
            "rank's last microbatch is the one whose backward all-reduces the gradient",
        )
    assert time.monotonic() - start < 20


def _late_rank(rank: int, world_size: int, arrays: dict, params: dict):
    """Rank 1 reaches the update 3 s late; rank 0's pre-check gives up after 1 s and says
    so, with how long it waited."""
    if rank == 1:
        time.sleep(3.0)
        return None
    # Unwrapped: DDP's constructor is a collective of its own and would wait first.
    model = BilinearLM.from_numpy(params)
    microbatches = rank_microbatches(arrays, rank, world_size, 1)
    start = time.monotonic()
    try:
        accumulate_precount(
            model,
            microbatches,
            "token_mean",
            vocab_size=V,
            reduce_factor=1.0,
            precheck_timeout_s=1.0,
        )
    except TimeoutError as exc:
        return str(exc), time.monotonic() - start
    return None


def test_torch_precheck_wait_is_bounded() -> None:
    arrays = {key: v for key, v in _packed_arrays().items() if key in BATCH_KEYS}
    said = launch(_late_rank, 2, (arrays, _packed_params()), timeout_s=LAUNCH_TIMEOUT_S)
    message, waited = said[0]
    assert message == (
        "rank 0: not every one of the 2 ranks reached the start of this update within 1 s "
        "(a rank that failed, hangs, or runs fewer updates)"
    )
    assert 1.0 <= waited < 3.0


def _packed_params() -> dict[str, np.ndarray]:
    return builtin_fixture("packed").params()


# ---- non-finite loss or gradient: where it first appeared ------------------------------------


def _torch_non_finite(rank: int, world_size: int, params: dict, strategy: str, inputs_change):
    arrays = {key: v for key, v in _packed_arrays().items() if key in BATCH_KEYS}
    if inputs_change is not None:
        row, pos, token = inputs_change
        arrays["inputs"][row, pos] = token
    _update(rank, world_size, rank_microbatches(arrays, rank, world_size, 2), params, strategy)


def _with_embedding(token: int, value: float) -> dict[str, np.ndarray]:
    params = _packed_params()
    params["embed"][token] = value
    return params


@pytest.mark.parametrize("strategy", ["precount", "postnorm"])
@pytest.mark.parametrize(
    ("value", "hint"),
    [
        (np.inf, "the params hold NaN or inf in embed"),
        (1e308, "the params are finite, so a logit or a loss overflowed (params too large?)"),
    ],
)
def test_torch_non_finite_loss_names_rank_and_microbatch(strategy: str, value: float, hint: str):
    """A NaN or inf embedding for a token first used on rank 1, microbatch 0 at (2, 2)."""
    params = _with_embedding(LATE_TOKEN, value)
    with pytest.raises(RankFailedError) as failure:
        launch(_torch_non_finite, 2, (params, strategy, None), timeout_s=LAUNCH_TIMEOUT_S)
    assert failure.value.rank == 1
    name = TorchNonFiniteError.__name__
    expected = f"{name}: rank 1, microbatch 0: the loss sum (sum of a_t l_t) is nan; {hint}"
    assert expected in str(failure.value)


#: The token whose embedding is made inf for the gradient-only case (see `_ignored_only`).
HIDDEN_TOKEN = 9


def _ignored_only(arrays: dict[str, np.ndarray]) -> tuple[int, int]:
    """Make HIDDEN_TOKEN the input of one ignored target of row 0 and nowhere else.

    With its embedding inf, that position has no loss (the target is ignored), but its share
    of the gradient is inf x 0 = NaN: a non-finite gradient under a finite loss sum,
    on rank 0's microbatch 0 only. Returns the (row, position) it was put at.
    """
    arrays["inputs"][arrays["inputs"] == HIDDEN_TOKEN] = HIDDEN_TOKEN + 1
    position = int(np.flatnonzero(arrays["targets"][0] == -100)[0])
    arrays["inputs"][0, position] = HIDDEN_TOKEN
    return 0, position


def _torch_hidden_nan(rank: int, world_size: int, params: dict) -> None:
    arrays = {key: v for key, v in _packed_arrays().items() if key in BATCH_KEYS}
    _ignored_only(arrays)
    _update(rank, world_size, rank_microbatches(arrays, rank, world_size, 2), params, "precount")


def test_torch_non_finite_gradient_with_a_finite_loss_is_named() -> None:
    params = _with_embedding(HIDDEN_TOKEN, np.inf)
    with pytest.raises(RankFailedError) as failure:
        launch(_torch_hidden_nan, 2, (params,), timeout_s=LAUNCH_TIMEOUT_S)
    message = str(failure.value)
    assert failure.value.rank == 0
    assert re.search(
        r"NonFiniteError: rank 0, microbatch 0: the gradient of embed holds NaN or inf after "
        r"this microbatch's backward \(local, not yet reduced, though its loss sum \S+ is "
        r"finite\); the params hold NaN or inf in embed",
        message,
    ), message


def test_torch_finite_update_passes_the_checks() -> None:
    """The checks do not fire on a correct update: D comes back on both ranks."""
    params = _packed_params()
    arrays = {key: v for key, v in _packed_arrays().items() if key in BATCH_KEYS}
    Ds = launch(_finite, 2, (arrays, params), timeout_s=LAUNCH_TIMEOUT_S)
    valid = float((arrays["targets"] != -100).sum())
    assert Ds == [valid, valid]


def _finite(rank: int, world_size: int, arrays: dict, params: dict) -> float:
    return _update(
        rank, world_size, rank_microbatches(arrays, rank, world_size, 2), params, "postnorm"
    )


# ---- JAX: host-side validation, and the non-finite report after the step ---------------------


def _jax_expected(change: str, row: int | None, pos: int | None) -> str:
    """jax_impl's message: the array[row, position], why, and at (2, 2) rank and microbatch."""
    if row is not None:
        block, local = divmod(row, 2)
        rank, step = divmod(block, 2)
        located = f" (rank {rank}, microbatch {step}, row {local} of that microbatch)"
        arrays, _, _ = _bad(change)
        key = CHANGES[change][0]
        value = arrays[key][row, pos].item()
        why = {
            "targets": "is neither -100 nor in [0, 40)",
            "inputs": "is outside [0, 40)",
            "segment_ids": "is negative",
            "weights": "is not finite and >= 0",
        }[key]
        return f"batch: {key}[{row}, {pos}] = {value!r} {why}{located}"
    return {
        "targets-float-whole": "batch: targets must be integers, got float64 holding whole "
        "numbers; convert with np.asarray(targets, dtype=np.int32)",
        "targets-float-fraction": "batch: targets must be integers, got float64; "
        "targets[2, 5] = 2.5 is not a whole number",
        "inputs-float-whole": "batch: inputs must be integers, got float64 holding whole numbers",
        "weights-integer": "batch: weights must be floating point (soft per-token weights), "
        "got int64",
        "weights-short": "batch: weights has shape (8, 63), targets (8, 64)",
        "segments-short": "batch: segment_ids has shape (8, 63), targets (8, 64)",
        "inputs-1d": "batch: inputs has shape (512,), targets (8, 64)",
    }[change]


@pytest.mark.parametrize("change", CHANGES)
def test_jax_names_array_row_position_rank_microbatch_and_why(change: str) -> None:
    import jax_impl

    arrays, row, pos = _bad(change)
    batch = {key: arrays[key] for key in BATCH_KEYS}
    with pytest.raises(ValueError) as failure:
        jax_impl.lay_out_global_batch(batch, 2, 2, vocab_size=V)
    assert _jax_expected(change, row, pos) in str(failure.value)


def test_jax_segment_ids_past_int32_are_refused() -> None:
    import jax_impl

    arrays = {key: v for key, v in _packed_arrays().items() if key in BATCH_KEYS}
    arrays["segment_ids"] = arrays["segment_ids"].astype(np.int64)
    arrays["segment_ids"][4, 0] = 2**31
    with pytest.raises(ValueError) as failure:
        jax_impl.lay_out_global_batch(arrays, 2, 2, vocab_size=V)
    assert str(failure.value) == (
        "batch: segment_ids[4, 0] = 2147483648 is past int32, the dtype the steps use "
        "(rank 1, microbatch 0, row 0 of that microbatch)"
    )


def _jax_update(params: dict[str, np.ndarray], front_end: str, check_finite: bool = True):
    import jax.numpy as jnp
    import optax

    import jax_impl

    arrays = {key: v for key, v in _packed_arrays().items() if key in BATCH_KEYS}
    batch = jax_impl.lay_out_global_batch(arrays, 2, 2, vocab_size=V)
    config = jax_impl.StepConfig(optimizer=optax.sgd(0.1), check_finite=check_finite)
    make = {
        "pmap": lambda: jax_impl.make_pmap_update(config, 2),
        "shard_map": lambda: jax_impl.make_shard_map_update(config, jax_impl.data_mesh(2)),
        "jit": lambda: jax_impl.make_global_update(config, jax_impl.data_mesh(2)),
    }[front_end]()
    jax_params = jax_impl.params_from_numpy(params, jnp.float32)
    return make(jax_params, optax.sgd(0.1).init(jax_params), batch)


@pytest.mark.parametrize("front_end", ["pmap", "shard_map", "jit"])
@pytest.mark.parametrize(
    ("value", "hint"),
    [
        (np.inf, "the params hold NaN or inf in embed"),
        # float32 (x64 is off in this process): 3e38 is finite, the logits it makes are not.
        (3e38, "the params are finite, so a logit or a loss overflowed (params too large?)"),
    ],
)
def test_jax_non_finite_loss_is_reported_with_rank_and_microbatch(
    front_end: str, value: float, hint: str
) -> None:
    from jax_impl.update import NonFiniteError as JaxNonFiniteError

    with pytest.raises(JaxNonFiniteError) as failure:
        _jax_update(_with_embedding(LATE_TOKEN, value), front_end)
    message = str(failure.value)
    assert message.startswith(
        "non-finite loss sum first at rank 1, microbatch 0 (of R=2 ranks x M=2 microbatches; "
        "affected: rank 1 microbatch 0"
    ), message
    assert message.endswith(hint)


def test_jax_non_finite_gradient_with_a_finite_loss_is_reported() -> None:
    """A NaN gradient under a finite loss, on rank 0's microbatch 0 only (`_ignored_only`)."""
    import jax.numpy as jnp
    import optax

    import jax_impl
    from jax_impl.update import NonFiniteError as JaxNonFiniteError

    arrays = {key: v for key, v in _packed_arrays().items() if key in BATCH_KEYS}
    _ignored_only(arrays)
    batch = jax_impl.lay_out_global_batch(arrays, 2, 2, vocab_size=V)
    params = jax_impl.params_from_numpy(_with_embedding(HIDDEN_TOKEN, np.inf), jnp.float32)
    update = jax_impl.make_pmap_update(jax_impl.StepConfig(optimizer=optax.sgd(0.1)), 2)
    with pytest.raises(JaxNonFiniteError) as failure:
        update(params, optax.sgd(0.1).init(params), batch)
    assert str(failure.value) == (
        "non-finite gradient (local, before any reduction) first at rank 0, microbatch 0 (of "
        "R=2 ranks x M=2 microbatches; affected: rank 0 microbatch 0); the params hold NaN or "
        "inf in embed"
    )


def test_jax_check_can_be_turned_off_and_passes_finite_updates() -> None:
    out = _jax_update(_with_embedding(LATE_TOKEN, np.inf), "pmap", check_finite=False)
    assert not np.isfinite(np.asarray(out.grads["unembed"])).all()  # not checked: NaN passes
    out = _jax_update(_packed_params(), "shard_map")
    assert np.isfinite(np.asarray(out.grads["unembed"])).all()
