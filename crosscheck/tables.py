"""Terminal tables that fit: the wide layout where the console has room, the compact one
where the wide one would cut a cell.

Every command's tables have a compact layout for narrow terminals (80 columns): names share a
column that wraps between words, numbers keep their own columns. `fitted` picks one. Layout
only, no math: a leaf every layer that prints may use.
"""

from __future__ import annotations

import io
from collections.abc import Callable

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table


def cuts_a_cell(console: Console, table: Table) -> bool:
    """Whether `table` printed on `console` would cut a cell short.

    Two tests, both needed: the table's minimum width (every cell's longest word, borders and
    padding) must fit the console, or rich squeezes some columns below it (down to nothing,
    without a mark); and rendered at the console's width it must show no ellipsis.
    """
    unbounded = console.options.update_width(10_000)
    if Measurement.get(console, unbounded, table).minimum > console.width:
        return True
    probe = Console(width=console.width, file=io.StringIO(), color_system=None)
    probe.print(table)
    return "\u2026" in probe.file.getvalue()


def fitted(console: Console, wide: Table, compact: Callable[[], Table]) -> Table:
    """`wide` where it fits `console` without cutting a cell, else `compact()`."""
    return compact() if cuts_a_cell(console, wide) else wide
