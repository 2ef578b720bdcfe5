"""`python -m crosscheck verify`: run a user's step, print one row per case and the verdict.

The exit status (`verify_exit_code`, see `crosscheck.exit_codes`): 0 every case matches; 1 some
case was diagnosed as not matching (a non-finite gradient included); 3 no case mismatched but
some could not be run or read (a `crosscheck.verification.protocol.StepError`); 2 a set-up error,
found before any process starts (`crosscheck.verification.verifier.StepSetupError` for a ``--step``
that does not exist, or any other bad argument).
"""

from __future__ import annotations

import argparse
import json
import math
import time

from rich.console import Console
from rich.table import Table

from crosscheck import exit_codes
from crosscheck.cli.outputs import print_error, refuse
from crosscheck.cli.report import time_figures
from crosscheck.diagnosis.verdict import LEVEL_NAMES
from crosscheck.launch.cpu_time import cpu_seconds
from crosscheck.tables import fitted
from crosscheck.verification.objective_verify import ObjectiveCase, ObjectiveReport
from crosscheck.verification.verifier import VerifyCase, VerifyReport, verify


def _result(case: VerifyCase | ObjectiveCase) -> str:
    return "[green]pass[/]" if case.ok else ("[red]error[/]" if case.error else "[red]FAIL[/]")


def _number(value: float, spec: str) -> str:
    # NaN (no scale of a non-finite gradient) says nothing a "-" does not; inf ("unbounded"
    # weight ratio) does.
    return "-" if math.isnan(value) else format(value, spec)


def _error(value: float) -> str:
    # As before: a non-finite error is "-", the message says why.
    return format(value, ".2e") if math.isfinite(value) else "-"


def verify_table(report: VerifyReport) -> Table:
    table = Table(title=f"{report.step} ({report.framework}) against {report.scheme.name}")
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
        table.add_row(
            case.job.fixture,
            str(case.job.layout),
            _error(case.max_rel_err),
            "-" if d is None else LEVEL_NAMES[d.precision],
            "-" if d is None else d.best_match,
            "-" if d is None else _number(d.weight_ratio, ".4g"),
            "-" if d is None else _number(d.scale, ".6g"),
            _result(case),
        )
    return table


def compact_verify_table(report: VerifyReport) -> Table:
    """`verify_table` for narrow terminals: each cell stacks two or three values.

    Fixture over layout, diagnosis over precision, the three numbers over each other. Only the
    fixture column wraps (a fixture given as a long path); the others hold whole names.
    """
    table = Table(title=f"{report.step} ({report.framework}) against {report.scheme.name}")
    table.add_column("fixture\nlayout", overflow="fold")
    table.add_column("diagnosed as\nprecision", no_wrap=True)
    table.add_column("max rel err\nweight ratio\nscale", justify="right", no_wrap=True)
    table.add_column("result", justify="right", no_wrap=True)
    for case in report.cases:
        d = case.diagnosis
        numbers = [_error(case.max_rel_err)]
        if d is not None:
            numbers += [_number(d.weight_ratio, ".4g"), _number(d.scale, ".6g")]
        table.add_row(
            f"{case.job.fixture}\n{case.job.layout}",
            "-" if d is None else f"{d.best_match}\n{LEVEL_NAMES[d.precision]}",
            "\n".join(numbers),
            _result(case),
        )
    return table


def objective_table(report: ObjectiveReport) -> Table:
    """One row per case of a multi-term objective, narrow enough for 80 columns: the name
    given to the case (a pattern names its term), and for a case no pattern explains, the
    terms not weighted as intended."""
    table = Table(title=f"{report.step} ({report.framework}) against {report.objective.name}")
    table.add_column("fixture\nlayout", overflow="fold")
    table.add_column("max rel err\nprecision", justify="right", no_wrap=True)
    table.add_column("diagnosed as", overflow="fold")
    table.add_column("result", justify="right", no_wrap=True)
    for case in report.cases:
        d = case.diagnosis
        name = "-" if d is None else d.best_match
        off = [v["term"] for v in case.term_verdicts(report.objective) if not v["as_intended"]]
        if d is not None and "(" not in name and off:
            name += f" (terms off: {', '.join(off)})"
        table.add_row(
            f"{case.job.fixture}\n{case.job.layout}",
            f"{_error(case.max_rel_err)}\n{'-' if case.level is None else LEVEL_NAMES[case.level]}",
            name,
            _result(case),
        )
    return table


def report_table(console: Console, report: VerifyReport | ObjectiveReport) -> Table:
    """The report's table, in the layout that fits the console."""
    if isinstance(report, ObjectiveReport):  # one row per case, per-term names: narrow already
        return objective_table(report)
    return fitted(console, verify_table(report), lambda: compact_verify_table(report))


def print_verify_table(console: Console, report: VerifyReport | ObjectiveReport) -> None:
    console.print(report_table(console, report))


def write_verify_report(
    console: Console,
    report: VerifyReport | ObjectiveReport,
    args: argparse.Namespace,
    figures: str,
    record_extra: dict[str, float | int],
) -> None:
    """The table, the message and the verdict line ending in `figures`; with ``--json``, the
    report's JSON and `record_extra` beside it (a launched run's as its own)."""
    print_verify_table(console, report)
    console.print(report.message(), markup=False, highlight=False)
    if args.json is not None:
        record = {**report.to_json(), **record_extra}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2, allow_nan=False) + "\n")
    if getattr(args, "plot", None) is not None:
        diagnosis = report.diagnosis
        if diagnosis is None:
            print_error(
                f"crosscheck verify: --plot {args.plot}: no case was diagnosed, nothing drawn"
            )
        else:
            args.plot.parent.mkdir(parents=True, exist_ok=True)  # checked creatable up front
            try:
                diagnosis.plot(args.plot, report.step)
            except ValueError as error:  # nothing to draw: say why, keep the verdict
                print_error(f"crosscheck verify: --plot {args.plot}: {error}")
            else:
                case = diagnosis.case
                console.print(
                    f"wrote {args.plot} ({case})", markup=False, highlight=False, soft_wrap=True
                )
    # The verdict is the last line.
    console.print(f"{'OK' if report.ok else 'FAIL'}   {figures}")


def verify_exit_code(report: VerifyReport | ObjectiveReport) -> int:
    """OK, MISMATCH (some case diagnosed as not matching) or STEP_FAILED (no case mismatched,
    some could not be run or read); see `crosscheck.exit_codes`."""
    mismatched = any(not case.ok and case.diagnosis is not None for case in report.cases)
    return exit_codes.of_outcome(report.ok, mismatched)


def verify_command(args: argparse.Namespace, console: Console) -> int:
    started = time.perf_counter()
    precision = "float64" if args.strict else args.precision
    if args.strict and args.precision not in ("auto", "float64"):
        return refuse(
            console, f"crosscheck verify: --strict is --precision float64, not {args.precision}"
        )
    try:
        with console.status(f"running {args.step} in {args.framework} processes"):
            report = verify(
                args.step,
                framework=args.framework,
                scheme=args.scheme,
                objective=args.objective,
                fixtures=args.fixtures,
                world_sizes=args.world_sizes,
                accum_steps=args.accum_steps,
                timeout_s=args.timeout,
                precision=precision,
                dtype=args.dtype,
                device=args.device,
                platform=args.platform,
                model=args.model,
                forward=args.forward,
                context_sizes=args.context_sizes,
                context_orders=args.context_orders,
            )
    except ValueError as error:  # StepSetupError included: refused before any process started
        return refuse(console, f"crosscheck verify: {error}")
    wall = time.perf_counter() - started
    cpu = cpu_seconds()
    write_verify_report(
        console, report, args, time_figures(wall, cpu), {"wall_time_s": wall, "cpu_s": cpu}
    )
    return verify_exit_code(report)
