"""The command line's grammar: every command of `python -m crosscheck` and its options.

`build_parser` is all of it; `crosscheck.cli.commands` runs what it parses. The options of
`crosscheck run` that name lists (`RUN_LISTS`) set the `crosscheck.run.plan.Plan` list of
the same meaning and take no default here: a list the user names is explicit (every value of
it must run in some case, or the run is refused); a list left out takes the Plan's default,
whose product with the others may skip combinations (listed, with their reasons).

One vocabulary across the commands (`OPTION_NAMES`): a list is named in the plural
(``--fixtures``, ``--frameworks``, ``--world-sizes``, ``--accum-steps``), the same name means the
same thing wherever it appears, and every option's help says its default. An older spelling
(`RENAMED`) still works and says once, on stderr, what it is called now.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from crosscheck.cli.outputs import output_file, print_error
from crosscheck.contract.cases import STRATEGIES
from crosscheck.contract.layout import CONTEXT_ORDERS
from crosscheck.fixtures.builtin import fixture_reference
from crosscheck.launch.devices import JAX_PLATFORMS, TORCH_DEVICES
from crosscheck.run.implementations import IMPLEMENTATIONS
from crosscheck.verification.objective_verify import OBJECTIVE_FIXTURES
from crosscheck.verification.verifier import (
    DEFAULT_CONTEXT_LAYOUTS,
    DEFAULT_FIXTURES,
    DEFAULT_LAYOUTS,
    SPEC_FIXTURES,
)


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


def _context_orders(text: str) -> list[str]:
    orders = _name_list(text)
    wrong = [order for order in orders if order not in CONTEXT_ORDERS]
    if wrong or not orders:
        raise argparse.ArgumentTypeError(
            f"context orders are {' and '.join(CONTEXT_ORDERS)}, comma-separated; got {text!r}"
        )
    return orders


def _context_layouts() -> list[str]:
    """verify's default context-parallel layouts as --help writes them."""
    return [f"{R}x{M}x{C} {order}" for R, M, C, order in DEFAULT_CONTEXT_LAYOUTS]


_WORLD_SIZES = (
    "world sizes R (ranks), comma-separated, e.g. 1,2,4; each runs with every accumulation "
    "step of --accum-steps whose R x M divides a fixture's rows"
)
_ACCUM_STEPS = "accumulation steps M (microbatches per rank and update), comma-separated"

#: `crosscheck run`'s list options, in the order --help shows them: the option -> the Plan
#: list it sets, how its value is read, and its help.
RUN_LISTS: dict[str, tuple[str, Callable[[str], list], str | None]] = {
    "--fixtures": (
        "fixtures",
        _fixture_list,
        "built-in fixture names or fixture .npz paths, comma-separated (default: every "
        "built-in fixture)",
    ),
    "--schemes": (
        "schemes",
        _name_list,
        "scheme names, comma-separated (default: contract v1's eight)",
    ),
    "--impls": ("impls", _name_list, f"oracle, {', '.join(IMPLEMENTATIONS)} (default: all)"),
    "--world-sizes": ("world_sizes", _int_list, f"{_WORLD_SIZES} (default: 1,2,4)"),
    "--accum-steps": ("accum_steps", _int_list, f"{_ACCUM_STEPS} (default: 1,2)"),
    "--strategies": ("strategies", _name_list, f"default: {','.join(STRATEGIES)}"),
    "--dtypes": ("dtypes", _name_list, "float64, float32, bfloat16 (default: float64)"),
}

#: Older spellings, still read: command -> {old option: the option it is now}.
RENAMED: dict[str, dict[str, str]] = {
    "run": {"--fixture": "--fixtures", "--accum": "--accum-steps"},
    "verify": {"--accum": "--accum-steps"},
    "bugs": {"--fixture": "--fixtures"},
    "conformance": {"--framework": "--frameworks", "--setting": "--settings"},
}


class _Renamed(argparse.Action):
    """An older spelling of an option: parsed as the new one, with one line on stderr."""

    def __init__(self, option_strings, dest, *, new: str, read: Callable, **kwargs) -> None:
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kwargs)
        self.new, self.read = new, read

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print_error(f"crosscheck: {option_string} is now {self.new} (the old spelling still works)")
        try:
            setattr(namespace, self.dest, self.read(values))
        except argparse.ArgumentTypeError as error:
            parser.error(f"argument {self.new}: {error}")


def _add_renamed(command: argparse.ArgumentParser, name: str) -> None:
    """`RENAMED`'s old spellings of `name`'s options, after the new ones exist."""
    by_option = {option: action for action in command._actions for option in action.option_strings}
    for old, new in RENAMED[name].items():
        action = by_option[new]
        read = action.type or (lambda text: text)
        command.add_argument(old, action=_Renamed, dest=action.dest, new=new, read=read)


def run_list_values(args: argparse.Namespace) -> dict[str, list]:
    """The Plan lists `crosscheck run` was given, by the Plan's names (options left out are
    not there)."""
    given = {
        plan: getattr(args, option[2:].replace("-", "_"))
        for option, (plan, *_) in RUN_LISTS.items()
    }
    return {plan: value for plan, value in given.items() if value is not None}


def _add_placement(command: argparse.ArgumentParser) -> None:
    """--device (torch ranks) and --platform (JAX workers): docs/gpu.md."""
    command.add_argument(
        "--device",
        choices=TORCH_DEVICES,
        default="auto",
        help="torch ranks: cuda (one GPU per rank, NCCL), cpu (gloo) or auto: cuda when torch "
        "sees at least as many GPUs as the largest world size, else cpu (default: auto)",
    )
    command.add_argument(
        "--platform",
        choices=JAX_PLATFORMS,
        help="JAX's platform (JAX_PLATFORMS). Default: cpu, with eight fake devices, for the "
        "workers crosscheck starts; in a multi-host job, the backend JAX finds",
    )


def _add_run(commands: argparse._SubParsersAction) -> None:
    run = commands.add_parser(
        "run",
        help="run every implementation on the built-in fixtures and compare with the oracle",
    )
    for option, (_, read, text) in RUN_LISTS.items():
        run.add_argument(option, type=read, help=text)
    run.add_argument(
        "--no-world-size-change",
        action="store_true",
        help="skip the (1,4), (2,2), (4,1) world-size-change rows",
    )
    run.add_argument("--no-resume", action="store_true", help="skip the checkpoint-resume rows")
    run.add_argument(
        "--no-spec-modes",
        action="store_true",
        help="skip the trainer modes on v2's fixtures (off anyway with --fixture or --schemes)",
    )
    run.add_argument(
        "--no-objectives",
        action="store_true",
        help="skip the multi-term objective rows (off anyway with --fixture or --schemes)",
    )
    run.add_argument(
        "--no-context-parallel",
        action="store_true",
        help="skip the context-parallel rows (off anyway with --fixture or --schemes)",
    )
    run.add_argument(
        "--rows",
        choices=("family", "group", "case"),
        default="family",
        help="one line per family of rows (a check), a table per check with a row per group of "
        "like cases, or with a row per case (default: family; --json holds every row)",
    )
    run.add_argument("--json", type=output_file, help="write every row as JSON here")
    run.add_argument(
        "--log", type=output_file, help="write per-rank per-update metrics as JSONL here"
    )
    run.add_argument(
        "--plot", type=output_file, help="write a PNG of effective per-token weights here"
    )
    run.add_argument(
        "--timings", action="store_true", help="also print when each job (process group) ran"
    )
    _add_placement(run)
    _add_multihost(run)
    _add_renamed(run, "run")


def _add_bugs(commands: argparse._SubParsersAction) -> None:
    bugs = commands.add_parser(
        "bugs",
        help="run every known bug pattern in torch and JAX; check each is detected and named",
    )
    bugs.add_argument(
        "--frameworks",
        type=_name_list,
        default=["torch", "jax"],
        help="torch, jax, comma-separated (default: both)",
    )
    bugs.add_argument("--patterns", type=_name_list, help="pattern ids (default: all)")
    bugs.add_argument(
        "--fixtures",
        type=_fixture_list,
        help="run every pattern on these fixtures instead (built-in names or .npz paths; "
        "default: each pattern's own fixtures and layouts)",
    )
    bugs.add_argument("--json", type=output_file, help="write the results as JSON here")
    _add_renamed(bugs, "bugs")


def _add_export(commands: argparse._SubParsersAction) -> None:
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


def _add_verify(commands: argparse._SubParsersAction) -> None:
    verify = commands.add_parser(
        "verify",
        help="check your own training step (MODULE:FUNCTION) against the oracle and diagnose it",
    )
    verify.add_argument(
        "--framework", choices=("torch", "jax"), required=True, help="the step's framework"
    )
    verify.add_argument("--step", required=True, help="MODULE:FUNCTION, importable from here")
    intended = verify.add_mutually_exclusive_group(required=True)
    intended.add_argument(
        "--scheme",
        help="the scheme the step is meant to compute: a name (constant:C for a fixed "
        "normalizer C; a trainer mode of docs/schemes-as-data.md) or MODULE:OBJECT naming a "
        "SchemeSpec or its dict (no default: this or --objective)",
    )
    intended.add_argument(
        "--objective",
        help="instead of --scheme, the multi-term objective the step is meant to compute: a "
        "name of docs/objectives.md (aux, aux-local) or MODULE:OBJECT naming a list of terms; "
        "judged per term (docs/verify.md#multi-term-objectives; no default: this or --scheme)",
    )
    verify.add_argument(
        "--fixtures",
        type=_fixture_list,
        help="built-in names or fixture .npz paths, comma-separated (default: "
        f"{','.join(DEFAULT_FIXTURES)}; for a scheme beyond contract v1's: "
        f"{','.join(SPEC_FIXTURES)}; for an objective: {','.join(OBJECTIVE_FIXTURES)})",
    )
    layouts = ", ".join(f"{R}x{M}" for R, M in DEFAULT_LAYOUTS)
    verify.add_argument(
        "--world-sizes",
        type=_int_list,
        help="world sizes R (ranks), comma-separated, e.g. 1,2; every R runs with every M "
        "of --accum-steps, each R x M dividing every fixture's rows, and the one of the two "
        f"left out is 1,2 (default: the layouts R x M {layouts}, docs/verify.md)",
    )
    verify.add_argument(
        "--accum-steps",
        type=_int_list,
        help=f"{_ACCUM_STEPS}; see --world-sizes (default: as --world-sizes)",
    )
    verify.add_argument(
        "--context-sizes",
        type=_int_list,
        help="context-parallel ranks C, comma-separated, for a step that declares `context` "
        "(docs/verify.md#context-parallel): every row's positions split over C; combined "
        "with --world-sizes, --accum-steps and --context-orders (default for such a step: "
        "the layouts R, M, C " + ", ".join(_context_layouts()) + "; else 1)",
    )
    verify.add_argument(
        "--context-orders",
        type=_context_orders,
        help="how a row's positions are dealt to the context ranks: zigzag (Megatron-LM's and "
        "torchtitan's load balance), contiguous, or both comma-separated (default: zigzag)",
    )
    verify.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds the step gets for the whole run in each framework, all its cases "
        "(default: 120)",
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
        help="dtype of the model / params handed to the step (default: float64)",
    )
    verify.add_argument(
        "--model",
        help="MODULE:FACTORY of your own model (torch: a fresh nn.Module, the same weights each "
        "call; JAX: (apply_fn, params)): the step gets it, the reference is its own gradient "
        "(default: the fixtures' bilinear model)",
    )
    verify.add_argument(
        "--forward",
        help="MODULE:FN giving the reference the logits of --model on a batch (torch: "
        "fn(model, microbatch); JAX: fn(apply_fn, params, microbatch)); default: model(inputs)",
    )
    verify.add_argument("--json", type=output_file, help="write the report as JSON here")
    verify.add_argument(
        "--plot",
        type=output_file,
        help="write a PNG here: the case the headline names, each group's per-token weight "
        "against the intended one, by rank and microbatch (needs matplotlib)",
    )
    _add_placement(verify)
    _add_multihost(verify)
    _add_renamed(verify, "verify")


def _add_multihost(command: argparse.ArgumentParser) -> None:
    """A multi-host JAX start (crosscheck.launch.external; JAX_COORDINATOR_ADDRESS & co. too)."""
    command.add_argument(
        "--coordinator",
        help="multi-host JAX: the coordinator's HOST:PORT (default: JAX_COORDINATOR_ADDRESS, "
        "else a single host)",
    )
    command.add_argument(
        "--num-processes",
        type=int,
        help="multi-host JAX: how many processes (default: JAX_NUM_PROCESSES)",
    )
    command.add_argument(
        "--process-id",
        type=int,
        help="multi-host JAX: this process's id (default: JAX_PROCESS_ID)",
    )


def _add_bench(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser(
        "bench",
        help="time naive, precount and fused loss weighting on a small transformer (torch, JAX)",
    )
    bench.add_argument("--json", type=output_file, help="write the results as JSON here")
    bench.add_argument(
        "--quick", action="store_true", help="a few rounds of a small batch (checks it runs)"
    )
    bench.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: one torch rank per GPU over NCCL, JAX on every device it finds (default: cpu)",
    )
    bench.add_argument("--ranks", type=int, default=2, help="torch ranks (default: 2)")
    bench.add_argument("--platform", help="JAX's jax_platforms (default: cpu with --device cpu)")


def _add_conformance(commands: argparse._SubParsersAction) -> None:
    conformance = commands.add_parser(
        "conformance",
        help="run real frameworks' trainers (transformers, TRL, optax, ...) for one update "
        "each and hold their weighting to the versioned expectations",
    )
    conformance.add_argument(
        "--frameworks",
        type=_name_list,
        help="only these frameworks (distribution names, comma-separated; default: every "
        "installed one)",
    )
    conformance.add_argument(
        "--settings", type=_name_list, help="only these settings (comma-separated; default: all)"
    )
    conformance.add_argument("--json", type=output_file, help="write every row as JSON here")
    conformance.add_argument(
        "--markdown", type=output_file, help="write the table as docs/conformance.md publishes it"
    )
    _add_renamed(conformance, "conformance")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="crosscheck",
        description="Check that loss normalization weights tokens the way it should.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for add in (_add_run, _add_bugs, _add_export, _add_verify, _add_bench, _add_conformance):
        add(commands)
    return parser
