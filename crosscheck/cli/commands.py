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
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from crosscheck import exit_codes
from crosscheck.cli.report import (
    print_results,
    print_skipped,
    run_exit_code,
    summary_line,
    timings_table,
    write_json,
    write_update_log,
)
from crosscheck.contract.cases import STRATEGIES, Case
from crosscheck.contract.fixture import Fixture
from crosscheck.contract.oracle import loss_and_grad
from crosscheck.fixtures.builtin import builtin_fixture, fixture_reference
from crosscheck.launch.processes import handle_signals
from crosscheck.run.implementations import IMPLEMENTATIONS
from crosscheck.run.matrix import run_matrix
from crosscheck.run.plan import Plan


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _fixture_list(text: str) -> list[str]:
    """Fixture references: built-in names, or .npz paths made absolute (workers may start in
    another directory)."""
    return [fixture_reference(part) for part in _name_list(text)]


def _name_list(text: str) -> list[str]:
    return [part for part in text.split(",") if part]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="crosscheck",
        description="Check that loss normalization weights tokens the way it should.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser(
        "run",
        help="run every implementation on the built-in fixtures and compare with the oracle",
    )
    # No defaults here: a list the user names is explicit (every value of it must run in
    # some case, or the run is refused); a list left out takes the Plan's default, whose
    # product with the others may skip combinations (listed, with their reasons).
    run.add_argument(
        "--fixture",
        type=_fixture_list,
        help="built-in fixture names or fixture .npz paths, comma-separated",
    )
    run.add_argument("--schemes", type=_name_list, help="scheme names, comma-separated")
    run.add_argument(
        "--impls", type=_name_list, help=f"oracle, {', '.join(IMPLEMENTATIONS)} (default: all)"
    )
    run.add_argument("--world-sizes", type=_int_list, help="default: 1,2,4")
    run.add_argument("--accum", type=_int_list, help="accumulation steps; default: 1,2")
    run.add_argument("--strategies", type=_name_list, help=f"default: {','.join(STRATEGIES)}")
    run.add_argument("--dtypes", type=_name_list, help="default: float64")
    run.add_argument(
        "--no-world-size-change",
        action="store_true",
        help="skip the (1,4), (2,2), (4,1) world-size-change rows",
    )
    run.add_argument("--no-resume", action="store_true", help="skip the checkpoint-resume rows")
    run.add_argument("--rows", choices=("group", "case"), default="group")
    run.add_argument("--json", type=Path, help="write every row as JSON here")
    run.add_argument("--log", type=Path, help="write per-rank per-update metrics as JSONL here")
    run.add_argument("--plot", type=Path, help="write a PNG of effective per-token weights here")
    run.add_argument(
        "--timings", action="store_true", help="also print when each job (process group) ran"
    )
    bugs = commands.add_parser(
        "bugs",
        help="run every known bug pattern in torch and JAX; check each is detected and named",
    )
    bugs.add_argument("--frameworks", type=_name_list, default=["torch", "jax"], help="torch, jax")
    bugs.add_argument("--patterns", type=_name_list, help="pattern ids (default: all)")
    bugs.add_argument(
        "--fixture",
        type=_fixture_list,
        help="run every pattern on these fixtures instead (built-in names or .npz paths)",
    )
    bugs.add_argument("--json", type=Path, help="write the results as JSON here")
    export = commands.add_parser(
        "export-vectors",
        help="write portable .npz test vectors and a manifest for every fixture and scheme",
    )
    export.add_argument("directory", type=Path, help="output directory (created if missing)")
    export.add_argument(
        "--force",
        action="store_true",
        help="write into a non-empty directory: replace the export's own files, leave the rest",
    )
    verify = commands.add_parser(
        "verify",
        help="check your own training step (MODULE:FUNCTION) against the oracle and diagnose it",
    )
    verify.add_argument("--framework", choices=("torch", "jax"), required=True)
    verify.add_argument("--step", required=True, help="MODULE:FUNCTION, importable from here")
    verify.add_argument(
        "--scheme",
        required=True,
        help="the scheme the step is meant to compute (constant:C for a fixed normalizer C)",
    )
    verify.add_argument(
        "--fixtures",
        type=_fixture_list,
        help="built-in names or fixture .npz paths, comma-separated (default: packed,ragged)",
    )
    verify.add_argument("--world-sizes", type=_int_list, help="default layouts: see README")
    verify.add_argument("--accum", type=_int_list)
    verify.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds the step gets for the whole run in each framework (all its cases)",
    )
    verify.add_argument(
        "--precision",
        choices=("auto", "float64", "float32", "bfloat16"),
        default="auto",
        help="judge at this precision (default: the finest the step's own noise allows)",
    )
    verify.add_argument(
        "--strict",
        action="store_true",
        help="the float64 judgement (relative error 1e-12), same as --precision float64",
    )
    verify.add_argument(
        "--dtype",
        choices=("float64", "float32", "bfloat16"),
        default="float64",
        help="dtype of the model / params handed to the step",
    )
    verify.add_argument("--json", type=Path, help="write the report as JSON here")
    return parser


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


#: `crosscheck run` option -> the Plan list it sets.
RUN_LISTS: dict[str, str] = {
    "fixture": "fixtures",
    "schemes": "schemes",
    "impls": "impls",
    "world_sizes": "world_sizes",
    "accum": "accum_steps",
    "strategies": "strategies",
    "dtypes": "dtypes",
}


def output_problem(path: Path) -> str:
    """Why the file `path` cannot be written, or '' (nothing is created or changed).

    The file must be writable where it exists; its directory must exist or be creatable.
    Creating a file in the nearest directory that exists (a temporary one, removed at once)
    is the test: permission bits alone say nothing for root, nor for a read-only mount.
    """
    if path.is_dir():
        return "it is a directory"
    if path.exists():
        try:
            with path.open("ab"):  # append: opens for writing without changing a byte
                pass
        except OSError as error:
            return f"it cannot be opened for writing ({error.strerror or error})"
        return ""
    return _creatable(path.parent)


def _creatable(directory: Path) -> str:
    """Why `directory` cannot be used or created, or '' (nothing is created)."""
    ancestor = directory
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{ancestor} is a file, not a directory"
    try:
        with tempfile.TemporaryFile(dir=ancestor):
            pass
    except OSError as error:
        reason = error.strerror or str(error)
        if ancestor == directory:
            return f"no file can be created in {directory} ({reason})"
        return f"{directory} does not exist and cannot be created in {ancestor} ({reason})"
    return ""


def check_outputs(command: str, outputs: dict[str, Path | None]) -> str:
    """The first option whose path cannot be written, as one line; '' when all can."""
    for option, path in outputs.items():
        if path is None:
            continue
        problem = output_problem(Path(path))
        if problem:
            return f"crosscheck {command}: {option} {path} cannot be written: {problem}"
    return ""


def _refuse(console: Console, line: str) -> int:
    """Print a set-up error (one line, whatever the terminal's width) and return its code."""
    console.print(f"[red]{escape(line)}[/]", soft_wrap=True)
    return exit_codes.SETUP_ERROR


def _plan(args: argparse.Namespace) -> Plan:
    """The plan of `crosscheck run`: the options given are its explicit lists."""
    given = {field: getattr(args, option) for option, field in RUN_LISTS.items()}
    given = {field: value for field, value in given.items() if value is not None}
    plan = Plan(
        world_size_change=not args.no_world_size_change,
        resume=not args.no_resume,
        explicit=frozenset(given),
        **given,
    )
    if "fixtures" in given:
        plan.resume_fixtures = plan.fixtures
    plan.validate()
    return plan


def run(args: argparse.Namespace, console: Console) -> int:
    started = time.perf_counter()
    try:
        plan = _plan(args)
        # Refuses, before any process starts, a plan that runs nothing or names a value that
        # runs in no case; the build is repeated by run_matrix (a few ms).
        plan.build()
    except ValueError as error:
        return _refuse(console, f"crosscheck run: {error}")
    # Before the matrix, not after it: a path that cannot be written would otherwise fail
    # only once the whole run is done.
    problem = check_outputs("run", {"--json": args.json, "--log": args.log, "--plot": args.plot})
    if problem:
        return _refuse(console, problem)
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
    print_results(console, result.rows, per_case=args.rows == "case")
    if result.skipped:
        print_skipped(console, result.skipped)
    if args.timings:
        console.print(timings_table(result.timings))
    wall = time.perf_counter() - started
    console.print(summary_line(result.rows, wall, result.skipped), soft_wrap=True)
    if args.json is not None:
        write_json(
            args.json, result.rows, wall, {"plan": _plan_record(plan)}, skipped=result.skipped
        )
    if args.log is not None:
        count = write_update_log(args.log, result.metrics())
        console.print(f"wrote {count} per-update records to {args.log}")
    if args.plot is not None:
        fixture = builtin_fixture(plan.fixtures[0])
        R, M = _plot_layout(fixture)
        # Imported here: matplotlib costs the start of every other command a second.
        from crosscheck.cli.plot import plot_effective_weights

        args.plot.parent.mkdir(parents=True, exist_ok=True)  # checked creatable up front
        plot_effective_weights(fixture, args.plot, R, M)
        console.print(f"wrote {args.plot} ({fixture.name}, R={R}, M={M})")
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
    console = Console(width=None if sys.stdout.isatty() else 140)
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
    raise AssertionError(args.command)


def export(args: argparse.Namespace, console: Console) -> int:
    """`export-vectors DIR [--force]`: refused (exit 2) into a file, an unwritable place, or a
    non-empty directory without --force, before anything is written."""
    from crosscheck.fixtures.vectors import (
        ExportDirectoryError,
        check_export_directory,
        export_vectors,
    )

    directory = Path(args.directory)
    problem = _creatable(directory)
    if problem:
        return _refuse(
            console, f"crosscheck export-vectors: {directory} cannot be written: {problem}"
        )
    try:
        check_export_directory(directory, args.force)
    except ExportDirectoryError as error:
        return _refuse(console, f"crosscheck export-vectors: {error}")
    written = export_vectors(directory, force=args.force)
    console.print(
        f"wrote {len(written.files)} files, {written.num_bytes} bytes; "
        f"manifest {written.manifest_path}"
    )
    return exit_codes.OK


def verify(args: argparse.Namespace, console: Console) -> int:
    """`verify`: the JSON path is checked before the step is, and both before any process."""
    from crosscheck.cli.verify_report import verify_command

    problem = check_outputs("verify", {"--json": args.json})
    if problem:
        return _refuse(console, problem)
    return verify_command(args, console)


def bugs(args: argparse.Namespace, console: Console) -> int:
    from crosscheck.bugs.catalogue_run import run_catalogue
    from crosscheck.cli.bug_report import catalogue_exit_code, print_catalogue, write_catalogue_json

    started = time.perf_counter()
    unknown = [fw for fw in args.frameworks if fw not in ("torch", "jax")]
    if unknown:
        return _refuse(
            console, f"crosscheck bugs: unknown framework {unknown[0]!r}; known: torch, jax"
        )
    problem = check_outputs("bugs", {"--json": args.json})
    if problem:
        return _refuse(console, problem)
    try:
        with console.status("running the buggy steps in torch and JAX processes"):
            result = run_catalogue(tuple(args.frameworks), args.patterns, fixtures=args.fixture)
    except ValueError as error:
        return _refuse(console, f"crosscheck bugs: {error}")
    print_catalogue(console, result)
    wall = time.perf_counter() - started
    console.print(f"wall time {wall:.1f} s")
    if args.json is not None:
        write_catalogue_json(args.json, result, wall)
    return catalogue_exit_code(result)
