"""`python -m crosscheck bugs`: the catalogue table, the sensitivity lines, the multi-term
table, the JSON and the exit status (`catalogue_exit_code`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from crosscheck import exit_codes
from crosscheck.bugs.catalogue_run import (
    SKEW,
    SKEW_FIXTURE,
    SKEW_FLAGGED_AT,
    SKEW_LAYOUT,
    CatalogueRun,
)
from crosscheck.bugs.objective_catalogue import ObjectiveBugResult
from crosscheck.tables import cuts_a_cell, fitted

OBJECTIVE_TITLE = "multi-term objective bugs: one auxiliary term weighted wrongly, diagnosed"


def _num(value: float, spec: str) -> str:
    return format(value, spec) if math.isfinite(value) else "inf"


def _first_line(text: str, limit: int = 0) -> str:
    line = next((part for part in text.strip().splitlines() if part.strip()), "")
    return line[:limit] if limit else line


def compact_catalogue_table(run: CatalogueRun) -> Table:
    """`catalogue_table` for narrow terminals: a row's names stacked in two cells.

    The pattern with its framework, fixture and layout below it; what it was diagnosed as,
    with the verdict below it; the weight ratio over the scale. No cell wraps, so no name is
    cut; why a step failed to run is printed under the table (see `print_catalogue`).
    """
    table = Table(title="bug catalogue: each buggy step, verified and diagnosed")
    table.add_column("pattern\nrun", no_wrap=True)
    table.add_column("diagnosed as\nresult", no_wrap=True)
    table.add_column("weight ratio\nscale", justify="right", no_wrap=True)
    table.add_column("vs\nintended", justify="right", no_wrap=True)
    for r in run.results:
        if r.ok:
            verdict = "[green]named[/]"
        elif r.error:
            verdict = "[red]FAIL[/]: did not run"
        else:
            verdict = "[red]FAIL[/]: " + ("misnamed" if r.detected else "not detected")
        named = r.diagnosed_as if r.diagnosed_as == r.run.pattern else f"[red]{r.diagnosed_as}[/]"
        table.add_row(
            f"{r.run.pattern}\n{r.run.framework} {r.run.fixture}\n{r.run.where}",
            f"{named}\n{verdict}",
            f"{_num(r.weight_ratio, '.4g')}\n{_num(r.scale, '.6g')}",
            _num(r.intended_error, ".2e"),
        )
    return table


def catalogue_table(run: CatalogueRun) -> Table:
    table = Table(title="bug catalogue: each buggy step, verified and diagnosed")
    for column, justify in (
        ("pattern", "left"),
        ("framework", "left"),
        ("fixture", "left"),
        ("layout", "left"),
        ("detected", "center"),
        ("diagnosed as", "left"),
        ("weight ratio", "right"),
        ("scale", "right"),
        ("vs intended", "right"),
        ("result", "right"),
    ):
        # Pattern names are the point of the table: never cut them.
        table.add_column(
            column, justify=justify, no_wrap=column in ("pattern", "fixture", "diagnosed as")
        )
    for r in run.results:
        table.add_row(
            r.run.pattern,
            r.run.framework,
            r.run.fixture,
            r.run.where,
            "yes" if r.detected else "[red]no[/]",
            r.diagnosed_as if r.diagnosed_as == r.run.pattern else f"[red]{r.diagnosed_as}[/]",
            _num(r.weight_ratio, ".4g"),
            _num(r.scale, ".6g"),
            _num(r.intended_error, ".2e"),
            "[green]named[/]" if r.ok else f"[red]FAIL[/] {r.error[:60]}",
        )
    return table


def _objective_verdict(r: ObjectiveBugResult) -> tuple[str, str]:
    """(diagnosed as, result) cells of a multi-term row: a wrong name in red."""
    named = r.diagnosed_as if r.diagnosed_as == r.run.named else f"[red]{r.diagnosed_as}[/]"
    if r.ok:
        return named, "[green]named[/]"
    if r.error:
        return named, "[red]FAIL[/]: did not run"
    return named, "[red]FAIL[/]: " + ("misnamed" if r.detected else "not detected")


def objective_table(rows: list[ObjectiveBugResult], compact: bool = False) -> Table:
    """One row per (pattern, framework, fixture, layout): detected (the intended objective does
    not fit) and named (the pattern on its term). `compact` stacks a row in two cells, the
    names in the first, so that no name is cut on a narrow terminal."""
    table = Table(title=OBJECTIVE_TITLE)
    if compact:
        table.add_column("pattern(term)\nrun\ndiagnosed as", no_wrap=True)
        table.add_column("result\nvs intended", justify="right", no_wrap=True)
    else:
        for column in ("pattern(term)", "framework", "fixture", "layout", "detected"):
            table.add_column(column, no_wrap=column != "detected")
        table.add_column("diagnosed as", no_wrap=True)
        table.add_column("vs intended", justify="right")
        table.add_column("result", justify="right")
    for r in rows:
        layout = f"R={r.run.world_size},M={r.run.accum_steps}"
        named, verdict = _objective_verdict(r)
        error = _num(r.intended_error, ".2e")
        if compact:
            run = f"{r.run.named}\n{r.run.framework} {r.run.fixture} {layout}\n{named}"
            table.add_row(run, f"{verdict}\n{error}")
        else:
            detected = "yes" if r.detected else "[red]no[/]"
            cells = (r.run.named, r.run.framework, r.run.fixture, layout, detected, named)
            table.add_row(*cells, error, verdict)
    return table


def print_objective_rows(console: Console, rows: list[ObjectiveBugResult]) -> None:
    """The multi-term table, why any step did not run, and how many were named."""
    if not rows:
        return
    console.print(fitted(console, objective_table(rows), lambda: objective_table(rows, True)))
    for r in rows:
        if r.error:
            console.print(
                f"[red]FAIL[/] {escape(r.run.describe())}: {escape(_first_line(r.error))}"
            )
    named = sum(r.ok for r in rows)
    console.print(f"{named} of {len(rows)} multi-term buggy steps detected and named")


def skew_lines(run: CatalogueRun) -> list[str]:
    R, M = SKEW_LAYOUT
    lines = [
        f"minimum detectable per-rank skew on {SKEW_FIXTURE} (R={R}, M={M}), measured from each "
        "correct step's own noise: "
        + ", ".join(
            f"{fw} {dtype} 1 + {_num(value, '.2e')}"
            for (fw, dtype), value in sorted(run.minimum_skew.items())
        )
    ]
    for s in run.skews:
        mark = f"flagged as {s.diagnosed_as}" if s.flagged else "passes"
        if s.error:
            mark = f"did not run: {s.error.splitlines()[0][:120]}"
        lines.append(
            f"  {s.run.framework} {s.run.dtype} skew 1 + {s.run.skew - 1:.2e}: relative error "
            f"{_num(s.rel_err, '.2e')} at {s.precision} -> {mark}"
            + ("" if s.ok else "  [red]UNEXPECTED[/]")
        )
    return lines


def print_catalogue(console: Console, run: CatalogueRun) -> None:
    wide = catalogue_table(run)
    compact = cuts_a_cell(console, wide)
    if run.results:  # none when only multi-term patterns were asked for
        console.print(compact_catalogue_table(run) if compact else wide)
    if compact:
        # The compact table has no room for why a step did not run: one line each here.
        for r in run.results:
            if r.error:
                console.print(
                    f"[red]FAIL[/] {escape(r.run.describe())}: {escape(_first_line(r.error))}"
                )
    for line in skew_lines(run):
        console.print(line)
    print_objective_rows(console, run.objectives)
    named = sum(r.ok for r in run.results)
    must = [s for s in run.skews if s.run.skew == SKEW and s.run.dtype in SKEW_FLAGGED_AT]
    flagged = bool(must) and all(s.flagged for s in must)
    bf16 = [v for (_, dtype), v in run.minimum_skew.items() if dtype == "bfloat16"]
    bf16_text = f"; bf16 detects from 1 + {_num(max(bf16), '.1e')}" if bf16 else ""
    console.print(
        f"{named} of {len(run.results)} buggy steps detected and named; a {SKEW}x skew "
        + ("is" if flagged else "is NOT")
        + f" flagged in every framework at {' and '.join(SKEW_FLAGGED_AT)}{bf16_text}: "
        + ("[green]OK[/]" if run.ok else "[red]FAIL[/]")
    )


def catalogue_exit_code(run: CatalogueRun) -> int:
    """OK; MISMATCH when some buggy step ran and was not detected and named (or a skew run
    was judged wrongly); STEP_FAILED when every failure is a step that could not be run (a
    skew run without a measured minimum counts as such: the correct run it needs did not)."""
    rows = [*run.results, *run.objectives]
    mismatched = any(not r.ok and not r.error for r in rows) or any(
        not s.ok and not s.error and math.isfinite(s.minimum) for s in run.skews
    )
    return exit_codes.of_outcome(run.ok, mismatched)


def write_catalogue_json(path: Path, run: CatalogueRun, wall_s: float) -> None:
    record = run.to_json()
    record["wall_time_s"] = wall_s
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, allow_nan=False) + "\n")
