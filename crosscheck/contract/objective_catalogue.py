"""The multi-term objectives the main job and the test vectors check (docs/objectives.md).

* ``aux``: every term, each over the whole update: the main cross-entropy, a z-loss, an
  entropy bonus, a KL to the frozen reference, the multi-token-prediction head on its own
  (smaller) count, and global-batch load balancing;
* ``aux-local``: the cross-entropy beside an entropy bonus averaged per microbatch and
  micro-batch load balancing (Megatron's default), terms whose objective depends on the layout.

The router picks the top `TOP_K` of its experts (the fixtures' params:
`crosscheck.fixtures.objective_params`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

TOP_K = 2

OBJECTIVES: dict[str, list[dict[str, Any]]] = {
    "aux": [
        {"kind": "ce"},
        {"kind": "z_loss", "coefficient": 1e-2},
        {"kind": "entropy", "coefficient": -0.1},
        {"kind": "ref_kl", "coefficient": 0.5},
        {"kind": "mtp", "coefficient": 0.3},
        {"kind": "moe_lb", "coefficient": 0.01, "top_k": TOP_K, "scope": "update"},
    ],
    "aux-local": [
        {"kind": "ce"},
        {"kind": "entropy", "coefficient": -0.1, "scheme": {"scope": "microbatch"}},
        {"kind": "moe_lb", "coefficient": 0.01, "top_k": TOP_K, "scope": "microbatch"},
    ],
}
OBJECTIVE_FIXTURES: tuple[str, ...] = ("packed", "rollouts")
OBJECTIVE_LAYOUTS: tuple[tuple[int, int], ...] = tuple((R, M) for R in (1, 2, 4) for M in (1, 2))


def term_name(term: Mapping[str, Any]) -> str:
    return str(term.get("name", term["kind"]))
