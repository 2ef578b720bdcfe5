"""`python -m crosscheck`: the command line.

`run` checks the built-in fixtures: it first shows the seed example's per-token weights (the
9x of a per-rank mean), then the oracle gradient of every scheme under every layout the
fixture allows against the single-device gradient. Exit status 0 only when every row is what
the contract expects (intended schemes identical, accidental ones finite and reported).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from crosscheck.catalogue import BUILTIN_FIXTURES, builtin_fixture
from crosscheck.invariance import CaseResult, layout_invariance
from crosscheck.oracle import loss_and_grad
from crosscheck.schemes import SCHEMES, get_scheme


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
    run = commands.add_parser("run", help="run the checks on the built-in fixtures")
    run.add_argument(
        "--fixture", type=_name_list, default=None, help="fixture names, comma-separated"
    )
    run.add_argument(
        "--schemes", type=_name_list, default=None, help="scheme names, comma-separated"
    )
    run.add_argument("--impls", type=_name_list, default=["oracle"], help="implementations")
    run.add_argument("--world-sizes", type=_int_list, default=[1, 2, 3, 4, 8])
    run.add_argument("--accum", type=_int_list, default=[1, 2, 3, 4])
    run.add_argument("--json", type=Path, default=None, help="write the results as JSON here")
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


def results_table(rows: list[CaseResult]) -> Table:
    table = Table(title="oracle gradient under each layout vs the single-device gradient")
    for column in ("fixture", "scheme", "layouts", "max rel err", "max weight ratio", "result"):
        table.add_column(column, justify="left" if column in ("fixture", "scheme") else "right")
    groups: dict[tuple[str, str], list[CaseResult]] = {}
    for row in rows:
        groups.setdefault((row.fixture, row.scheme), []).append(row)
    for (fixture, scheme), group in groups.items():
        err = max(r.max_rel_err for r in group)
        ok = all(r.ok for r in group)
        intended = get_scheme(scheme).intended
        verdict = (
            ("[green]identical[/]" if intended else "[yellow]differs (expected)[/]")
            if ok
            else "[red]FAIL[/]"
        )
        if not intended and ok and err == 0.0:
            verdict = "[green]identical here[/]"
        table.add_row(
            fixture,
            scheme,
            str(len(group)),
            f"{err:.2e}",
            f"{max(r.weight_ratio for r in group):.3g}",
            verdict,
        )
    return table


def run(args: argparse.Namespace, console: Console) -> int:
    started = time.perf_counter()
    unknown = [impl for impl in args.impls if impl != "oracle"]
    if unknown:
        console.print(f"[red]unknown implementation(s) {unknown}; available: oracle[/]")
        return 2
    try:
        fixtures = [builtin_fixture(name) for name in args.fixture or BUILTIN_FIXTURES]
        schemes = [get_scheme(name).name for name in args.schemes or SCHEMES]
    except ValueError as error:
        console.print(f"[red]crosscheck run: {error}[/]")
        return 2
    if any(fixture.name == "seed" for fixture in fixtures):
        console.print(seed_weights_table())
    rows: list[CaseResult] = []
    for fixture in fixtures:
        layouts = [
            (R, M)
            for R, M in fixture.valid_layouts(max(args.world_sizes), max(args.accum))
            if R in args.world_sizes and M in args.accum
        ]
        for scheme in schemes:
            rows.extend(layout_invariance(fixture, scheme, layouts))
    console.print(results_table(rows))
    ok = all(row.ok for row in rows)
    failed = sum(not row.ok for row in rows)
    wall = time.perf_counter() - started
    console.print(
        f"{len(rows)} cases, {failed} failed, {wall:.1f} s wall: "
        + ("[green]OK[/]" if ok else "[red]FAILED[/]")
    )
    if args.json is not None:
        payload = {"ok": ok, "wall_s": wall, "results": [row.to_json() for row in rows]}
        args.json.write_text(json.dumps(payload, indent=1, allow_nan=False) + "\n")
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 120)
    # A 0/0 anywhere in the reference is a bug: raise rather than carry a silent NaN.
    np.seterr(divide="raise", invalid="raise")
    if args.command == "run":
        return run(args, console)
    raise AssertionError(args.command)
