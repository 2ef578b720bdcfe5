"""`python -m crosscheck verify`: run a user's step, print one row per case and the verdict."""

from __future__ import annotations

import argparse
import json
import math
import time

from rich.console import Console
from rich.table import Table

from crosscheck.verdict import LEVEL_NAMES
from crosscheck.verify import VerifyReport, verify


def verify_table(report: VerifyReport) -> Table:
    table = Table(title=f"{report.step} ({report.framework}) against {report.scheme.spec}")
    for column in (
        "fixture",
        "layout",
        "max rel err",
        "precision",
        "diagnosed as",
        "weight ratio",
        "scale",
    ):
        table.add_column(column, justify="left" if column in ("fixture", "layout") else "right")
    table.add_column("result", justify="right")
    for case in report.cases:
        d = case.diagnosis
        err = f"{case.max_rel_err:.2e}" if math.isfinite(case.max_rel_err) else "-"
        table.add_row(
            case.job.fixture,
            f"R={case.job.world_size},M={case.job.accum_steps}",
            err,
            "-" if d is None else LEVEL_NAMES[d.precision],
            "-" if d is None else d.best_match,
            "-" if d is None else f"{d.weight_ratio:.4g}",
            "-" if d is None else f"{d.scale:.6g}",
            "[green]pass[/]" if case.ok else ("[red]error[/]" if case.error else "[red]FAIL[/]"),
        )
    return table


def verify_command(args: argparse.Namespace, console: Console) -> int:
    started = time.perf_counter()
    precision = "float64" if args.strict else args.precision
    if args.strict and args.precision not in ("auto", "float64"):
        console.print(
            f"[red]crosscheck verify: --strict is --precision float64, not {args.precision}[/]"
        )
        return 2
    try:
        with console.status(f"running {args.step} in {args.framework} processes"):
            report = verify(
                args.step,
                framework=args.framework,
                scheme=args.scheme,
                fixtures=args.fixtures,
                world_sizes=args.world_sizes,
                accum_steps=args.accum,
                timeout_s=args.timeout,
                precision=precision,
                dtype=args.dtype,
            )
    except ValueError as error:
        console.print(f"[red]crosscheck verify: {error}[/]")
        return 2
    console.print(verify_table(report))
    console.print(report.message(), markup=False, highlight=False)
    wall = time.perf_counter() - started
    console.print(f"{'OK' if report.ok else 'FAIL'}   wall time {wall:.1f} s")
    if args.json is not None:
        record = report.to_json()
        record["wall_time_s"] = wall
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2, allow_nan=False) + "\n")
    return 0 if report.ok else 1
