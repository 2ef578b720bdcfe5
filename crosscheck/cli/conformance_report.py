"""`python -m crosscheck conformance`: the real frameworks' settings, run and held to expectations.

Every setting of `crosscheck.conformance.settings` whose framework is installed runs through
`crosscheck.verify` (`crosscheck.conformance.runner`); one row per framework==version x
setting says what the documentation promises, the verdict, the precision, the worst error and
whether that is what `expectations.toml` records for this version. The exit status: 0 every row
as expected; 1 a row differs from its expectation (or has none for this version); 3 no row
differs but one could not be run; 2 a set-up error (an unknown framework or setting, one named
that is not installed, an output that cannot be written), before anything runs.

``--markdown PATH`` writes the table as published in docs/conformance.md: the date, gradweight's
commit, every version and the machine, and the command that reproduces each row.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from crosscheck import exit_codes
from crosscheck.cli.outputs import check_outputs, refuse
from crosscheck.conformance.expectations import ExpectationsError, load_expectations
from crosscheck.conformance.runner import (
    AS_EXPECTED,
    COULD_NOT_RUN,
    DIFFERS,
    NO_EXPECTATION,
    Row,
    installed_version,
    run_setting,
    skipped_reason,
)
from crosscheck.conformance.settings import Setting, find_settings
from crosscheck.launch.cpu_time import cpu_seconds

#: The versions every row depends on, printed in the header.
PLATFORM_DISTRIBUTIONS = ("torch", "jax", "numpy")


def _error(value: float | None) -> str:
    return "-" if value is None else f"{value:.2e}"


def _verdict(row: Row) -> str:
    if row.verdict == "pass":
        return f"pass ({row.precision})" if row.precision else "pass"
    if row.scale is not None:
        return f"{row.verdict} (scale {row.scale:.4g})"
    return row.verdict


def _expected(row: Row) -> str:
    if row.outcome in (AS_EXPECTED, DIFFERS):
        return row.expectation.verdict if row.expectation else "-"
    return row.outcome


def _intended(setting: Setting) -> str:
    """The intended scheme or objective as the table shows it: an object by its name, without
    the module it is imported from (the reproduction command has it whole)."""
    module, _, name = setting.intended.rpartition(":")
    return name if "." in module else setting.intended


def _layouts(setting: Setting) -> str:
    return f"R {','.join(map(str, setting.world_sizes))} x M {','.join(map(str, setting.accum))}"


def conformance_table(rows: list[Row]) -> Table:
    table = Table(title="real frameworks, one optimizer update each, against their documentation")
    for column in ("framework", "setting", "intended", "verdict", "max rel err", "cases"):
        table.add_column(column, overflow="fold")
    table.add_column("expected", overflow="fold")
    table.add_column("result", justify="right")
    for row in rows:
        ok = row.outcome == AS_EXPECTED
        result = "[green]ok[/]" if ok else f"[red]{row.outcome}[/]"
        if not row.setting.runs:
            result = f"[yellow]{row.outcome}[/]"
        table.add_row(
            row.label,
            row.setting.title,
            _intended(row.setting) if row.setting.runs else "-",
            _verdict(row),
            _error(row.max_rel_err),
            _cases(row) if row.setting.runs else "-",
            _expected(row),
            result,
        )
    return table


def _cases(row: Row) -> str:
    """How many fixture x layout cases ran, on which fixtures and layouts."""
    return f"{row.cases}: {', '.join(row.setting.fixtures)}; {_layouts(row.setting)}"


def print_commands(console: Console, rows: list[Row]) -> None:
    """The `crosscheck verify` command that reproduces each row alone."""
    ran = [row for row in rows if row.setting.runs]
    if ran:
        console.print("reproduce a row alone:")
    for row in ran:
        console.print(
            f"  {escape(row.setting.key)}: {escape(row.setting.command_line())}", soft_wrap=True
        )


def exit_code(rows: list[Row]) -> int:
    outcomes = {row.outcome for row in rows}
    if outcomes & {DIFFERS, NO_EXPECTATION}:
        return exit_codes.MISMATCH
    if COULD_NOT_RUN in outcomes:
        return exit_codes.STEP_FAILED
    return exit_codes.OK


def _commit() -> str:
    try:
        found = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            cwd=Path(__file__).resolve().parents[2],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown (not a git checkout)"
    return found.stdout.strip()


def environment() -> dict:
    """What the table's figures depend on: date, commit, machine, the platform's versions."""
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "gradweight_commit": _commit(),
        "python": platform.python_version(),
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores",
        "versions": {name: installed_version(name) for name in PLATFORM_DISTRIBUTIONS},
    }


def _details(console: Console, rows: list[Row]) -> None:
    """Per row that is not plainly as expected: why, and the command that reproduces it."""
    for row in rows:
        s = row.setting
        if row.outcome == AS_EXPECTED and row.verdict == "pass":
            continue
        console.print(f"[bold]{escape(s.key)}[/] ({escape(s.title)}): {row.outcome}")
        if row.expectation is not None and row.expectation.evidence:
            console.print(f"  evidence: {escape(row.expectation.evidence)}", soft_wrap=True)
        if s.prediction and not s.runs:
            console.print(f"  prediction: {escape(s.prediction)}", soft_wrap=True)
        if row.message and row.outcome in (DIFFERS, NO_EXPECTATION, COULD_NOT_RUN):
            console.print(escape(row.message), soft_wrap=True)
        elif not s.runs:
            console.print(f"  why: {escape(row.message)}", soft_wrap=True)


def markdown(rows: list[Row], skipped: list[tuple[Setting, str]], env: dict, wall: float) -> str:
    """docs/conformance.md: the table as the command printed it, with what it ran on."""
    versions = {**env["versions"]}
    for row in rows:
        versions[row.setting.framework] = row.version
        versions.update(row.also)
    pinned = ", ".join(f"{name} {v}" for name, v in sorted(versions.items()) if v)
    lines = [
        "# Conformance: what real trainers weight, per version and setting",
        "",
        "Generated by `python -m crosscheck conformance --markdown docs/conformance.md` "
        "(`make conformance`); do not edit by hand. Each row is one optimizer update of the "
        "framework's own training code on a tiny model, in crosscheck's verify ranks (gloo, "
        "CPU), judged against the scheme the framework's documentation promises "
        "([verify.md](verify.md)); the expectations, with the evidence for every expected "
        "failure, are `crosscheck/conformance/expectations.toml`. How the adapters run the "
        "frameworks: `crosscheck/conformance/adapters/`.",
        "",
        "**Reading a row.** `intended` is the scheme the framework's documentation promises "
        "for the setting (its words and file:line are under the table), or for a loss with a "
        "second term the multi-term objective it means "
        "([verify.md](verify.md#multi-term-objectives)); `verdict` is `pass` "
        "(at the precision the update's own arithmetic shows) or the name that explains every "
        "case of the run, a pattern of [bugs.md](bugs.md), a scheme, or a family "
        "(`microbatch-skew`: a factor per microbatch; `scale`: every token alike) with its "
        "scale, or the names the setting's layouts cannot tell apart (`microbatch-mean or "
        "microstep-mean`: at R = 1 they predict one gradient); `expected` is what "
        "`expectations.toml` records for this version, and "
        "`evidence` the upstream issue or the documentation it agrees with or contradicts. "
        "`crosscheck conformance --frameworks trl` in a framework's own CI fails (exit 1) when "
        "a new version changes a verdict, until the expectation is updated.",
        "",
        f"- date: {env['date']}; gradweight commit {env['gradweight_commit']}",
        f"- machine: {env['machine']}, Python {env['python']}",
        f"- versions: {pinned}",
        f"- {len([r for r in rows if r.setting.runs])} settings run in {wall:.0f} s",
        "",
        "| framework | setting | intended | verdict | max rel err | expected | evidence |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if not row.setting.runs:
            continue
        evidence = row.expectation.evidence if row.expectation else ""
        lines.append(
            f"| {row.label} | {row.setting.title} | `{row.setting.intended}` | {_verdict(row)} "
            f"| {_error(row.max_rel_err)} | {_expected(row)} | {evidence} |"
        )
    lines += ["", "## What each setting promises, and the command that reproduces it", ""]
    for row in rows:
        s = row.setting
        if not s.runs:
            continue
        lines += [
            f"**{s.key}**: {s.title}. {row.cases} cases, fixtures {', '.join(s.fixtures)}, "
            f"layouts {_layouts(s)}. Documented: {s.promise} ({s.source}). Run with: "
            f"{s.deviations}.",
            "",
            "```",
            s.command_line(),
            "```",
            "",
        ]
    waiting = [row for row in rows if not row.setting.runs]
    if waiting:
        lines += ["## Listed, not run", ""]
        lines += ["| framework | setting | why | what the code predicts |", "|---|---|---|---|"]
        for row in waiting:
            s = row.setting
            lines.append(f"| {row.label} | {s.title} | {row.message} | {s.prediction or ''} |")
        lines.append("")
    if skipped:
        lines += ["## Skipped (not installed when the table was made)", ""]
        lines += [f"- {s.key}: {why}" for s, why in skipped]
        lines.append("")
    return "\n".join(lines)


def _refusal(args: argparse.Namespace) -> tuple[list[Setting], str]:
    """The chosen settings, or a set-up problem in one line."""
    try:
        chosen = find_settings(args.frameworks, args.settings)
    except ValueError as error:
        return [], f"crosscheck conformance: {error}"
    for name in args.frameworks or []:
        named = (s for s in chosen if s.framework == name and s.runs)
        why = next((why for s in named if (why := skipped_reason(s))), None)
        if why:
            return [], f"crosscheck conformance: --frameworks {name}: {why}"
    problem = check_outputs("conformance", {"--json": args.json, "--markdown": args.markdown})
    return chosen, problem


def conformance_command(args: argparse.Namespace, console: Console) -> int:
    started = time.perf_counter()
    # Every setting runs on the CPU: DeepSpeed (which transformers imports when installed)
    # then takes its CPU accelerator without probing for one and saying so in every rank.
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    chosen, problem = _refusal(args)
    if problem:
        return refuse(console, problem)
    try:
        expectations = load_expectations()
    except ExpectationsError as error:
        return refuse(console, f"crosscheck conformance: {error}")
    skipped = [(s, why) for s in chosen if (why := skipped_reason(s))]
    skipped_keys = {s.key for s, _ in skipped}
    rows: list[Row] = []
    for setting in chosen:
        if setting.key in skipped_keys:
            continue
        with console.status(f"{setting.key}: {setting.title}"):
            rows.append(run_setting(setting, expectations))
    console.print(conformance_table(rows))
    _details(console, rows)
    print_commands(console, rows)
    for setting, why in skipped:
        console.print(f"skipped {escape(setting.key)}: {escape(why)}", soft_wrap=True)
    wall = time.perf_counter() - started
    env = environment()
    judged = [row for row in rows if row.setting.runs]
    frameworks = {row.setting.framework for row in judged}
    expected = sum(row.outcome == AS_EXPECTED for row in judged)
    code = exit_code(rows)
    console.print(
        f"{'OK' if code == exit_codes.OK else 'FAIL'}   {len(judged)} settings of "
        f"{len(frameworks)} frameworks run, {expected} as expected; "
        f"wall time {wall:.1f} s, CPU {cpu_seconds():.1f} s"
    )
    if args.json is not None:
        record = {
            **env,
            "wall_time_s": round(wall, 1),
            "rows": [row.to_json() for row in rows],
            "skipped": {s.key: why for s, why in skipped},
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2, allow_nan=False) + "\n")
    if args.markdown is not None:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown(rows, skipped, env, wall))
    return code
