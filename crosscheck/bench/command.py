"""`crosscheck bench`: the command's glue, from parsed options to the report and exit status.

Exit status (`crosscheck.exit_codes`): 0 when every path of every setup was judged right and
timed; 1 when a path was refused (its gradient is not the one it should be); 3 when a
framework's processes failed and nothing was refused; 2 for a set-up error found before any
launch (an unwritable --json, --device cuda without enough GPUs). Speed never decides it:
the ratios depend on the machine, and the report shows them against the 2% budget (under
--quick without that verdict: its few unwarmed rounds cannot judge speed).
"""

from __future__ import annotations

import argparse

from rich.console import Console

from crosscheck import exit_codes
from crosscheck.bench.config import BenchConfig
from crosscheck.bench.report import machine, print_report, result_rows, write_report
from crosscheck.bench.runner import BenchSetupError as BenchSetupError
from crosscheck.bench.runner import run_bench


def config_from(args: argparse.Namespace) -> BenchConfig:
    """The BenchConfig of the options (`crosscheck.cli.parser`'s ``bench`` subcommand)."""
    if args.ranks < 1:
        raise BenchSetupError(f"--ranks must be at least 1, got {args.ranks}")
    try:
        config = BenchConfig(device=args.device, platform=args.platform, torch_ranks=args.ranks)
    except ValueError as error:
        raise BenchSetupError(str(error)) from None
    return config.quickly() if args.quick else config


def bench_command(args: argparse.Namespace, console: Console) -> int:
    """Run the bench as the options say; print the table; write --json; the exit status.

    Raises BenchSetupError, before any process starts, for options this machine cannot run.
    """
    config = config_from(args)
    with console.status("timing naive, precount and fused in torch, then JAX"):
        run = run_bench(config)
    rows = result_rows(run)
    info = machine()
    print_report(console, run, rows, info)
    if args.json is not None:
        write_report(args.json, run, rows, info)
        console.print(f"wrote {args.json}", soft_wrap=True)
    if any(row["refused"] for row in rows):
        return exit_codes.MISMATCH
    if run.torch.error or run.jax.error:
        return exit_codes.STEP_FAILED
    return exit_codes.OK
