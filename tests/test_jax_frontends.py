"""Every intended scheme x JAX front-end x layout x strategy x dtype against the oracle.

Front-ends: pmap, shard_map and global-view jit on 1, 2, 4 and 8 CPU devices, and
multi-process jax.distributed with 2 and 4 real processes; accum_steps 1, 2, 4; precount
(psum and pmean, so the reduction factor s = 1 and s = R both run) and postnorm; float32 and
float64; two consecutive AdamW updates per case (plus SGD for token_mean). The matrix itself
and why it runs in runner processes: tests/jax_matrix.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from jax_matrix import (
    ADAMW,
    DTYPES,
    INTENDED_SCHEMES,
    MAX_GRAD_NORM,
    NUM_UPDATES,
    RUNNER_XLA_FLAGS,
    VARIANTS,
    expected_cases,
    failures,
    layouts,
    oracle,
    oracle_keys,
    run_front_ends,
    verdict,
    write_oracle,
)

from crosscheck import builtin_fixture
from crosscheck.launch.workers import SMALL_PROGRAM_JAX_CONFIG
from jax_impl.harness.multiprocess import launch_multiprocess, variant_name

IN_PROCESS = ("pmap", "shard_map", "jit")
# Each runner compiles a program per front-end, layout and batch shape and checks ~2500 cases:
# 79 s alone on 2 free cores (float32; every program holds all 18 (scheme, strategy) configs,
# their accumulations batched into one scan), up to ~4 minutes with both runners on a busy
# machine. The bounds only turn a hang into a failure; the pytest timeout of the first
# front-end test (whose setup runs both runners) sits above them.
RUNNERS_TIMEOUT_S = 600
MULTIPROCESS_TIMEOUT_S = 240


def assert_matrix(records_by_dtype: dict[str, list[dict]], front_end: str) -> None:
    """Every expected case ran at both dtypes and none differs from the oracle."""
    for dtype in DTYPES:
        ran, expected = len(records_by_dtype[dtype]), expected_cases(front_end)
        assert ran == expected, f"{front_end} {dtype}: {ran} cases ran, expected {expected}"
    problems = [line for dtype in DTYPES for line in failures(records_by_dtype[dtype])]
    assert not problems, f"{len(problems)} case(s) differ from the oracle:\n" + "\n".join(
        problems[:40]
    )


@pytest.fixture(scope="module")
def in_process_records(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """Both dtypes of every in-process front-end, run once for the tests below."""
    work_dir = tmp_path_factory.mktemp("jax_matrix")
    keys = sorted({key for front_end in IN_PROCESS for key in oracle_keys(front_end)})
    oracle_path = write_oracle(keys, work_dir / "oracle.pkl")
    return run_front_ends(IN_PROCESS, work_dir, oracle_path, RUNNERS_TIMEOUT_S)


@pytest.mark.timeout(RUNNERS_TIMEOUT_S + 60)
@pytest.mark.parametrize("front_end", IN_PROCESS)
def test_front_end_matches_oracle(
    front_end: str, in_process_records: dict[str, list[dict]]
) -> None:
    """The runners fail (never skip) when the 8 devices they request are missing."""
    records = {
        dtype: [r for r in in_process_records[dtype] if r["front_end"] == front_end]
        for dtype in DTYPES
    }
    assert_matrix(records, front_end)
    # Both branches of the clip ran: some cases were clipped, others were not.
    clipped = [oracle_clipped(r) for r in records["float64"]]
    assert any(clipped) and not all(clipped)


def oracle_clipped(record: dict) -> bool:
    key = (record["fixture"], record["scheme"], record["world_size"], record["accum_steps"])
    return any(u.grad_norm >= MAX_GRAD_NORM for u in oracle(*key, record["optimizer"]))


def multiprocess_spec(num_processes: int, fixture_dir: Path) -> tuple[dict, list[tuple]]:
    cases, spec_cases = [], []
    for name, R, M in layouts([num_processes]):
        path = builtin_fixture(name).save(fixture_dir / f"{name}.npz")
        spec_cases.append({"fixture": str(path), "accum_steps": M})
        cases.append((name, R, M))
    spec = {
        "x64": True,  # float32 cases cast every array to float32 and so stay float32
        "optimizer": {
            "name": "adamw",
            "learning_rate": ADAMW.learning_rate,
            "b1": ADAMW.b1,
            "b2": ADAMW.b2,
            "eps": ADAMW.eps,
            "weight_decay": ADAMW.weight_decay,
        },
        "max_grad_norm": MAX_GRAD_NORM,
        "num_updates": NUM_UPDATES,
        "variants": [list(v) for v in VARIANTS["multiprocess"]],
        "schemes": list(INTENDED_SCHEMES),
        "dtypes": list(DTYPES),
        "cases": spec_cases,
    }
    return spec, cases


def process_history(out: dict[str, np.ndarray], key: str) -> list[dict]:
    """One process's view of a case, update by update, in compare_update's form."""
    history = []
    for update in range(NUM_UPDATES):
        prefix = f"{key}/{update}"
        got = {field: out[f"{prefix}/{field}"] for field in (
            "rank_valid_tokens", "rank_loss_sums", "global_denominator", "loss", "grad_norm",
            "clipped_grad_norm",
        )}  # fmt: skip
        got["grads"] = {k: out[f"{prefix}/grads.{k}"] for k in ("embed", "unembed")}
        got["params"] = {k: out[f"{prefix}/params.{k}"] for k in ("embed", "unembed")}
        got["ranks"] = [int(out["rank"])]  # per-rank metrics: this process's own entry
        history.append(got)
    return history


@pytest.mark.timeout(MULTIPROCESS_TIMEOUT_S + 60)
@pytest.mark.parametrize(("num_processes", "gspmd"), [(2, True), (4, False)])
def test_multiprocess_matches_oracle(num_processes: int, gspmd: bool, tmp_path: Path) -> None:
    """Real processes (jax.distributed, gloo), one rank each; bounded by the launcher. With
    `gspmd`, under the settings `crosscheck run` gives its launches (``jax_config``: Shardy
    off), where process 0 traces each sweep once for every batch shape; else jax's default."""
    spec, cases = multiprocess_spec(num_processes, tmp_path)
    if gspmd:
        spec["jax_config"] = [list(setting) for setting in SMALL_PROGRAM_JAX_CONFIG]
    outputs = launch_multiprocess(
        spec,
        num_processes,
        tmp_path / "run",
        timeout_s=MULTIPROCESS_TIMEOUT_S,
        extra_xla_flags=RUNNER_XLA_FLAGS,  # its device count is replaced by 1 per process
    )
    assert sorted(int(out["rank"]) for out in outputs) == list(range(num_processes))
    # Each program that spans the processes was compiled once, by process 0, and loaded by
    # the others: every process holds the shared programs (the results below are theirs).
    shared = [int(out["shared_programs"]) for out in outputs]
    assert min(shared) > 0 and len(set(shared)) == 1, f"programs shared per process: {shared}"
    # The spec sweeps: process 0 traced and compiled them, the others loaded them untraced
    # (`CompiledByProcessZero`), every one of them the same number.
    loaded = {int(out["rank"]): int(out["loaded_programs"]) for out in outputs}
    others = {loaded[rank] for rank in range(1, num_processes)}
    assert loaded[0] == 0 and len(others) == 1 and min(others) > 0, f"loaded: {loaded}"
    # One export per sweep and dtype, by process 0 alone, for more compiled shapes than that.
    traced = {int(out["rank"]): int(out["traced_sweeps"]) for out in outputs}
    others_traced = {traced[rank] for rank in range(1, num_processes)}
    if gspmd:
        assert 0 < traced[0] < min(others) and others_traced == {0}, f"traced: {traced}"
    else:
        assert set(traced.values()) == {0}, f"traced under Shardy: {traced}"
    records = {dtype: [] for dtype in DTYPES}
    for index, (name, R, M) in enumerate(cases):
        for dtype in DTYPES:
            for scheme in INTENDED_SCHEMES:
                want = oracle(name, scheme, R, M, "adamw")
                for strategy, collective in VARIANTS["multiprocess"]:
                    key = f"{index}/{dtype}/{variant_name(strategy, collective)}/{scheme}"
                    case = {
                        "front_end": f"multiprocess[{num_processes}]",
                        "dtype": dtype,
                        "fixture": name,
                        "scheme": scheme,
                        "strategy": f"{strategy}-{collective}",
                        "optimizer": "adamw",
                        "world_size": R,
                        "accum_steps": M,
                    }
                    per_process = [
                        verdict(case, process_history(out, key), want) for out in outputs
                    ]
                    records[dtype].append(max(per_process, key=lambda r: r["max_rel_err"]))
    expected = sum(1 for _ in layouts([num_processes]))
    expected *= len(INTENDED_SCHEMES) * len(VARIANTS["multiprocess"])
    for dtype in DTYPES:
        assert len(records[dtype]) == expected
    problems = [line for dtype in DTYPES for line in failures(records[dtype])]
    assert not problems, "\n".join(problems[:40])


def test_the_comparison_passes_the_oracle_itself_and_fails_nan_or_a_wrong_count() -> None:
    """The verdict the matrix relies on: exact data passes, NaN and an off-by-one count fail."""
    want = oracle("ragged", "token_mean", 2, 2, "adamw")

    def history(**changes) -> list[dict]:
        records = []
        for record in want:
            got = {
                "grads": dict(record.result.grads),
                "params": dict(record.params),
                "rank_valid_tokens": record.result.rank_valid_tokens.copy(),
                "rank_loss_sums": record.result.rank_loss_sums,
                "global_denominator": record.result.denominator,
                "loss": record.result.loss,
                "grad_norm": record.grad_norm,
                "clipped_grad_norm": record.clipped_grad_norm,
            }
            records.append({**got, **changes})
        return records

    case = {"front_end": "self-test", "dtype": "float64", "fixture": "ragged"}
    assert verdict(case, history(), want)["failed"] == []
    nan_grads = {k: np.full_like(v, np.nan) for k, v in want[0].result.grads.items()}
    assert verdict(case, history(grads=nan_grads), want)["failed"] == ["grads"]
    off_by_one = want[0].result.rank_valid_tokens + np.array([1, 0])
    assert verdict(case, history(rank_valid_tokens=off_by_one), want)["failed"] == [
        "rank_valid_tokens"
    ]
