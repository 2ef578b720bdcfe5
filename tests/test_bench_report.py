"""The bench's report on made-up figures: what it says about speed, and when it says nothing.

No bench runs here: `print_report` and `acceptance_lines` read rows as `result_rows` makes
them, so a few dicts stand in for a run's timings.
"""

from __future__ import annotations

import io

from rich.console import Console

from crosscheck.bench.config import BenchConfig
from crosscheck.bench.report import (
    FUSED_BUDGET,
    QUICK_NO_VERDICT,
    acceptance_lines,
    print_report,
)
from crosscheck.bench.runner import BenchRun

VERDICTS = (f"within {FUSED_BUDGET}", f"over {FUSED_BUDGET}")


def _rows(fused_ratio: float) -> list[dict]:
    """One setup's three rows; precount 0.541x and fused `fused_ratio`x naive."""
    rows = []
    for path, ratio in (("naive", 1.0), ("precount", 0.541), ("fused", fused_ratio)):
        rows.append(
            {
                "framework": "torch",
                "setup": "ddp 2 ranks (gloo)",
                "path": path,
                "median_s": 0.01 * ratio,
                "min_s": 0.009 * ratio,
                "max_s": 0.011 * ratio,
                "ratio_to_naive": ratio,
                "ratio_ci95": [ratio * 0.9, ratio * 1.1],
                "cpu_median_s": 0.02 * ratio,
                "cpu_ratio_to_naive": ratio,
                "peak_mem_bytes": 2**20,
                "world_size": 2,
                "rank_valid_tokens": [100, 60],
                "refused": None,
                "all_reduces": None,
            }
        )
    return rows


def _printed(config: BenchConfig, rows: list[dict]) -> str:
    console = Console(file=io.StringIO(), record=True, width=240)
    print_report(console, BenchRun(config), rows, {"cores": 2})
    return console.export_text()


def test_a_quick_report_gives_the_figures_and_no_speed_verdict():
    quick = BenchConfig().quickly()
    for ratio in (0.541, 1.5):  # far under and far over the budget: neither is judged
        lines = acceptance_lines(_rows(ratio), quick=True)
        assert lines[0].startswith(f"fused / naive, torch ddp 2 ranks (gloo): {ratio:.3f} (95%")
        assert lines[-1] == QUICK_NO_VERDICT
        assert not any(verdict in line for line in lines for verdict in VERDICTS)
        text = _printed(quick, _rows(ratio))
        assert f"fused / naive, torch ddp 2 ranks (gloo): {ratio:.3f}" in text
        assert "too few rounds" in text and not any(verdict in text for verdict in VERDICTS)


def test_a_full_report_judges_fused_against_the_budget():
    assert f"over {FUSED_BUDGET}" in _printed(BenchConfig(), _rows(1.5))
    assert f"within {FUSED_BUDGET}" in _printed(BenchConfig(), _rows(1.01))
    lines = acceptance_lines(_rows(1.01))
    assert len(lines) == 1 and QUICK_NO_VERDICT not in lines


def test_the_bench_table_is_readable_at_80_columns():
    """At 80 columns (a pipe with COLUMNS unset) the compact layout: no cell cut, every figure
    whole; a wide console keeps one row per line with the units in the cells."""
    rows = _rows(1.009)
    console = Console(file=io.StringIO(), record=True, width=80)
    print_report(console, BenchRun(BenchConfig()), rows, {"cores": 2})
    text = console.export_text()
    assert "\u2026" not in text, text
    # The table's lines (the sentences after it are not wrapped: a terminal wraps them).
    drawn = [line for line in text.splitlines() if line[:1] in "┏┃┡│└"]
    assert drawn and max(len(line) for line in drawn) <= 80, text
    assert {"torch", "ddp", "(gloo)", "naive", "precount", "fused", "1.009", "0.541"} <= set(
        text.split()
    ), text
    wide = _printed(BenchConfig(), rows)
    assert "│ torch     │ ddp 2 ranks (gloo) │ fused" in wide, wide
