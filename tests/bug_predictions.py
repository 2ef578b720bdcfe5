"""What each bug pattern's text says a buggy step logs and how it scales the gradient.

test_jax_bugs and test_torch_bugs hold their framework's buggy steps to these predictions,
written once here from the fixture's arrays (numpy), not taken from the package: the text in
crosscheck.diagnosis.patterns is the specification, the steps are what is tested.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np

from crosscheck.contract.layout import IGNORE_INDEX
from crosscheck.contract.oracle import weighted_grad
from crosscheck.diagnosis.patterns import RANK_SKEW, BugRun
from crosscheck.fixtures.builtin import builtin_fixture


@functools.cache
def counts(fixture_name: str, R: int, M: int) -> dict[str, float]:
    """The counts the patterns' texts name, for a fixture laid out over (R, M)."""
    fixture = builtin_fixture(fixture_name)
    valid = fixture.targets != IGNORE_INDEX
    N, T = valid.shape
    per_microbatch = valid.reshape(R, M, N // (R * M), T)
    return {
        "D": float(valid.sum()),
        "rows": float(valid.any(axis=1).sum()),
        "attended": float((fixture.segment_ids > 0).sum()),
        "slots": float(N * T),
        "rank0": float(per_microbatch[0].sum()),
        "rank0_last_microbatch": float(per_microbatch[0, M - 1].sum()),
        # The last microbatch over all ranks (n_m of microstep-mean).
        "last_microbatch": float(per_microbatch[:, M - 1].sum()),
        "weight_total": math.fsum(fixture.weights[valid].tolist()),
        # Prompt groups with a valid target (every row its own group without group_ids).
        "groups": float(len(set(fixture.group_ids[valid.any(axis=1)].tolist()))),
    }


def local_group_count_weights(fixture_name: str, R: int, M: int) -> np.ndarray:
    """[N, T] effective weights of local-group-count's text: v_t / (n_group,local(t) D_G),
    with the group's count taken over the rows of t's own (rank, microbatch) only."""
    fixture = builtin_fixture(fixture_name)
    valid = fixture.targets != IGNORE_INDEX
    groups, per_row = fixture.group_ids, valid.sum(axis=1)
    B = fixture.num_rows // (R * M)
    weights = np.zeros(valid.shape)
    for start in range(0, fixture.num_rows, B):  # rank-major microbatches of B rows
        unit = slice(start, start + B)
        for row in range(start, start + B):
            n_local = per_row[unit][groups[unit] == groups[row]].sum()
            weights[row] = valid[row] / max(n_local, 1)
    return weights / counts(fixture_name, R, M)["groups"]


def microstep_mean_weights(fixture_name: str, R: int, M: int) -> np.ndarray:
    """[N, T] effective weights of microstep-mean's text: v_t / (M n_m), with n_m the
    valid targets of t's microbatch index m summed over every rank."""
    fixture = builtin_fixture(fixture_name)
    valid = fixture.targets != IGNORE_INDEX
    B = fixture.num_rows // (R * M)
    step_of_row = (np.arange(fixture.num_rows) // B) % M  # rank-major microbatches of B rows
    per_step = np.array([valid[step_of_row == m].sum() for m in range(M)], dtype=np.float64)
    return valid / (M * per_step[step_of_row])[:, None]


#: pattern -> its logged denominator from (counts, R): the `logged_denominator` of its text.
LOGGED_DENOMINATOR: dict[str, Callable[[dict[str, float], int], float]] = {
    "rank-mean": lambda c, R: c["rank0"],
    "microbatch-mean": lambda c, R: c["rank0_last_microbatch"],
    "microstep-mean": lambda c, R: c["last_microbatch"],
    "missing-world-size": lambda c, R: c["D"],
    "double-world-size": lambda c, R: c["D"],
    "double-accum-scale": lambda c, R: c["D"],
    "double-accum-divide": lambda c, R: c["D"],
    "unshifted-count": lambda c, R: c["D"] + c["rows"],
    "attention-mask-count": lambda c, R: c["attended"],
    "clip-per-microbatch": lambda c, R: c["D"],
    "stale-count": lambda c, R: 2 * c["D"],
    "double-reduce-count": lambda c, R: R * c["D"],
    "packed-as-one": lambda c, R: c["rows"],
    "padding-as-tokens": lambda c, R: c["slots"],
    "local-group-count": lambda c, R: c["groups"],
    "zero-count-nan": lambda c, R: c["rank0_last_microbatch"],
    "pp-unsent-count": lambda c, R: c["D"],
    RANK_SKEW: lambda c, R: c["D"],
    # float32-count: the float32 rounding of the weight total, which each test checks itself.
}

#: Pure scale errors: pattern -> the factor on the intended token-mean gradient, from
#: (counts, R, M).
TOKEN_MEAN_SCALE: dict[str, Callable[[dict[str, float], int, int], float]] = {
    "missing-world-size": lambda c, R, M: 1 / R,
    "double-world-size": lambda c, R, M: R,
    "double-accum-scale": lambda c, R, M: M,
    "double-accum-divide": lambda c, R, M: 1 / M,
    "double-reduce-count": lambda c, R, M: 1 / R,
    "stale-count": lambda c, R, M: 1 / 2,
    "padding-as-tokens": lambda c, R, M: c["D"] / c["slots"],
    "unshifted-count": lambda c, R, M: c["D"] / (c["D"] + c["rows"]),
    "attention-mask-count": lambda c, R, M: c["D"] / c["attended"],
}


# --- context parallel ------------------------------------------------------------------------

#: The context-parallel patterns: their predictions are `context_parallel_prediction`'s.
CONTEXT_PARALLEL = (
    "cp-local-count",
    "cp-count-over-replicas",
    "cp-count-over-dp-only",
    "missing-cp-compensation",
    "cp-local-sequence-count",
)


def context_rank_of_position(T: int, C: int, order: str) -> np.ndarray:
    """[T] the context rank holding each position, from the contract's words: C equal chunks
    in order (contiguous), or 2 C chunks with rank c holding chunks c and 2 C - 1 - c
    (zigzag)."""
    chunks = 2 * C if order == "zigzag" else C
    chunk = np.arange(T) // (T // chunks)
    return np.where(chunk < C, chunk, chunks - 1 - chunk)


def context_parallel_prediction(run: BugRun) -> tuple[np.ndarray, float]:
    """([N, T] effective weights, logged denominator) of a context-parallel pattern's text,
    on run's fixture and (R, M, C, order)."""
    fixture = builtin_fixture(run.fixture)
    valid = fixture.targets != IGNORE_INDEX
    N, T = valid.shape
    R, M, C = run.world_size, run.accum_steps, run.context_size
    B = N // (R * M)
    context = np.broadcast_to(context_rank_of_position(T, C, run.context_order), (N, T))
    rank = np.broadcast_to((np.arange(N) // B // M)[:, None], (N, T))
    process = rank * C + context
    D = float(valid.sum())
    v = valid.astype(np.float64)
    if run.pattern == "cp-local-count":
        n_process = np.bincount(process[valid], minlength=R * C).astype(np.float64)
        return v / (R * C * np.maximum(n_process[process], 1)), n_process[0]
    if run.pattern in ("cp-count-over-replicas", "missing-cp-compensation"):
        logged = C * D if run.pattern == "cp-count-over-replicas" else D
        return v / (C * D), logged
    if run.pattern == "cp-count-over-dp-only":
        n_context = np.bincount(context[valid], minlength=C).astype(np.float64)
        # A context rank with no valid target weighs nothing (its count is 0 and so is v).
        per_token = n_context[context]
        weights = np.divide(v, per_token, out=np.zeros((N, T)), where=per_token > 0)
        return weights, n_context[0]
    if run.pattern == "cp-local-sequence-count":
        # A document is a (row, segment); its local part is the one on t's context rank (a
        # row lies in one rank and microbatch, so that is t's process and microbatch).
        rows_of_targets = np.nonzero(valid)[0]  # row-major, as boolean indexing reads
        documents = set(
            zip(rows_of_targets.tolist(), fixture.segment_ids[valid].tolist(), strict=True)
        )
        weights = np.zeros((N, T))
        for i in range(N):
            for t in np.flatnonzero(valid[i]):
                same = (fixture.segment_ids[i] == fixture.segment_ids[i, t]) & (
                    context[i] == context[i, t]
                )
                weights[i, t] = 1.0 / np.count_nonzero(same & valid[i])
        return weights / len(documents), float(len(documents))
    raise AssertionError(f"no context-parallel prediction for {run.pattern!r}")


# --- pipeline --------------------------------------------------------------------------------


def pipeline_prediction(run: BugRun) -> dict[str, np.ndarray]:
    """pp-unsent-count's text: the last stage (unembed) as intended, every earlier
    stage (embed) D times its intended token-mean gradient."""
    fixture = builtin_fixture(run.fixture)
    valid = fixture.targets != IGNORE_INDEX
    D = float(valid.sum())
    grads = weighted_grad(fixture.params(), fixture.inputs, fixture.targets, valid / D)
    return {"embed": D * grads["embed"], "unembed": grads["unembed"]}
