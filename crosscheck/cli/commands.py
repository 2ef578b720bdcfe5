"""`python -m crosscheck`: the command line.

`run` is the main job: it shows the seed example's per-token weights (the 9x of a per-rank
mean), then runs every implementation on the built-in fixtures across layouts and strategies
and compares gradients and updates with the oracle and with each other. Exit status 0 only
when every row is what the contract expects: intended schemes match; accidental ones match the
accident they are (and their deviation from the token mean is shown).

Every command's exit status is one of `crosscheck.exit_codes`. Set-up errors (exit 2) are
found before any work starts, each as one line naming what and why: bad arguments, an output
path that cannot be written (``--json``, ``--log``, ``--plot``, the export directory), a
non-empty export directory without ``--force``, a ``--step`` that does not exist. Ctrl-C and
SIGTERM stop every process the command started and print one line (exit 130,
`crosscheck.launch.processes`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from crosscheck import exit_codes
from crosscheck.cli.launched_run import launched_run
from crosscheck.cli.outputs import (
    check_outputs,
    creatable,
    output_height,
    output_width,
    plot_problem,
    refuse,
)
from crosscheck.cli.parser import build_parser, run_list_values
from crosscheck.cli.placement import placed, torch_ranks
from crosscheck.cli.report import (
    print_results,
    print_skipped,
    run_exit_code,
    summary_lines,
    timings_table,
    write_json,
    write_update_log,
)
from crosscheck.contract.cases import Case
from crosscheck.contract.fixture import Fixture
from crosscheck.contract.oracle import loss_and_grad
from crosscheck.fixtures.builtin import builtin_fixture
from crosscheck.launch.cpu_time import cpu_seconds
from crosscheck.launch.processes import handle_signals
from crosscheck.run.implementations import not_installed
from crosscheck.run.matrix import run_matrix
from crosscheck.run.plan import Plan


def seed_weights_table() -> Table:
    """Per-token weight on each rank of `seed` under token_mean and rank_mean."""
    fixture = builtin_fixture("seed")
    table = Table(title="seed, 2 ranks: weight of one token in the update")
    for column in ("rank", "valid tokens", "token_mean", "rank_mean", "rank_mean / token_mean"):
        table.add_column(column, justify="right")
    token = loss_and_grad(fixture, "token_mean", 2, 1)
    rank = loss_and_grad(fixture, "rank_mean", 2, 1)
    for r in range(2):
        row_valid = fixture.valid[r]
        w_token = float(token.token_weights[r][row_valid][0])
        w_rank = float(rank.token_weights[r][row_valid][0])
        table.add_row(
            str(r),
            str(int(token.rank_valid_tokens[r])),
            f"1/{1 / w_token:.0f}",
            f"1/{1 / w_rank:.0f}",
            f"{w_rank / w_token:.3f}",
        )
    ratio = float(rank.token_weights[0].max() / rank.token_weights[1].max())
    table.caption = f"a token on rank 0 weighs {ratio:.1f}x a token on rank 1 under rank_mean"
    return table


def _plan(args: argparse.Namespace) -> Plan:
    """The plan of `crosscheck run`: the options given are its explicit lists."""
    given = run_list_values(args)
    plan = Plan(
        world_size_change=not args.no_world_size_change,
        resume=not args.no_resume,
        # None: on unless the run is narrowed to fixtures or schemes (Plan.__post_init__).
        objectives=False if args.no_objectives else None,
        context_parallel=False if args.no_context_parallel else None,
        spec_modes=False if args.no_spec_modes else None,
        explicit=frozenset(given),
        **given,
    )
    if "fixtures" in given:
        plan.resume_fixtures = plan.fixtures
    plan.validate()
    return plan


def run(args: argparse.Namespace, console: Console) -> int:
    # Under torchrun: this process is one rank of the launcher's job (docs/gpu.md).
    if (launched := launched_run(args, console, run)) is not None:
        return launched
    started = time.perf_counter()
    try:
        plan = _plan(args)
        # Refuses, before any process starts, a plan that runs nothing or names a value that
        # runs in no case; the build is repeated by run_matrix (a few ms).
        plan.build()
    except ValueError as error:
        return refuse(console, f"crosscheck run: {error}")
    # Before the matrix, not after it: a path that cannot be written would otherwise fail
    # only once the whole run is done.
    problem = check_outputs("run", {"--json": args.json, "--log": args.log, "--plot": args.plot})
    problem = problem or plot_problem("run", args.plot)
    if problem:
        return refuse(console, problem)
    try:  # where the torch ranks and JAX workers run (docs/gpu.md), before any process
        placement = placed(args.device, args.platform, torch_ranks(plan), plan.impls)
    except ValueError as error:
        return refuse(console, f"crosscheck run: {error}")
    with placement:
        return _run_matrix(args, console, plan, started)


def _run_matrix(args: argparse.Namespace, console: Console, plan: Plan, started: float) -> int:
    if "seed" in plan.fixtures:
        console.print(seed_weights_table())
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        task = progress.add_task("running cases", total=None)

        def on_progress(done: int, total: int, case: Case | None) -> None:
            label = case.describe() if case else "starting processes"
            progress.update(task, completed=done, total=total, description=label)

        result = run_matrix(plan, on_progress)
    print_results(console, result.rows, args.rows)
    tables = args.rows != "family"
    if result.skipped and tables:
        print_skipped(console, result.skipped)
    if args.timings:
        console.print(timings_table(result.timings))
    wall = time.perf_counter() - started
    cpu = cpu_seconds()
    if args.json is not None:
        write_json(
            args.json,
            result.rows,
            wall,
            {"plan": _plan_record(plan)},
            skipped=result.skipped,
            cpu_s=cpu,
        )
    if args.log is not None:
        count = write_update_log(args.log, result.metrics(), result.term_logs)
        console.print(f"wrote {count} per-update records to {args.log}", soft_wrap=True)
    if args.plot is not None:
        fixture = builtin_fixture(plan.fixtures[0])
        R, M = _plot_layout(fixture)
        # Imported here: matplotlib costs the start of every other command a second.
        from crosscheck.cli.plot import plot_effective_weights

        args.plot.parent.mkdir(parents=True, exist_ok=True)  # checked creatable up front
        plot_effective_weights(fixture, args.plot, R, M)
        console.print(f"wrote {args.plot} ({fixture.name}, R={R}, M={M})", soft_wrap=True)
    # The verdict is the last line, after what was written.
    for line in summary_lines(result.rows, wall, result.skipped, cpu, reasons=tables):
        console.print(line, soft_wrap=True)
    return run_exit_code(result.rows)


def _plan_record(plan: Plan) -> dict:
    return {
        "fixtures": plan.fixtures,
        "schemes": plan.schemes,
        "impls": plan.impls,
        "world_sizes": plan.world_sizes,
        "accum_steps": plan.accum_steps,
        "strategies": plan.strategies,
        "dtypes": plan.dtypes,
        "world_size_change": plan.world_size_change,
        "resume": plan.resume,
        "objectives": plan.objectives,
        "context_parallel": plan.context_parallel,
        "spec_modes": plan.spec_modes,
        # The lists named on the command line: their values must each run in some case.
        "explicit": sorted(plan.explicit),
    }


def _plot_layout(fixture: Fixture) -> tuple[int, int]:
    """The layout that shows both accidents: 2 ranks x 2 microbatches where it fits."""
    for layout in ((2, 2), (2, 1), (1, 2)):
        if layout in fixture.valid_layouts():
            return layout
    return (1, 1)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its exit status (`crosscheck.exit_codes`).

    SIGTERM is handled like Ctrl-C while the command runs (`crosscheck.launch.processes`): either
    one stops every process it started, prints one line on stderr and returns INTERRUPTED (130).
    The previous signal handlers and numpy error state are restored on return.
    """
    args = build_parser().parse_args(argv)
    console = Console(width=output_width(os.environ, sys.stdout.isatty()), height=output_height())
    # A 0/0 anywhere in the reference is a bug: raise rather than carry a silent NaN. Scoped
    # to the command, so that calling main() from Python leaves the caller's state alone.
    with handle_signals(), np.errstate(divide="raise", invalid="raise"):
        return _dispatch(args, console)
    # Only reached when handle_signals caught an interrupt (it has said so on stderr).
    return exit_codes.INTERRUPTED


def _dispatch(args: argparse.Namespace, console: Console) -> int:
    if args.command == "run":
        return run(args, console)
    if args.command == "bugs":
        return bugs(args, console)
    if args.command == "export-vectors":
        return export(args, console)
    if args.command == "verify":
        return verify(args, console)
    if args.command == "bench":
        return bench(args, console)
    if args.command == "conformance":
        from crosscheck.cli.conformance_report import conformance_command

        return conformance_command(args, console)
    raise AssertionError(args.command)


def bench(args: argparse.Namespace, console: Console) -> int:
    """`bench`: --json and the devices are checked before any process starts."""
    from crosscheck.bench.command import BenchSetupError, bench_command

    problem = check_outputs("bench", {"--json": args.json})
    if problem:
        return refuse(console, problem)
    try:
        return bench_command(args, console)
    except BenchSetupError as error:
        return refuse(console, f"crosscheck bench: {error}")


def export(args: argparse.Namespace, console: Console) -> int:
    """`export-vectors DIR [--force]`: refused (exit 2) into a file, an unwritable place, or a
    non-empty directory without --force, before anything is written."""
    from crosscheck.fixtures.vectors import (
        ExportDirectoryError,
        check_export_directory,
        export_vectors,
    )

    directory = Path(args.directory)
    problem = creatable(directory)
    if problem:
        return refuse(
            console, f"crosscheck export-vectors: {directory} cannot be written: {problem}"
        )
    try:
        check_export_directory(directory, args.force)
    except ExportDirectoryError as error:
        return refuse(console, f"crosscheck export-vectors: {error}")
    written = export_vectors(directory, force=args.force)
    console.print(
        f"wrote {len(written.files)} files, {written.num_bytes} bytes; "
        f"manifest {written.manifest_path}",
        soft_wrap=True,  # a path stays whole, to copy: the terminal wraps it
    )
    return exit_codes.OK


def verify(args: argparse.Namespace, console: Console) -> int:
    """`verify`: the JSON path is checked before the step is, and both before any process."""
    from crosscheck.cli.verify_report import verify_command

    problem = check_outputs("verify", {"--json": args.json, "--plot": args.plot})
    problem = problem or plot_problem("verify", args.plot)
    if not problem and args.objective is not None and args.plot is not None:
        problem = (
            "crosscheck verify: --plot draws one scheme's weights per group of tokens; with "
            "--objective, the per-term weights are in the report and in --json"
        )
    if problem:
        return refuse(console, problem)
    # Under torchrun or in a multi-host JAX job: this process is one rank of it (docs/gpu.md).
    from crosscheck.cli.launched_verify import launched_verify

    launched = launched_verify(args, console)
    if launched is not None:
        return launched
    return verify_command(args, console)


def bugs(args: argparse.Namespace, console: Console) -> int:
    from crosscheck.bugs.catalogue_run import run_catalogue
    from crosscheck.cli.bug_report import catalogue_exit_code, print_catalogue, write_catalogue_json

    started = time.perf_counter()
    unknown = [fw for fw in args.frameworks if fw not in ("torch", "jax")]
    if unknown:
        return refuse(
            console, f"crosscheck bugs: unknown framework {unknown[0]!r}; known: torch, jax"
        )
    missing = {fw: not_installed(fw) for fw in args.frameworks}
    if any(missing.values()):
        first = next(why for why in missing.values() if why)
        others = [fw for fw, why in missing.items() if not why]
        instead = f", or pass --frameworks {','.join(others)}" if others else ""
        return refuse(console, f"crosscheck bugs: {first}{instead}")
    problem = check_outputs("bugs", {"--json": args.json})
    if problem:
        return refuse(console, problem)
    try:
        with console.status("running the buggy steps in torch and JAX processes"):
            result = run_catalogue(tuple(args.frameworks), args.patterns, fixtures=args.fixtures)
    except ValueError as error:
        return refuse(console, f"crosscheck bugs: {error}")
    print_catalogue(console, result)
    wall = time.perf_counter() - started
    console.print(f"wall time {wall:.1f} s")
    if args.json is not None:
        write_catalogue_json(args.json, result, wall)
    return catalogue_exit_code(result)
