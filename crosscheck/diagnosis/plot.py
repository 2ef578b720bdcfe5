"""A diagnosis as a picture: the weight each group of tokens got, against the intended one.

`plot_diagnosis` draws, for one case (fixture and layout R x M), every group of valid tokens
the diagnosis recovered a weight for (a row's segment: a document, a sequence, a prompt's
completion), in rank, microbatch and row order, as a horizontal bar as wide as its token
count at the height of its recovered per-token weight c_g, and the intended scheme's c_g as
a dashed line over it. Each rank x microbatch unit is a shaded band with its name, so a
per-rank or per-microbatch normalization shows as bands at different heights; the title
names the pattern and the weight ratio (largest over smallest of c_g / intended c_g).

matplotlib is imported when a picture is drawn, never at import: it costs every other
command a second, and it is an optional extra (``pip install 'gradweight[plot]'``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# `diagnosis` below is a crosscheck.diagnosis.result.Diagnosis, typed Any: its `plot` method
# imports this module, which therefore does not import it back.


def _title(diagnosis: Any, what: str) -> str:
    case = f"{diagnosis.fixture}, R={diagnosis.world_size}, M={diagnosis.accum_steps}"
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
    opens the title. Raises ValueError for a diagnosis without recovered group weights (a
    gradient that could not be fitted: there is nothing to draw)."""
    if not diagnosis.groups:
        raise ValueError(
            f"{diagnosis.fixture} R={diagnosis.world_size} M={diagnosis.accum_steps}: the "
            "diagnosis recovered no group weights, so there is nothing to draw"
        )
    import matplotlib

    matplotlib.use("Agg")  # no display on CI machines: the file is the output
    import matplotlib.pyplot as plt

    path = Path(path)
    groups = sorted(diagnosis.groups, key=lambda g: (g.rank, g.microbatch, g.row, g.segment))
    fig, ax = plt.subplots(figsize=(10, 4.8), dpi=110)
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
    ax.set_ylim(bottom=0)
    ax.set_xlabel("valid target tokens, by rank, microbatch and row (a bar: one row's segment)")
    ax.set_ylabel("per-token weight in the update")
    ax.legend(loc="upper right", fontsize=9)
    title = _title(diagnosis, what)
    ax.set_title(title, fontsize=10, pad=18)
    fig.tight_layout()
    # The title is also the PNG's own Title text: a reader (or a test) finds it without OCR.
    fig.savefig(path, metadata={"Title": title})
    plt.close(fig)
    return path
