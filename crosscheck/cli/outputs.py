"""Set-up errors of the command line (output paths that cannot be written, the refusal), and
the width the results are drawn at (`output_width`).

Every command checks the files it will write (``--json``, ``--log``, ``--plot``,
``--markdown``, the export directory) before any work starts, without creating or changing
anything (`check_outputs`), and refuses a set-up error with one line on stderr and exit
status 2 (`refuse`): errors go to stderr, results to stdout, in every command.

An output file's option is read by `output_file`, which keeps what `pathlib` drops: a path
written with a trailing separator (``--json out/``) names a directory, and is refused rather
than written as a file named ``out``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from crosscheck import exit_codes

#: The separators a path may end with here ('/' everywhere, '\\' too on Windows).
SEPARATORS = tuple(dict.fromkeys(sep for sep in ("/", os.sep, os.altsep) if sep))


class OutputFile(type(Path())):  # type: ignore[misc]  # PosixPath or WindowsPath
    """The Path of an output file's option, with the text it was written as (`as_written`).

    `Path("out/")` is `Path("out")`: without the text, ``--json out/`` would silently write
    a file named ``out``. Paths derived from it (``.parent``, ``/``) keep the class, not the
    text: their `as_written` is empty.
    """

    as_written = ""

    @property
    def names_directory(self) -> bool:
        """Written with a trailing separator: the user named a directory, not a file."""
        return self.as_written.endswith(SEPARATORS)


def output_file(text: str) -> Path:
    """The argparse type of an output file's option (``--json``, ``--log``, ...)."""
    path = OutputFile(text)
    path.as_written = text
    return path


def output_problem(path: Path) -> str:
    """Why the file `path` cannot be written, or '' (nothing is created or changed).

    The file must be writable where it exists; its directory must exist or be creatable.
    Creating a file in the nearest directory that exists (a temporary one, removed at once)
    is the test: permission bits alone say nothing for root, nor for a read-only mount.
    """
    if getattr(path, "names_directory", False):
        return (
            "it ends with a path separator, so it names a directory; name the file to write "
            f"(for example {path / 'report.json'})"
        )
    if path.is_dir():
        return "it is a directory"
    if path.exists():
        try:
            with path.open("ab"):  # append: opens for writing without changing a byte
                pass
        except OSError as error:
            return f"it cannot be opened for writing ({error.strerror or error})"
        return ""
    return creatable(path.parent)


def creatable(directory: Path) -> str:
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
        problem = output_problem(path if isinstance(path, Path) else Path(path))
        if problem:
            written = getattr(path, "as_written", "") or path
            return f"crosscheck {command}: {option} {written} cannot be written: {problem}"
    return ""


def refuse(console: Console, line: str) -> int:
    """Print a set-up error on stderr and return its code (`crosscheck.exit_codes`).

    `console` is the command's output (stdout): a quiet one (a launched job's rank other than
    0, whose lines rank 0 prints) prints nothing here either.
    """
    if not console.quiet:
        print_error(line)
    return exit_codes.SETUP_ERROR


def print_error(line: str) -> None:
    """One line on stderr, whatever the terminal's width (red where stderr is a terminal)."""
    # A console per line: it writes to the sys.stderr of the moment (pytest's capture too).
    errors = Console(
        stderr=True,
        soft_wrap=True,
        highlight=False,
        width=output_width(os.environ, sys.stderr.isatty()),
        height=output_height(),
    )
    errors.print(f"[red]{escape(line)}[/]")


#: The width of output going to a pipe or a file, when COLUMNS does not say.
UNKNOWN_WIDTH = 80


def output_width(environ: Mapping[str, str], isatty: bool) -> int:
    """The width to draw stdout at: ``COLUMNS`` where it holds a positive number (a pipe's
    reader, a CI log), else the terminal's own on a terminal (stdout's: never a terminal the
    output does not go to), else 80. Always a number: rich, given none, would read a
    ``COLUMNS`` of 0 as a width of 0 and print nothing."""
    try:
        columns = int(environ.get("COLUMNS", "").strip())
    except ValueError:  # unset, empty, or not a number ("80x", "²")
        columns = 0
    if columns > 0:
        return columns
    if isatty:
        return shutil.get_terminal_size((UNKNOWN_WIDTH, 24)).columns
    return UNKNOWN_WIDTH


def output_height() -> int:
    """The terminal's height (``LINES``, the terminal, else 25): given with the width, it keeps
    rich from reading ``COLUMNS`` itself (it takes any digit, "²" too, for a number)."""
    return shutil.get_terminal_size((UNKNOWN_WIDTH, 25)).lines


def plot_problem(command: str, plot: Path | None) -> str:
    """Why `command`'s ``--plot`` cannot be drawn here ("" when it can, or was not asked for):
    matplotlib is an optional extra."""
    if plot is None or importlib.util.find_spec("matplotlib") is not None:
        return ""
    return (
        f"crosscheck {command}: --plot needs matplotlib, which is not installed here: "
        "pip install 'gradweight[plot]'"
    )
