"""The bench's report: one row per framework x setup x path, the table, the machine, the JSON.

A row holds the step's median, min and max over the timed rounds, the median of per-round
ratios to naive (`crosscheck.bench.stats`), the peak memory of one update (measured as
`memory` says, per framework) and, for a refused path, why it was refused and not timed.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from importlib import metadata
from pathlib import Path

from rich.console import Console
from rich.table import Table

from crosscheck.bench.config import BenchConfig
from crosscheck.bench.runner import BenchRun
from crosscheck.bench.stats import summarize
from crosscheck.launch.workers import write_atomically
from crosscheck.tables import fitted

#: The acceptance: fused postnorm may cost at most 2% over naive (median of ratios).
FUSED_BUDGET = 1.02
#: What a --quick run says in place of the verdict: its figures show that the paths run, and
#: three rounds with no warm-up say nothing about speed.
QUICK_NO_VERDICT = (
    f"--quick: too few rounds, with no warm-up, to judge speed; no verdict against the "
    f"{FUSED_BUDGET} budget (a run without --quick gives one)"
)
RATIO_METHOD = (
    "median over rounds of t_path_i / t_naive_i, each round running every path once in "
    "turn (rotating which goes first): drift that moves a whole round cancels"
)


def result_rows(run: BenchRun) -> list[dict]:
    """Every (framework, setup, path) the run judged, timed or refused, in a stable order."""
    rows = []
    torch_out, jax_out = run.torch.output, run.jax.output
    if torch_out is not None:
        setup = f"ddp {run.config.torch_ranks} ranks ({torch_out['backend']})"
        rows += _setup_rows("torch", setup, run.config.torch_ranks, torch_out)
    if jax_out is not None:
        for world_size, out in jax_out["setups"].items():
            setup = f"shard_map {world_size} devices ({jax_out['platform']})"
            rows += _setup_rows("jax", setup, world_size, out)
    return rows


def _setup_rows(framework: str, setup: str, world_size: int, out: dict) -> list[dict]:
    summary = summarize(out["times"]) if out["times"] else {}
    cpu = summarize(out["cpu_times"]) if out["cpu_times"] else {}
    rows = []
    for path in ("naive", "precount", "fused"):
        numbers = summary.get(
            path, dict.fromkeys(("median_s", "min_s", "max_s", "ratio_to_naive", "ratio_ci95"))
        )
        cpu_numbers = cpu.get(path, {})
        rows.append(
            {
                "framework": framework,
                "setup": setup,
                "path": path,
                **numbers,
                # CPU seconds of all ranks: what a shared machine's neighbours disturb least.
                "cpu_median_s": cpu_numbers.get("median_s"),
                "cpu_ratio_to_naive": cpu_numbers.get("ratio_to_naive"),
                "peak_mem_bytes": out["peak_mem_bytes"].get(path),
                "world_size": world_size,
                "rank_valid_tokens": out["rank_counts"],
                "refused": out["refused"].get(path),
                # JAX only: all-reduce ops in the optimized program (fused: as many as naive).
                "all_reduces": out.get("collectives", {}).get(path),
            }
        )
    return rows


def machine() -> dict:
    """Where the bench ran: CPU model, cores, load (the machine may be shared), versions."""
    model = platform.processor()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [
            ln.split(":", 1)[1].strip()
            for ln in cpuinfo.read_text().splitlines()
            if ln.startswith("model name")
        ]
        model = names[0] if names else model
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    versions = {}
    for package in ("torch", "jax", "jaxlib", "numpy"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "cpu_model": model or "unknown",
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "load_average_1_5_15": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        **versions,
    }


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f} ms"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _mebibytes(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.1f} MiB"


def bench_table(config: BenchConfig, rows: list[dict], compact: bool = False) -> Table:
    """Every row of the bench. `compact` (for narrow terminals): framework, setup and path
    share the first column, which wraps between words, and the units move into the headers."""
    table = Table(
        title=f"step time of one update (R ranks x M={config.accum} microbatches of "
        f"{config.rows} x {config.seq_len} tokens per rank, float32; "
        f"{config.rounds} rounds, torch {config.torch_rounds}, after {config.warmup} warm-up)"
    )
    names = ("framework", "setup", "path")
    numbers = ("median", "min", "max", "vs naive", "cpu", "cpu vs naive", "peak mem")
    units = ("ms", "ms", "ms", "", "ms", "", "MiB")
    if compact:
        table.add_column(" ".join(names), overflow="fold")
        for column, unit in zip(numbers, units, strict=True):
            header = f"{column}\n{unit}" if unit else "\n".join(column.rsplit(" ", 1))
            table.add_column(header, justify="right")
    else:
        for column in (*names, *numbers):
            table.add_column(column, justify="left" if column in names else "right")
    for row in rows:
        ratio = "[red]refused[/]" if row["refused"] else _ratio(row["ratio_to_naive"])
        figures = [
            _seconds(row["median_s"]),
            _seconds(row["min_s"]),
            _seconds(row["max_s"]),
            ratio,
            _seconds(row["cpu_median_s"]),
            _ratio(row["cpu_ratio_to_naive"]),
            _mebibytes(row["peak_mem_bytes"]),
        ]
        if compact:  # the unit is in the header
            figures = [f.removesuffix(" ms").removesuffix(" MiB") for f in figures]
            table.add_row(f"{row['framework']} {row['setup']} {row['path']}", *figures)
        else:
            table.add_row(row["framework"], row["setup"], row["path"], *figures)
    table.caption = (
        f"vs naive: {RATIO_METHOD}. median, min, max: wall time (torch: the slowest rank's); "
        "cpu: CPU time of all ranks (torch: summed over the rank processes; JAX: its process)"
    )
    return table


def print_report(console: Console, run: BenchRun, rows: list[dict], info: dict) -> None:
    """The table of every row, how memory was measured, the machine, and the acceptance."""
    config = run.config
    wide = bench_table(config, rows)
    console.print(fitted(console, wide, lambda: bench_table(config, rows, compact=True)))
    for row in rows:
        if row["refused"]:
            console.print(
                f"[red]refused[/] {row['framework']} {row['setup']} {row['path']}: "
                f"{row['refused']}",
                soft_wrap=True,
            )
    for name, framework in (("torch", run.torch), ("jax", run.jax)):
        if framework.error:
            console.print(f"[red]{name} did not run:[/] {framework.error}", soft_wrap=True)
        elif framework.output is not None:
            console.print(
                f"{name} peak memory: {framework.output['memory_method']}", soft_wrap=True
            )
    console.print("machine: " + ", ".join(f"{k} {v}" for k, v in info.items()), soft_wrap=True)
    for line in acceptance_lines(rows, quick=config.quick):
        console.print(line, soft_wrap=True)


def acceptance_lines(rows: list[dict], quick: bool = False) -> list[str]:
    """fused / naive per setup against the 2% budget (a line per setup), the ratio's 95%
    interval beside it: an interval reaching past the budget says the run cannot tell.

    `quick` (``--quick``): the same figures without a verdict, and one line saying why there
    is none."""
    lines = []
    for row in rows:
        if row["path"] != "fused" or row["ratio_to_naive"] is None:
            continue
        low, high = row["ratio_ci95"]
        figures = (
            f"fused / naive, {row['framework']} {row['setup']}: {row['ratio_to_naive']:.3f} "
            f"(95% interval {low:.3f} to {high:.3f}"
        )
        if quick:
            lines.append(f"{figures})")
            continue
        ok = row["ratio_to_naive"] <= FUSED_BUDGET
        verdict = "[green]within[/]" if ok else "[yellow]over[/]"
        lines.append(f"{figures}; {verdict} {FUSED_BUDGET})")
    if quick and lines:
        lines.append(QUICK_NO_VERDICT)
    return lines


def write_report(path: Path, run: BenchRun, rows: list[dict], info: dict) -> None:
    """The JSON report, written whole or not at all."""
    memory = {
        name: framework.output["memory_method"]
        for name, framework in (("torch", run.torch), ("jax", run.jax))
        if framework.output is not None
    }
    errors = {
        name: framework.error
        for name, framework in (("torch", run.torch), ("jax", run.jax))
        if framework.error
    }
    report = {
        "results": rows,
        "machine": info,
        "config": run.config.record(),
        "ratio_method": RATIO_METHOD,
        "memory_method": memory,
        "errors": errors,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps(report, indent=2).encode())
