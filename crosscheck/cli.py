"""`python -m crosscheck`: the command line.

`run` is the main job: it shows the seed example's per-token weights (the 9x of a per-rank
mean), then runs every implementation on the built-in fixtures across layouts and strategies
and compares gradients and updates with the oracle and with each other. Exit status 0 only
when every row is what the contract expects: intended schemes match; accidental ones match the
accident they are (and their deviation from the token mean is shown).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from crosscheck.cases import STRATEGIES, Case
from crosscheck.catalogue import builtin_fixture
from crosscheck.fixtures import Fixture
from crosscheck.matrix import run_matrix
from crosscheck.oracle import loss_and_grad
from crosscheck.plan import Plan
from crosscheck.plot import plot_effective_weights
from crosscheck.report import (
    print_results,
    run_ok,
    skipped_table,
    summary_line,
    timings_table,
    write_json,
    write_update_log,
)
from crosscheck.runners import IMPLEMENTATIONS


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
    run.add_argument("--fixture", type=_name_list, help="fixture names, comma-separated")
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
    bugs.add_argument("--json", type=Path, help="write the results as JSON here")
    export = commands.add_parser(
        "export-vectors",
        help="write portable .npz test vectors and a manifest for every fixture and scheme",
    )
    export.add_argument("directory", type=Path, help="output directory (created if missing)")
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
    verify.add_argument("--fixtures", type=_name_list, help="default: packed,ragged")
    verify.add_argument("--world-sizes", type=_int_list, help="default layouts: see README")
    verify.add_argument("--accum", type=_int_list)
    verify.add_argument(
        "--timeout", type=float, default=120.0, help="seconds before a step counts as hung"
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
        # One line, whatever the terminal's width: soft_wrap leaves the wrapping to it.
        console.print(f"[red]crosscheck run: {escape(str(error))}[/]", soft_wrap=True)
        return 2
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
        console.print(skipped_table(result.skipped))
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
        plot_effective_weights(fixture, args.plot, R, M)
        console.print(f"wrote {args.plot} ({fixture.name}, R={R}, M={M})")
    return 0 if run_ok(result.rows) else 1


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
    args = build_parser().parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 140)
    # A 0/0 anywhere in the reference is a bug: raise rather than carry a silent NaN. Scoped
    # to the command, so that calling main() from Python leaves the caller's state alone.
    with np.errstate(divide="raise", invalid="raise"):
        return _dispatch(args, console)


def _dispatch(args: argparse.Namespace, console: Console) -> int:
    if args.command == "run":
        return run(args, console)
    if args.command == "bugs":
        return bugs(args, console)
    if args.command == "export-vectors":
        from crosscheck.vectors import export_vectors

        written = export_vectors(args.directory)
        console.print(
            f"wrote {len(written.files)} files, {written.num_bytes} bytes; "
            f"manifest {written.manifest_path}"
        )
        return 0
    if args.command == "verify":
        from crosscheck.verify_report import verify_command

        return verify_command(args, console)
    raise AssertionError(args.command)


def bugs(args: argparse.Namespace, console: Console) -> int:
    from crosscheck.bug_report import print_catalogue, write_catalogue_json
    from crosscheck.bugs import run_catalogue

    started = time.perf_counter()
    unknown = [fw for fw in args.frameworks if fw not in ("torch", "jax")]
    if unknown:
        console.print(
            f"[red]crosscheck bugs: unknown framework {unknown[0]!r}; known: torch, jax[/]"
        )
        return 2
    try:
        with console.status("running the buggy steps in torch and JAX processes"):
            result = run_catalogue(tuple(args.frameworks), args.patterns)
    except ValueError as error:
        console.print(f"[red]crosscheck bugs: {error}[/]")
        return 2
    print_catalogue(console, result)
    wall = time.perf_counter() - started
    console.print(f"wall time {wall:.1f} s")
    if args.json is not None:
        write_catalogue_json(args.json, result, wall)
    return 0 if result.ok else 1
