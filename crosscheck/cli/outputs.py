"""Set-up errors of the command line: output paths that cannot be written, and the refusal.

Every command checks the files it will write (``--json``, ``--log``, ``--plot``, the export
directory) before any work starts, without creating or changing anything (`check_outputs`),
and refuses a set-up error with one line and exit status 2 (`refuse`).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from crosscheck import exit_codes


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
        problem = output_problem(Path(path))
        if problem:
            return f"crosscheck {command}: {option} {path} cannot be written: {problem}"
    return ""


def refuse(console: Console, line: str) -> int:
    """Print a set-up error (one line, whatever the terminal's width) and return its code."""
    console.print(f"[red]{escape(line)}[/]", soft_wrap=True)
    return exit_codes.SETUP_ERROR
