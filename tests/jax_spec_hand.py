"""Hand-computed weights for tests/test_jax_spec.py: a 4 x 6 batch whose every trap is
counted by hand below (run inside tests/jax_spec_runner.py, under x64).

Rows (layout (2, 2): one row per microbatch; rank 0 holds rows 0, 1 and rank 1 rows 2, 3):

    row 0: valid at positions 1, 2, 4, 5 (n = 4); documents 1 (pos 0-2) and 2 (pos 3-5)
    row 1: valid at 0, 1, 3, 4 (n = 4); document 2 continues (pos 0-1), document 3 (2-4)
    row 2: nothing valid (a fully masked row); document 4
    row 3: valid at 1, 2, 3 (n = 3); document 5
    group_ids [0, 1, 1, 0]: group 0 (rows 0, 3) lies on both ranks and both microbatch
    indices; row_weights [1.5, -0.5, 2.0, -1.0]; sample_mask [1, 0, 1, 1];
    w_t = 1 except w = 0 at (0, 2) (a valid token) and w = 2 at (3, 1).

Document 2 crosses a row, a microbatch and (at (1, 4)... any layout) a boundary.
"""

from __future__ import annotations

import numpy as np
import optax

import jax_impl
from crosscheck.contract.oracle import weighted_grad

V, H, T = 7, 3, 6
VALID = np.array(
    [[0, 1, 1, 0, 1, 1], [1, 1, 0, 1, 1, 0], [0, 0, 0, 0, 0, 0], [0, 1, 1, 1, 0, 0]], bool
)
SEGMENTS = np.array(
    [[1, 1, 1, 2, 2, 2], [1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]]
)
DOCUMENTS = np.array(
    [[1, 1, 1, 2, 2, 2], [2, 2, 3, 3, 3, 0], [4, 4, 4, 4, 4, 4], [5, 5, 5, 5, 0, 0]]
)
ROW_WEIGHTS = np.array([1.5, -0.5, 2.0, -1.0])


def hand_arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    inputs = rng.integers(0, V, size=(4, T))
    targets = np.where(VALID, rng.integers(0, V, size=(4, T)), -100)
    weights = np.ones((4, T))
    weights[0, 2], weights[3, 1] = 0.0, 2.0
    return {
        "inputs": inputs,
        "targets": targets,
        "segment_ids": SEGMENTS,
        "weights": weights,
        "group_ids": np.array([0, 1, 1, 0]),
        "document_ids": DOCUMENTS,
        "row_weights": ROW_WEIGHTS,
        "sample_mask": np.array([1, 0, 1, 1]),
    }


def per_row(*values: float) -> np.ndarray:
    """c_t = value of its row on the valid tokens."""
    return VALID * np.array(values)[:, None]


def expected() -> dict[str, tuple[dict, tuple[tuple[int, int], ...], np.ndarray]]:
    """name -> (spec, layouts, c [4, 6]) with every c counted by hand."""
    every = ((1, 1), (2, 2), (1, 2), (2, 1), (4, 1))
    documents = np.zeros((4, T))
    documents[0, [1, 2]] = 1 / 2 / 4  # document 1: 2 tokens; 4 non-empty documents
    documents[0, [4, 5]] = documents[1, [0, 1]] = 1 / 4 / 4  # document 2: 4 tokens, 2 rows
    documents[1, [3, 4]] = 1 / 2 / 4
    documents[3, [1, 2, 3]] = 1 / 3 / 4
    nonzero = VALID * 0.1  # a_t = w_t; D = 11 valid - 1 with w = 0
    nonzero[0, 2], nonzero[3, 1] = 0.0, 0.2
    power = 2 * 4**-0.5 + 3**-0.5  # sum over non-empty rows of n^-1/2
    return {
        # group 0: 4 + 3 tokens, group 1: 4 + 0; D = 2 non-empty groups.
        "group_token_mean": (
            {"weight": {"group": "group"}, "denominator": {"kind": "groups", "group": "group"}},
            every,
            per_row(1 / 7 / 2, 1 / 4 / 2, 0, 1 / 7 / 2),
        ),
        # The local-count bug at (2, 2): every row is alone in its microbatch.
        "group_count_microbatch": (
            {
                "weight": {"group": "group", "count_scope": "microbatch"},
                "denominator": {"kind": "groups", "group": "group"},
            },
            ((2, 2),),
            per_row(1 / 4 / 2, 1 / 4 / 2, 0, 1 / 3 / 2),
        ),
        "document_mean": (
            {
                "weight": {"group": "document"},
                "denominator": {"kind": "groups", "group": "document"},
            },
            every,
            documents,
        ),
        # a = row weight / n_row; D = |1.5| + |-0.5| + |2.0| + |-1.0|, the masked row's too.
        "signed_row_weight_mean": (
            {
                "weight": {"soft": "row", "group": "row"},
                "denominator": {"kind": "abs_row_weight_sum"},
            },
            every,
            per_row(1.5 / 4 / 5, -0.5 / 4 / 5, 0, -1.0 / 3 / 5),
        ),
        # Row 1 dropped; D = rows 0, 2, 3 (sample_mask 1, the empty row 2 included).
        "sample_rows_mean": (
            {
                "weight": {"mask": "sample", "group": "row"},
                "denominator": {"kind": "all_groups", "group": "row", "mask": "sample"},
            },
            every,
            per_row(1 / 4 / 3, 0, 0, 1 / 3 / 3),
        ),
        # K = 4 microbatches; row 1's has D = 0 (sample 0) but valid tokens: it adds 0.
        "sample_tokens_microbatch": (
            {"denominator": {"kind": "tokens", "mask": "sample"}, "scope": "microbatch"},
            ((2, 2),),
            per_row(1 / 4 / 4, 0, 0, 1 / 3 / 4),
        ),
        "nonzero_weight_mean": (
            {
                "weight": {"soft": "token"},
                "denominator": {"kind": "tokens", "mask": "nonzero_weight"},
            },
            every,
            nonzero,
        ),
        "length_power": (
            {
                "weight": {"group": "row", "alpha": 0.5},
                "denominator": {"kind": "power_sum", "group": "row", "alpha": 0.5},
            },
            every,
            per_row(0.5 / power, 0.5 / power, 0, 3**-0.5 / power),
        ),
    }


def run_hand() -> list[dict]:
    """Each hand case under pmap (precount psum, postnorm) and shard_map (precount pmean)."""
    from jax_spec_runner import RTOL, _np, _record, make_sweep, rel_err

    arrays = hand_arrays()
    rng = np.random.default_rng(6)
    params_np = {"embed": rng.normal(size=(V, H)), "unembed": rng.normal(size=(H, V))}
    params = jax_impl.params_from_numpy(params_np, "float64")
    opt, records = optax.sgd(0.1), []
    cases = expected()
    every_run = (
        ("pmap", "precount", "psum"),
        ("pmap", "postnorm", "psum"),
        ("shard_map", "precount", "pmean"),
        ("jit", "postnorm", "psum"),
    )
    for R, M in sorted({layout for _, layouts, _ in cases.values() for layout in layouts}):
        names = [name for name, (_, layouts, _) in cases.items() if (R, M) in layouts]
        batch = jax_impl.lay_out_global_batch(arrays, R, M, vocab_size=V)
        # Every front-end and strategy at (2, 2); the other layouts under pmap's precount.
        runs = every_run if (R, M) == (2, 2) else every_run[:1]
        for front_end, strategy, collective in runs:
            configs = [
                jax_impl.StepConfig(
                    optimizer=opt, scheme=cases[n][0], strategy=strategy, collective=collective
                )
                for n in names
            ]
            outs = make_sweep(front_end, configs, R)([params] * len(configs), batch)
            for name, out in zip(names, outs, strict=True):
                want = weighted_grad(params_np, arrays["inputs"], arrays["targets"], cases[name][2])
                err = rel_err(_np(out.grads), want)
                variant = f"{strategy}-{collective}"
                records.append(
                    _record("hand", front_end, "hand", name, variant, R=R, M=M, err=err,
                            want=RTOL)
                )  # fmt: skip
    return records
