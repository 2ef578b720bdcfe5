"""A diagnosis as a picture: the weight each group of tokens got, against the intended one.

`plot_diagnosis` draws, for one case (fixture and layout R x M), every group of valid tokens
the diagnosis recovered a weight for (a row's segment: a document, a sequence, a prompt's
completion), in rank, microbatch and row order, as a horizontal bar as wide as its token
count at the height of its recovered per-token weight c_g, and the intended scheme's c_g as
a dashed line over it. Each rank x microbatch unit is a shaded band with its name, so a
per-rank or per-microbatch normalization shows as bands at different heights; the title
names the pattern and the weight ratio (largest over smallest of c_g / intended c_g).

matplotlib is imported when a picture is drawn, never at import: it costs every other
command a second, and it is an optional extra (``pip install 'gradweight[plot]'``). The
picture is drawn on a figure of its own (no pyplot): the caller's backend is left alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# `diagnosis` below is a crosscheck.diagnosis.result.Diagnosis, typed Any: its `plot` method
# imports this module, which therefore does not import it back.


def _title(diagnosis: Any, what: str) -> str:
    case = f"{diagnosis.fixture}, R={diagnosis.world_size}, M={diagnosis.accum_steps}"
    if diagnosis.context_size > 1:
        case += f", C={diagnosis.context_size} {diagnosis.context_order}"
    if not diagnosis.detected:
        verdict = f"matches {diagnosis.intended} ({diagnosis.precision} level)"
    else:
        verdict = f"{diagnosis.best_match}, weight ratio {diagnosis.weight_ratio:.3g}x"
        if abs(diagnosis.scale - 1) > 1e-6:
            verdict += f", scale {diagnosis.scale:.3g}"
    head = f"{what}: " if what else ""
    return f"{head}{verdict}\n{case}; intended {diagnosis.intended}"


def plot_diagnosis(diagnosis: Any, path: str | Path, what: str = "") -> Path:
    """Write the PNG of `diagnosis` to `path` and return the path. `what` (a step's name)
    opens the title. Raises ValueError for a diagnosis with nothing to draw: no recovered
    group weights, or a gradient holding NaN or inf (its weights are not numbers)."""
    case = diagnosis.case
    if diagnosis.unusable:
        raise ValueError(f"{case}: nothing to draw: {diagnosis.unusable}")
    if not diagnosis.groups:
        raise ValueError(f"{case}: the diagnosis recovered no group weights: nothing to draw")
    # A Figure of its own on the Agg canvas, never pyplot: drawing must not change the
    # caller's matplotlib backend or leave a figure open (a notebook keeps its own).
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(path)
    groups = sorted(diagnosis.groups, key=lambda g: (g.rank, g.microbatch, g.row, g.segment))
    fig = Figure(figsize=(10, 4.8), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    start = 0
    unit_start: dict[tuple[int, int], int] = {}
    unit_end: dict[tuple[int, int], int] = {}
    for index, group in enumerate(groups):
        end = start + group.tokens
        unit = (group.rank, group.microbatch)
        unit_start.setdefault(unit, start)
        unit_end[unit] = end
        first = index == 0
        ax.hlines(
            group.weight, start, end, colors="tab:red", linewidth=3,
            label="recovered weight c_g" if first else None,
        )  # fmt: skip
        ax.hlines(
            group.intended, start, end, colors="tab:green", linestyles="--", linewidth=1.5,
            label=f"intended ({diagnosis.intended})" if first else None,
        )  # fmt: skip
        start = end
    for (rank, microbatch), begin in unit_start.items():
        shade = "0.90" if (rank + microbatch) % 2 else "0.97"
        ax.axvspan(begin, unit_end[rank, microbatch], color=shade, zorder=0)
        ax.text(
            (begin + unit_end[rank, microbatch]) / 2,
            1.0,
            f"rank {rank}, mb {microbatch}",
            transform=ax.get_xaxis_transform(),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_xlim(0, start)
    # Signed weights (signed_row_weight_mean) go below 0: the axis starts at the lowest.
    lowest = min(0.0, *(min(g.weight, g.intended) for g in groups))
    ax.set_ylim(bottom=lowest * 1.05 if lowest < 0 else 0)
    if lowest < 0:
        ax.axhline(0, color="0.4", linewidth=0.8)
    ax.set_xlabel("valid target tokens, by rank, microbatch and row (a bar: one row's segment)")
    ax.set_ylabel("per-token weight in the update")
    ax.legend(loc="upper right", fontsize=9)
    title = _title(diagnosis, what)
    ax.set_title(title, fontsize=10, pad=18)
    fig.tight_layout()
    # Always a PNG, whatever the name ends in; its title is also the PNG's own Title text, so
    # a reader (or a test) finds it without reading the pixels.
    fig.savefig(path, format="png", metadata={"Title": title})
    return path
