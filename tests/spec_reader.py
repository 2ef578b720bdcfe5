"""A reader of a scheme spec written from the vectors' manifest alone, token by token.

The exported vectors must be usable without this package: this is how another language would
read a trainer mode's ``spec`` (the manifest's ``spec`` text, docs/schemes-as-data.md), with
Python dicts and loops instead of the oracle's numpy grouping, and the defaults of the
manifest's ``fixture_optional`` keys for a fixture file that lacks them.
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np

IGNORE = -100


def _fields(fx: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The fixture's v2 fields, or their documented defaults."""
    N = fx["targets"].shape[0]
    width = int(fx["segment_ids"].max()) + 1
    rows = np.arange(N)[:, None]
    return {
        "group_ids": fx.get("group_ids", np.arange(N)),
        "document_ids": fx.get(
            "document_ids", np.where(fx["segment_ids"] > 0, rows * width + fx["segment_ids"], 0)
        ),
        "row_weights": fx.get("row_weights", np.ones(N)),
        "sample_mask": fx.get("sample_mask", np.ones(N, dtype=int)),
    }


def spec_weights(fx: dict[str, np.ndarray], spec: dict, R: int, M: int) -> tuple[np.ndarray, list]:
    """(c [N, T], [D_u per unit]) of `spec` on the fixture laid out as (R, M)."""
    targets, segments, soft = fx["targets"], fx["segment_ids"], fx["weights"]
    N, T = targets.shape
    B = N // (R * M)
    extra = _fields(fx)
    weight, den, scope = spec["weight"], spec["denominator"], spec["scope"]

    def unit(n: int, which: str) -> int:
        r, m = n // (M * B), (n // B) % M
        return {"update": 0, "rank": r, "microbatch": r * M + m}[which]

    def key(n: int, p: int, group: str):
        r, m = n // (M * B), (n // B) % M
        return {
            "none": 0,
            "row": n,
            "segment": (n, int(segments[n, p])),
            "document": int(extra["document_ids"][n, p]),
            "group": int(extra["group_ids"][n]),
            "microbatch": (r, m),
            "rank": r,
        }[group]

    def masked(n: int, p: int, name: str) -> bool:
        valid = targets[n, p] != IGNORE
        if name == "sample":
            return bool(valid and extra["sample_mask"][n])
        if name == "nonzero_weight":
            return bool(valid and soft[n, p] != 0)
        return bool(valid)

    tokens = [(n, p) for n in range(N) for p in range(T)]

    def counts(group: str, count_scope: str, mask: str) -> dict:
        out: dict = defaultdict(int)
        for n, p in tokens:
            out[unit(n, count_scope), key(n, p, group)] += masked(n, p, mask)
        return out

    n_weight = counts(weight["group"], weight["count_scope"], weight["mask"])
    a = np.zeros((N, T))
    for n, p in tokens:
        if not masked(n, p, weight["mask"]):
            continue
        factor = {"none": 1.0, "token": soft[n, p], "row": extra["row_weights"][n]}[weight["soft"]]
        if weight["group"] != "none":
            count = n_weight[unit(n, weight["count_scope"]), key(n, p, weight["group"])]
            factor = factor / count if weight["alpha"] == 1 else factor * count ** -weight["alpha"]
        a[n, p] = factor

    num_units = {"update": 1, "rank": R, "microbatch": R * M}[scope]
    denominators = []
    for u in range(num_units):
        inside = [(n, p) for n, p in tokens if unit(n, scope) == u]
        rows = sorted({n for n, _ in inside})
        kind, mask = den["kind"], den["mask"]
        chosen = [(n, p) for n, p in inside if masked(n, p, mask)]
        if kind == "one":
            D = 1.0
        elif kind == "configured":
            D = float(den["value"])
        elif kind == "tokens":
            D = float(len(chosen))
        elif kind == "slots":
            D = float(len(inside))
        elif kind == "weight_sum":
            D = math.fsum(float(soft[n, p]) for n, p in chosen)
        elif kind == "groups":
            D = float(len({key(n, p, den["group"]) for n, p in chosen}))
        elif kind == "power_sum":
            n_den = counts(den["group"], weight["count_scope"], mask)
            pieces = {(unit(n, weight["count_scope"]), key(n, p, den["group"])) for n, p in chosen}
            D = math.fsum(n_den[piece] ** -den["alpha"] for piece in pieces)
        elif kind == "abs_row_weight_sum":
            D = math.fsum(abs(float(extra["row_weights"][n])) for n in rows)
        else:  # all_groups: every group present, empty ones included
            kept = [n for n in rows if mask != "sample" or extra["sample_mask"][n]]
            if den["group"] in ("row", "group", "microbatch", "rank"):
                D = float(len({key(n, 0, den["group"]) for n in kept}))
            else:
                D = float(
                    len(
                        {
                            key(n, p, den["group"])
                            for n, p in inside
                            if n in kept and segments[n, p] > 0
                        }
                    )
                )
        denominators.append(D)
    c = np.zeros((N, T))
    for n, p in tokens:
        D = denominators[unit(n, scope)]
        if D != 0:
            c[n, p] = a[n, p] / D / num_units
    return c, denominators
