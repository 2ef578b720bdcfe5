"""The multi-term objectives the example steps mean to compute (docs/objectives.md).

``crosscheck verify --objective examples.objectives:MOE`` reads one of these lists of terms:

* ``MOE``: the cross-entropy, a z-loss and global-batch load balancing, every term over the
  whole update (a MoE pretraining objective: PaLM's z-loss, Switch's load balancing);
* ``ENTROPY_BONUS``: the cross-entropy over the update and an entropy bonus that is *meant*
  to be averaged per microbatch (the mean over the R M microbatches of each one's token
  mean), as RL trainers that add it inside their per-microbatch loss do;
* ``MTP``: the cross-entropy and a multi-token-prediction head over its own, smaller count.
"""

from __future__ import annotations

MOE = [
    {"kind": "ce"},
    {"kind": "z_loss", "coefficient": 1e-2},
    {"kind": "moe_lb", "coefficient": 0.01, "top_k": 2, "scope": "update"},
]
ENTROPY_BONUS = [
    {"kind": "ce"},
    {"kind": "entropy", "coefficient": -0.1, "scheme": {"scope": "microbatch"}},
]
MTP = [{"kind": "ce"}, {"kind": "mtp", "coefficient": 0.3}]
