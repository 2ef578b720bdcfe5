"""`python -m crosscheck bench`: the JSON it writes, its refusals, and the numbers behind them.

One quick bench run (module-scoped, ~20 s: a torch launch of two gloo ranks and one JAX worker
with two setups) serves every test that reads its report; no test asserts a time, only that
every path of every setup was judged right, timed and measured. The rest is pure numpy.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from crosscheck import exit_codes
from crosscheck.bench.checks import MIN_NAIVE_GAP, RTOL, refusals
from crosscheck.bench.stats import summarize
from crosscheck.cli.commands import main
from crosscheck.run import implementations

PATHS = {"naive", "precount", "fused"}
ROW_KEYS = {
    "framework",
    "setup",
    "path",
    "median_s",
    "min_s",
    "max_s",
    "ratio_to_naive",
    "peak_mem_bytes",
}
NUMBERS = ("median_s", "min_s", "max_s", "ratio_to_naive", "peak_mem_bytes")


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("bench") / "bench.json"
    run = subprocess.run(
        [sys.executable, "-m", "crosscheck", "bench", "--quick", "--json", str(path)],
        capture_output=True,
        text=True,
        timeout=240,  # ~20 s alone; a loaded 2-core machine has taken 3x
    )
    assert run.returncode == exit_codes.OK, (
        f"bench exited {run.returncode}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    )
    return json.loads(path.read_text())


def test_every_path_of_every_setup_is_timed_with_finite_positive_numbers(report):
    rows = report["results"]
    setups = {(row["framework"], row["world_size"]) for row in rows}
    assert setups == {("torch", 2), ("jax", 2), ("jax", 8)}
    for setup in setups:
        paths = [row["path"] for row in rows if (row["framework"], row["world_size"]) == setup]
        assert sorted(paths) == sorted(PATHS), setup
    for row in rows:
        assert set(row) >= ROW_KEYS, sorted(ROW_KEYS - set(row))
        assert row["refused"] is None, row
        for key in NUMBERS:
            value = row[key]
            assert isinstance(value, int | float) and math.isfinite(value) and value > 0, (
                row["framework"],
                row["setup"],
                row["path"],
                key,
                value,
            )
        assert row["min_s"] <= row["median_s"] <= row["max_s"], row
        low, high = row["ratio_ci95"]
        assert low <= row["ratio_to_naive"] <= high, row
        if row["path"] == "naive":
            assert row["ratio_to_naive"] == 1.0  # each round's naive over itself
            assert row["ratio_ci95"] == [1.0, 1.0]


def test_the_report_names_the_machine_the_config_and_how_it_measured(report):
    machine, config = report["machine"], report["config"]
    assert {"cpu_model", "cores", "torch", "jax", "python"} <= set(machine)
    assert config["quick"] is True and config["accum"] == 2
    assert config["rounds"] >= 1 and config["torch_rounds"] >= 1
    assert set(report["memory_method"]) == {"torch", "jax"}
    assert report["errors"] == {}


def test_jax_fused_runs_one_all_reduce_like_naive_and_precount_two(report):
    counts = {
        (row["world_size"], row["path"]): row["all_reduces"]
        for row in report["results"]
        if row["framework"] == "jax"
    }
    for world_size in (2, 8):
        assert counts[world_size, "fused"] == counts[world_size, "naive"] == 1
        assert counts[world_size, "precount"] == 2


def test_cuda_is_refused_where_torch_sees_too_few_gpus(capsys):
    import torch  # missing torch fails the test: the refusal is torch's count of GPUs

    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        pytest.fail("this test checks the refusal on a machine with fewer than 2 GPUs")
    code = main(["bench", "--device", "cuda", "--ranks", "2"])
    captured = capsys.readouterr()
    assert code == exit_codes.SETUP_ERROR and captured.out == ""
    [line] = captured.err.splitlines()  # one line on stderr, however long
    assert line.startswith("crosscheck bench: ") and "--ranks 2 needs 2 GPUs, torch sees" in line


def test_a_framework_not_installed_or_no_ranks_is_one_setup_error(monkeypatch, capsys):
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):  # jax looks absent, as in a fresh environment
        return None if name.split(".")[0] == "jax" else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    implementations.not_installed.cache_clear()
    try:
        code = main(["bench", "--quick"])
    finally:
        implementations.not_installed.cache_clear()
    assert code == exit_codes.SETUP_ERROR
    captured = capsys.readouterr()
    assert captured.out == ""
    [line] = captured.err.splitlines()
    assert line.startswith("crosscheck bench: ")
    assert "jax is not installed here (pip install 'gradweight[jax]')" in line
    monkeypatch.undo()
    assert main(["bench", "--ranks", "0"]) == exit_codes.SETUP_ERROR
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == ["crosscheck bench: --ranks must be at least 1, got 0"]


def test_the_ratio_is_the_median_of_per_round_ratios_not_a_ratio_of_medians():
    # Round 2 is slow for both paths: per round, fused is 1.1, 1.1, 1.5 x naive.
    summary = summarize({"naive": [1.0, 1.0, 10.0], "fused": [1.1, 1.1, 15.0]})
    assert summary["fused"]["ratio_to_naive"] == pytest.approx(1.1)
    assert summary["fused"]["median_s"] == 1.1 and summary["fused"]["max_s"] == 15.0
    with pytest.raises(ValueError, match="finite and > 0"):
        summarize({"naive": [1.0, float("nan")], "fused": [1.0, 1.0]})
    with pytest.raises(ValueError, match="same, nonzero number of rounds"):
        summarize({"naive": [1.0, 1.0], "fused": [1.0]})


def test_the_ratio_comes_with_a_bootstrap_interval_that_narrows_with_more_rounds():
    # Per-round ratios scattering by 10% around 1.01, as torch's do on 2 cores.
    rng = np.random.default_rng(1)

    def interval(rounds: int) -> tuple[float, list[float]]:
        naive = rng.uniform(0.030, 0.040, rounds)
        fused = naive * rng.normal(1.01, 0.1, rounds)
        summary = summarize({"naive": list(naive), "fused": list(fused)})["fused"]
        return summary["ratio_to_naive"], summary["ratio_ci95"]

    ratio, (low, high) = interval(100)
    assert low < ratio < high and low > 0.95 and high < 1.07
    _, (low_many, high_many) = interval(3000)
    assert high_many - low_many < (high - low) / 3  # sqrt(30) ~ 5.5x narrower
    assert low_many < 1.01 < high_many
    # The same times give the same interval (seeded), and a path with one round its own.
    times = {"naive": [1.0, 2.0, 3.0], "fused": [1.1, 2.0, 3.3]}
    assert summarize(times)["fused"]["ratio_ci95"] == summarize(times)["fused"]["ratio_ci95"]
    assert summarize({"naive": [1.0], "fused": [1.5]})["fused"]["ratio_ci95"] == [1.5, 1.5]


def _references() -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    intended = {"w": rng.normal(size=(4, 3))}
    return {"intended": intended, "rank_mean": {"w": intended["w"] * 1.25}}


def test_a_path_whose_gradient_is_not_its_own_is_refused_and_nan_never_passes():
    refs = _references()
    right = {
        "naive": refs["rank_mean"],
        "precount": refs["intended"],
        "fused": {"w": refs["intended"]["w"] * (1 + RTOL / 10)},
    }
    assert refusals(right, refs, [900, 100]) == {}
    wrong = dict(right, fused=refs["rank_mean"])  # fused giving naive's weighting
    assert list(refusals(wrong, refs, [900, 100])) == ["fused"]
    poisoned = {"w": refs["intended"]["w"].copy()}
    poisoned["w"][1, 2] = np.nan
    assert "precount" in refusals(dict(right, precount=poisoned), refs, [900, 100])


def test_naive_is_refused_when_the_batch_does_not_show_what_it_gets_wrong():
    refs = _references()
    # Counts differ, yet naive equals the global token mean: the batch or the path is wrong.
    same = {"naive": refs["intended"], "precount": refs["intended"], "fused": refs["intended"]}
    refs_equal = {"intended": refs["intended"], "rank_mean": refs["intended"]}
    assert "naive" in refusals(same, refs_equal, [900, 100])
    assert refusals(same, refs_equal, [500, 500]) == {}  # equal counts: no gap expected
    assert MIN_NAIVE_GAP > RTOL
