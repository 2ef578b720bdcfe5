"""`--plot PATH`: the effective per-token weight by rank and microbatch, as a PNG.

One panel per fixture layout: valid tokens in global order on x, their effective weight a_t / D
on y, the intended scheme as a flat line beside the accidental ones, with the rank and
microbatch boundaries shaded, so the seed example's 9x is visible at a glance.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on CI machines; the file is the output

import matplotlib.pyplot as plt
import numpy as np

from crosscheck.contract.fixture import Fixture
from crosscheck.contract.schemes import effective_weights, resolve_scheme

SCHEME_STYLES = {
    "token_mean": {"color": "tab:green", "linewidth": 2.5},
    "rank_mean": {"color": "tab:red", "linestyle": "--", "linewidth": 1.8},
    "microbatch_mean": {"color": "tab:orange", "linestyle": ":", "linewidth": 1.8},
}


def plot_effective_weights(
    fixture: Fixture,
    path: str | Path,
    world_size: int,
    accum_steps: int,
    schemes: tuple[str, ...] = ("token_mean", "rank_mean", "microbatch_mean"),
) -> Path:
    """Write the PNG and return its path."""
    path = Path(path)
    batch = fixture.layout(world_size, accum_steps)
    valid = fixture.valid.ravel()
    # rank and microbatch of every valid token, in global order
    R, M, B, T = batch.targets.shape
    rank_of = np.repeat(np.arange(R), M * B * T)[valid]
    step_of = np.tile(np.repeat(np.arange(M), B * T), R)[valid]
    x = np.arange(valid.sum())
    fig, ax = plt.subplots(figsize=(10, 4.8), dpi=110)
    group = rank_of * M + step_of
    edges = np.flatnonzero(np.diff(group)) + 0.5
    bounds = np.concatenate([[-0.5], edges, [x.size - 0.5]])
    for k in range(bounds.size - 1):
        r, m = divmod(int(group[int(np.ceil(bounds[k]))]), M)
        ax.axvspan(bounds[k], bounds[k + 1], color="0.92" if r % 2 else "0.98", zorder=0)
        label = f"rank {r}" + (f", mb {m}" if M > 1 else "")
        ax.text(
            (bounds[k] + bounds[k + 1]) / 2,
            1.0,
            label,
            transform=ax.get_xaxis_transform(),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    for name in schemes:
        weights = effective_weights(name, batch).ravel()[valid]
        kind = "intended" if resolve_scheme(name).intended else "accidental"
        ax.step(x, weights, where="mid", label=f"{name} ({kind})", **SCHEME_STYLES.get(name, {}))
    ax.set_xlabel("valid target token, global order (shaded: rank / microbatch)")
    ax.set_ylabel("effective weight  a_t / D")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper right", fontsize=9)
    ratio = _max_ratio(effective_weights("rank_mean", batch), fixture.valid)
    ax.set_title(
        f"fixture '{fixture.name}', R={world_size}, M={accum_steps}: "
        f"{', '.join(schemes)}  (rank_mean weight ratio {ratio:.1f}x)",
        fontsize=10,
        pad=16,
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _max_ratio(weights: np.ndarray, valid: np.ndarray) -> float:
    w = weights.reshape(valid.shape)[valid & (weights.reshape(valid.shape) > 0)]
    return float(w.max() / w.min()) if w.size else 1.0
