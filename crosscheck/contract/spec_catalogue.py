"""The named schemes of contract v1 and the trainer modes of contract v2, as scheme specs.

Each entry is the table of docs/schemes-as-data.md, "v1 schemes and trainer modes as specs",
written as the dict a user would write; `crosscheck.contract.spec.get_spec` reads a name
(``configured_rows_mean:64`` for a mode with a parameter). Where a mode comes from is in
docs/modes.md. Data only: the math is in `crosscheck.contract.spec`.
"""

from __future__ import annotations

from typing import Any

_ROW_MEAN = {"weight": {"group": "row"}, "denominator": {"kind": "groups", "group": "row"}}

#: v1's schemes (the six intended, then the two accidental ones).
NAMED_SPECS: dict[str, dict[str, Any]] = {
    "token_mean": {},
    "sequence_mean": {
        "weight": {"group": "segment"},
        "denominator": {"kind": "groups", "group": "segment"},
    },
    "row_mean": _ROW_MEAN,
    "weighted_mean": {"weight": {"soft": "token"}, "denominator": {"kind": "weight_sum"}},
    "constant": {"denominator": {"kind": "slots"}},
    "sum": {"denominator": {"kind": "one"}},
    "rank_mean": {"scope": "rank"},
    "microbatch_mean": {"scope": "microbatch"},
}

#: Trainer modes that v1 cannot name. A mode with a parameter maps the parameter to its spec.
MODE_SPECS: dict[str, dict[str, Any]] = {
    "all_rows_mean": {
        "weight": {"group": "row"},
        "denominator": {"kind": "all_groups", "group": "row"},
    },
    "sample_rows_mean": {
        "weight": {"mask": "sample", "group": "row"},
        "denominator": {"kind": "all_groups", "group": "row", "mask": "sample"},
    },
    "group_token_mean": {
        "weight": {"group": "group"},
        "denominator": {"kind": "groups", "group": "group"},
    },
    "document_mean": {
        "weight": {"group": "document"},
        "denominator": {"kind": "groups", "group": "document"},
    },
    "nonzero_weight_mean": {
        "weight": {"soft": "token"},
        "denominator": {"kind": "tokens", "mask": "nonzero_weight"},
    },
    "signed_row_weight_mean": {
        "weight": {"soft": "row", "group": "row"},
        "denominator": {"kind": "abs_row_weight_sum"},
    },
    "zero_variance_excluded": {"denominator": {"kind": "tokens", "mask": "sample"}},
}

#: Where each trainer mode comes from (docs/modes.md has the citations).
MODE_ORIGINS: dict[str, str] = {
    "all_rows_mean": "mean of row means over ALL rows, fully masked ones included (TRL grpo's "
    "clamp(min=1), slime, SkyRL sequence_mean)",
    "sample_rows_mean": "mean of row means over the rows with sample_mask = 1 (NeMo-RL)",
    "group_token_mean": "mean over prompt groups of each group's token mean, groups spanning "
    "ranks and microbatches (SkyRL prompt_mean, the DAPO group mean of verl#2776)",
    "document_mean": "mean over documents of each document's token mean, documents "
    "continuing across rows",
    "nonzero_weight_mean": "weighted numerator over the count of tokens with a nonzero weight "
    "(prime-rl, ROLL)",
    "signed_row_weight_mean": "signed per-sample weights times row means over the sum of "
    "|weights| (TRL weighted_nll, trl#5952)",
    "zero_variance_excluded": "every token in the numerator, only sampled rows' tokens in the "
    "denominator (TRL dapo_zv)",
    "configured_rows_mean": "mean of row means over a configured number of rows (verl "
    "seq-mean-token-mean, ppo_mini_batch_size x n)",
    "configured_rows_sum": "token sum over a configured number of rows (verl seq-mean-token-sum)",
    "length_power": "length-power weights n_row^-alpha over their sum (Delta-L normalization, "
    "arXiv 2509.07558)",
}

#: Modes with a parameter: name -> (what the parameter is, its default, the spec it makes).
PARAMETRIC_SPECS = {
    "configured_rows_mean": (
        "the configured number of rows B",
        lambda b: {
            "weight": {"group": "row"},
            "denominator": {"kind": "configured", "value": b},
        },
    ),
    "configured_rows_sum": (
        "the configured number of rows B",
        lambda b: {"denominator": {"kind": "configured", "value": b}},
    ),
    "length_power": (
        "the length power alpha",
        lambda alpha: {
            "weight": {"group": "row", "alpha": alpha},
            "denominator": {"kind": "power_sum", "group": "row", "alpha": alpha},
        },
    ),
}
#: The parameter each parametric mode takes in `crosscheck run` when none is given.
DEFAULT_PARAMETERS = {"configured_rows_mean": 8.0, "configured_rows_sum": 8.0, "length_power": 0.5}


def known_spec_names() -> list[str]:
    """Every name `get_spec` reads without a parameter, v1's first."""
    return [*NAMED_SPECS, *MODE_SPECS, *PARAMETRIC_SPECS]
