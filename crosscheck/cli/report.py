"""Terminal tables, the JSON report and the per-update JSONL log of a run.

By default the terminal shows one line per family of rows (a kind of check: `family_table`),
every failure in full, the plan's combinations not run (how many, for how many reasons), the
time and the verdict, last. `--rows group` prints a table per check instead, rows grouped
(vs-oracle rows by scheme and implementation, over fixtures, strategies and layouts; see
GROUP_BY) with the worst error of the group, and the reasons the plan did not run some
combinations; `--rows case` a row per case. The JSON holds every row and every combination not
run (`skipped`).

Every table has a compact layout for narrow terminals (80 columns): the names that identify a
row share one column that wraps between names, never inside one, and the numbers keep their
own columns (`crosscheck.tables.fitted` picks the layout that fits).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from crosscheck import exit_codes
from crosscheck.contract.cases import Case, CaseResult, RankMetrics, SkippedCase
from crosscheck.contract.schemes import resolve_scheme
from crosscheck.judge.compare import RTOL_BY_DTYPE
from crosscheck.launch.schedule import JobTiming
from crosscheck.tables import fitted

CHECK_TITLES = {
    "layout-invariance": "oracle: gradient under each layout vs the single-device gradient",
    "vs-oracle": "implementations vs the oracle (gradient and params after the last update)",
    "cross-impl": "implementations vs each other (gradients)",
    "world-size-change": "world-size change: same global batch, R x M fixed, same update?",
    "resume": "checkpoint resume vs an uninterrupted run",
    "clipping": "clipping placement",
    "objective": "multi-term objectives vs the oracle (every trained param, every term's D)",
    "term-layout": "oracle: each term's gradient under each layout vs R=1, M=1",
    "context-parallel": "context parallel: implementations vs the oracle at DP x CP layouts",
    "cp-layout-invariance": "oracle: gradient at each DP x CP layout vs R=1, M=1, C=1",
}


#: The checks that compare a layout with another: there an accidental scheme, a local term or
#: clipping per microbatch is expected to move the result (the others compare with a
#: reference at the same layout, which every row must match).
MOVING_CHECKS = ("clipping", "layout-invariance", "world-size-change", "term-layout")


def moves_with_layout(row: CaseResult) -> bool:
    """Whether the contract expects the row to differ between the layouts it compares."""
    return row.check in MOVING_CHECKS and expects_a_move(row)


def expects_a_move(row: CaseResult) -> bool:
    """Whether the row's check may move with the layout, as the contract predicts: an
    accidental scheme, a term normalized more locally than the update
    (`crosscheck.run.objectives`), clipping per microbatch (it moves the update where a norm
    exceeds the threshold)."""
    if row.check == "clipping":
        return True
    if row.check in ("objective", "term-layout"):
        return row.extra.get("expected") == "layout-dependent"
    return not resolve_scheme(row.scheme).intended


def _failed_verdict(rows: Sequence[CaseResult]) -> str:
    """``NOT RUN`` when every failing row could not be run, ``FAIL`` when some failed, else ""."""
    failed = [r for r in rows if not r.ok]
    if failed and all(r.not_run for r in failed):
        return "[red]NOT RUN[/]"
    return "[red]FAIL[/]" if failed else ""


def _verdict(rows: list[CaseResult]) -> str:
    failed = _failed_verdict(rows)
    if failed:
        return failed
    if moves_with_layout(rows[0]):
        # An accidental scheme moves with the layout, except where the layouts compared split
        # the batch into the same microbatches (microbatch_mean at fixed R x M). Clipping per
        # microbatch moves the update only where a norm exceeds the threshold.
        tol = 2 * RTOL_BY_DTYPE[rows[0].dtype]
        if max(r.max_rel_err for r in rows) > tol:
            return "[yellow]differs, as expected[/]"
        return "[green]same here[/]"
    return "[green]pass[/]"


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2e}"


#: What rows of each check are grouped by in the default (grouped) table.
GROUP_BY: dict[str, tuple[str, ...]] = {
    "layout-invariance": ("scheme",),
    "vs-oracle": ("scheme", "impl"),
    "cross-impl": ("scheme",),
    "world-size-change": ("scheme", "impl"),
    "resume": ("impl", "strategy"),
    "clipping": ("strategy",),
    "objective": ("scheme", "impl"),
    "term-layout": ("scheme",),
    "context-parallel": ("scheme", "impl"),
    "cp-layout-invariance": ("scheme",),
}
COLUMNS = ("fixture", "scheme", "impl", "strategy")
PLURALS = {"fixture": "fixtures", "scheme": "schemes", "impl": "impls", "strategy": "strategies"}


def _collapse(values: set[str], noun: str) -> str:
    return next(iter(values)) if len(values) == 1 else f"{len(values)} {noun}"


def _compact_verdict(verdict: str) -> str:
    # Two short lines instead of one long one: the result column stays narrow.
    return verdict.replace(", as expected", ",\nas expected").replace("same here", "same\nhere")


def _constant(column: list[str]) -> bool:
    return len(set(column)) == 1


#: How a cell reads out of its column (the compact table's shared column, a title).
LABELS = {"R": "R={}", "M": "M={}"}


def _stated(header: str, value: str) -> str:
    """A constant column's value, said once: ``impl oracle``, ``R=2``, ``4 cases each``, and a
    count that names itself as it is (``2 fixtures``)."""
    if header in LABELS:
        return LABELS[header].format(value)
    if header == "cases":
        return f"{value} case each" if value == "1" else f"{value} cases each"
    if value.endswith(f" {PLURALS.get(header, header)}"):
        return value
    return f"{header} {value}"


def results_table(
    check: str, rows: list[CaseResult], per_case: bool, compact: bool = False
) -> tuple[str, Table]:
    """One check's rows, grouped (GROUP_BY) or one per case: its heading and its table.

    A column with the same cell in every line of a table of several lines is not drawn: its
    value goes under the title once (``impl oracle · strategy closed-form``), and a column of
    dashes (no deviation from token_mean to show) is dropped. The heading is text of its own,
    wrapped at the console's width, not the table's title (a narrow table would fold it).
    `compact` (for narrow terminals): fixture, scheme, impl and strategy (and R, M, dtype per
    case) share the first column, the only one that wraps (between names), and the headers
    take two lines.
    """
    names = [*COLUMNS, *(("R", "M", "dtype") if per_case else ())]
    numbers = [*(() if per_case else ("cases",)), "max rel err", "vs token_mean"]
    numbers += ["weight ratio", "result"]
    key_fields = (*COLUMNS, "world_size", "accum_steps", "dtype") if per_case else GROUP_BY[check]
    groups: dict[tuple, list[CaseResult]] = {}
    for row in rows:
        groups.setdefault(tuple(getattr(row, f) for f in key_fields), []).append(row)
    lines = []
    for group in groups.values():
        deviations = [r.deviation for r in group if r.deviation is not None]
        cells = [_collapse({getattr(r, field) for r in group}, PLURALS[field]) for field in COLUMNS]
        if per_case:
            cells += [str(group[0].world_size), str(group[0].accum_steps), group[0].dtype]
        else:
            cells.append(str(len(group)))
        verdict = _verdict(group)
        cells += [
            _fmt(max(r.max_rel_err for r in group)),
            _fmt(max(deviations)) if deviations else "-",
            f"{max(r.weight_ratio for r in group):.3g}",
            _compact_verdict(verdict) if compact else verdict,
        ]
        lines.append(cells)
    headers = [*names, *numbers]
    shown = list(range(len(headers)))
    title = CHECK_TITLES.get(check, check)
    if len(lines) > 1:
        constant = [i for i in shown if _constant([line[i] for line in lines])]
        stated = [
            _stated(headers[i], lines[0][i])
            for i in constant
            if lines[0][i] != "-" and headers[i] != "result"
        ]
        # The result stays: it is the verdict of each line, even where all agree.
        shown = [i for i in shown if i not in constant or headers[i] == "result"]
        if stated:  # a line of its own, each value a word by itself (to copy, to search)
            title += "\n" + " · ".join(stated)
    table = Table()
    named = [i for i in shown if headers[i] in names]
    counted = [i for i in shown if headers[i] not in names]
    if compact and named:
        table.add_column(" ".join(headers[i] for i in named), overflow="fold")
        for i in counted:
            table.add_column(headers[i].replace(" ", "\n", 1), justify="right", no_wrap=True)
    else:
        for i in shown:
            table.add_column(headers[i], justify="left" if headers[i] in COLUMNS else "right")
    for line in lines:
        if compact and named:
            words = [LABELS.get(headers[i], "{}").format(line[i]) for i in named]
            table.add_row(" ".join(words), *(line[i] for i in counted))
        else:
            table.add_row(*(line[i] for i in shown))
    return title, table


#: Each check's line in the one-line-per-family summary (`family_table`).
FAMILY_NAMES = {
    "layout-invariance": "oracle: layouts",
    "vs-oracle": "impls vs oracle",
    "cross-impl": "impls vs each other",
    "world-size-change": "world-size change",
    "resume": "checkpoint resume",
    "clipping": "clipping placement",
    "objective": "objectives vs oracle",
    "term-layout": "oracle: term layouts",
    "context-parallel": "context parallel vs oracle",
    "cp-layout-invariance": "oracle: context layouts",
}


def family_table(rows: Sequence[CaseResult]) -> Table:
    """One line per family of rows (a check): how many rows, how many passed and, of those,
    how many the contract expects to move with the layout (`expects_a_move`), and
    the worst relative error of the rows that must match their reference ("all move" where
    every row may move)."""
    table = Table(title="checks (--rows group: a table per check)", title_justify="left")
    for column in ("check", "rows", "passed", "expected\nto move", "worst\nrel err"):
        table.add_column(column, justify="left" if column == "check" else "right")
    table.add_column("result", justify="right")
    by_check: dict[str, list[CaseResult]] = {}
    for row in rows:
        by_check.setdefault(row.check, []).append(row)
    for check, group in by_check.items():
        passed = [r for r in group if r.ok]
        moved = sum(moves_with_layout(r) for r in passed)
        must_match = [r.max_rel_err for r in group if not moves_with_layout(r) and not r.not_run]
        table.add_row(
            FAMILY_NAMES.get(check, check),
            str(len(group)),
            str(len(passed)),
            str(moved),
            # NaN first: a row that should match and came back NaN is the worst of all.
            _fmt(max(must_match, key=lambda e: (math.isnan(e), e))) if must_match else "all move",
            _failed_verdict(group) or "[green]pass[/]",
        )
    return table


def print_results(
    console: Console, rows: list[CaseResult], layout: Literal["family", "group", "case"] = "family"
) -> None:
    """The run's rows: one line per family (`layout` "family"), a table per check of grouped
    rows ("group") or of single cases ("case"); then every failure, each in full (the first
    20; the JSON holds them all)."""
    if layout == "family":
        console.print(family_table(rows))
    else:
        by_check: dict[str, list[CaseResult]] = {}
        for row in rows:
            by_check.setdefault(row.check, []).append(row)
        per_case = layout == "case"
        for check, group in by_check.items():
            heading, wide = results_table(check, group, per_case)
            console.print(heading, markup=False, highlight=False)
            compact = lambda c=check, g=group: results_table(c, g, per_case, True)[1]  # noqa: E731
            console.print(fitted(console, wide, compact))
    failures = [r for r in rows if not r.ok]
    for row in failures[:20]:
        verdict = "NOT RUN" if row.not_run else "FAIL"
        console.print(
            f"[red]{verdict}[/] {row.check} {row.impl} {row.fixture}/{row.scheme} {row.strategy} "
            f"R={row.world_size} M={row.accum_steps} {row.dtype}: {escape(row.detail)}",
            soft_wrap=True,
        )
    if len(failures) > 20:
        console.print(f"[red]... and {len(failures) - 20} more failures (see --json)[/]")


def timings_table(timings: Iterable[JobTiming]) -> Table:
    """When each job of the run started and ended: where the wall time went."""
    table = Table(title="jobs (seconds since the run's jobs began)")
    for column in ("job", "processes", "start", "end", "took"):
        table.add_column(column, justify="left" if column == "job" else "right")
    for t in timings:
        took = t.end - t.start
        table.add_row(t.name, str(t.processes), f"{t.start:.1f}", f"{t.end:.1f}", f"{took:.1f}")
    return table


def run_ok(rows: Sequence[CaseResult]) -> bool:
    """The verdict of a run: at least one row, and every row what the contract expects (a
    run that checked nothing has not passed)."""
    return bool(rows) and all(r.ok for r in rows)


def run_exit_code(rows: Sequence[CaseResult]) -> int:
    """`run`'s exit status (crosscheck.exit_codes): OK when `run_ok`; STEP_FAILED when every
    failing row is one that could not be run (`CaseResult.not_run`: an implementation raised,
    timed out or came back with nothing comparable); MISMATCH otherwise, a run that checked
    nothing included. A mismatch wins over a crash."""
    mismatched = not rows or any(not r.ok and not r.not_run for r in rows)
    return exit_codes.of_outcome(run_ok(rows), mismatched)


def skip_reasons(skipped: Iterable[SkippedCase]) -> list[tuple[str, int]]:
    """(reason, how many combinations it skipped), the most frequent first."""
    return Counter(s.reason for s in skipped).most_common()


def skipped_table(skipped: Sequence[SkippedCase], compact: bool = False) -> Table:
    """The plan's combinations that did not run, one row per reason.

    `compact` (for narrow terminals): the checks, impls and fixtures share one column, a line
    each, and the count's header is shorter.
    """
    table = Table(
        title="planned combinations not run (see --json for each one)", title_justify="left"
    )
    columns = (
        ("reason", "count", "checks / impls / fixtures")
        if compact
        else ("reason", "combinations", "checks", "impls", "fixtures")
    )
    for column in columns:
        right = column in ("combinations", "count")
        table.add_column(column, justify="right" if right else "left", no_wrap=right)
    for reason, count in skip_reasons(skipped):
        mine = [s for s in skipped if s.reason == reason]
        where = [
            ", ".join(sorted({s.check for s in mine})),
            ", ".join(sorted({s.impl for s in mine})),
            ", ".join(sorted({s.fixture for s in mine})),
        ]
        table.add_row(escape(reason), str(count), *(["\n".join(where)] if compact else where))
    return table


def print_skipped(console: Console, skipped: Sequence[SkippedCase]) -> None:
    """`skipped_table`, in the layout that fits the console."""
    console.print(fitted(console, skipped_table(skipped), lambda: skipped_table(skipped, True)))


def _rows(count: int) -> str:
    return f"{count} row" if count == 1 else f"{count} rows"


def summary_lines(
    rows: Sequence[CaseResult],
    wall_s: float,
    skipped: Sequence[SkippedCase] = (),
    cpu_s: float | None = None,
    reasons: bool = True,
) -> list[str]:
    """The run's last lines: what the plan did not run (with every reason, or, without
    `reasons`, how many reasons and where they are listed), the wall time and, when given,
    CPU seconds (this process and every process it started), and the one-line verdict."""
    lines = []
    if skipped:
        counts = skip_reasons(skipped)
        if reasons:
            by_reason = "; ".join(f"{count} {escape(reason)}" for reason, count in counts)
            lines.append(f"{len(skipped)} planned combinations not run: {by_reason}")
        else:
            lines.append(
                f"{len(skipped)} planned combinations not run, for {len(counts)} "
                f"reason{'s' if len(counts) > 1 else ''}: see --rows group or --json"
            )
    lines.append(time_figures(wall_s, cpu_s))
    lines.append(verdict_line(rows))
    return lines


def verdict_line(rows: Sequence[CaseResult]) -> str:
    """``OK: 7052 rows, 0 failed (738 expected to move with the layout)``, or FAILED and why."""
    if not rows:
        return "[red]FAILED: nothing was checked[/]"
    failed = sum(not r.ok for r in rows)
    if failed:
        not_run = sum(not r.ok and r.not_run for r in rows)
        could_not = f", {not_run} of them could not run" if not_run else ""
        return f"[red]FAILED[/]: {failed} of {_rows(len(rows))} failed{could_not}"
    moved = sum(moves_with_layout(r) for r in rows)
    return f"[green]OK[/]: {_rows(len(rows))}, 0 failed ({moved} expected to move with the layout)"


def time_figures(wall_s: float, cpu_s: float | None) -> str:
    """ "wall time 61.2 s, CPU 118.4 s": the CPU seconds of the command and every process it
    started, beside the wall time (on a shared machine the CPU figure is the steadier one)."""
    cpu = "" if cpu_s is None else f", CPU {cpu_s:.1f} s"
    return f"wall time {wall_s:.1f} s{cpu}"


def write_json(
    path: Path,
    rows: Sequence[CaseResult],
    wall_s: float,
    meta: dict[str, Any],
    skipped: Sequence[SkippedCase] = (),
    cpu_s: float | None = None,
) -> None:
    """The report: `ok`, `wall_s`, `cpu_s` (None when not measured), `meta`'s keys, `skipped`
    (every combination of the plan that did not run, with its reason) and `results` (every
    row)."""
    payload = {
        "ok": run_ok(rows),
        "wall_s": round(wall_s, 3),
        "cpu_s": None if cpu_s is None else round(cpu_s, 3),
        **meta,
        "skipped": [s.to_json() for s in skipped],
        "results": [r.to_json() for r in rows],
    }
    # The CLI checked up front that the directory can be created: create it.
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, allow_nan=False) + "\n")


def write_update_log(
    path: Path,
    metrics: Iterable[tuple[Case, RankMetrics]],
    term_records: Iterable[dict[str, Any]] = (),
) -> int:
    """One JSON record per rank per update, then one per term of every objective case
    (``"record": "term"``: its loss, count and denominators); returns the number of records."""
    count = 0
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as log:
        for record in term_records:
            log.write(json.dumps(record, allow_nan=False) + "\n")
            count += 1
        for case, m in metrics:
            record = {
                "impl": case.impl,
                "fixture": case.fixture,
                "scheme": case.scheme,
                "strategy": case.strategy,
                "world_size": case.world_size,
                "accum_steps": case.accum_steps,
                "dtype": case.dtype,
                **m._asdict(),
            }
            log.write(json.dumps(record, allow_nan=False) + "\n")
            count += 1
    return count
