"""The intended schemes of TRL 1.16.0's ``GRPOTrainer`` loss types, as contract v2 spec dicts.

Import-light on purpose (no trl, no torch): ``crosscheck verify --scheme MODULE:OBJECT`` imports
the scheme in the main process, while the steps in `crosscheck.conformance.adapters.trl_grpo`
import trl at the top and run only inside the ranks.

On-policy (``num_iterations=1``, no old log-probs, importance ratio exactly 1, ``beta=0``),
every loss type's per-token gradient is ``-A_i * grad log p_t``: the cross-entropy of token t
weighted by its row's signed advantage ``A_i`` (``soft: "row"``; the fixture ``grpo-groups``
carries ``A_i = r_i - mean(group)`` as ``row_weights``). What tells the loss types apart is the
weighting the docs promise, quoted from ``trl/trainer/grpo_config.py`` of trl 1.16.0 (the
``loss_type`` field's docstring, lines 237-267 of the class docstring; the same text as the
field's ``help``, lines 801-835):

* ``grpo``: "Aggregates token-level losses by normalizing over sequence length." Each row's
  token mean, averaged over the rows of the batch (DeepSeekMath's (1/G) sum_i (1/|o_i|) sum_t):
  `GRPO_INTENDED`.
* ``dr_grpo``: "Aggregates token-level losses by normalizing with a global constant. [...] The
  value of the constant corresponds to ``max_completion_length``." The Dr. GRPO objective
  (arXiv 2503.20783) sums each completion's tokens, divides by the constant MAX_TOKENS and
  averages over the G completions: sum / (rows x max_completion_length) over the update's 24
  rows: `DR_GRPO_INTENDED`. (Read literally as "divide by ``max_completion_length`` alone", the
  spec would be 24 times larger; verify would then name a scale of 1/24.)
* ``dapo`` (the default): "Aggregates token-level losses by normalizing with the number of
  active token in the global accumulated batch." A token mean over the whole update:
  `DAPO_INTENDED`.
* ``bnpo``: "Aggregates token-level losses by normalizing with the number of active token in
  the local batch. Note that normalization is performed over the local batch only, so results
  may slightly vary depending on the local batch size, despite a constant effective batch size.
  When using ``per_device_train_batch_size==1``, the loss is equivalent to the GRPO loss." The
  objective is the batch-normalized token mean, the same as dapo's over the batch:
  `BNPO_INTENDED`; the docs then warn that TRL computes it per local batch (one rank's
  microbatch of ``per_device_train_batch_size`` rows), i.e. a token mean per microbatch,
  averaged. ``crosscheck verify`` refuses a microbatch-scope spec as an intended scheme (it is
  the accidental ``microbatch_mean``), so the documented caveat is checked the other way: the
  verdict against `BNPO_INTENDED` is expected to name microbatch-mean, which is what the docs
  say (and equal to grpo's per-row mean when a local batch is one row).
* ``cispo``: "Clips the importance sampling weights [...] The clipped weights are then
  multiplied with the advantages and policy model's log probs. Individual token losses are
  aggregated by normalizing with the number of active tokens in the global accumulated batch."
  The weight is a clipped importance ratio, which is 1 on-policy (MiniMax-M1, arXiv
  2506.13585): a token mean over the update, `CISPO_INTENDED` (= `DAPO_INTENDED`), whatever
  ``epsilon_high`` is, as long as the clip leaves a ratio of 1 alone. ``epsilon_high`` (class
  docstring lines 184-188): "If not specified, it defaults to the same value as the
  lower-bound specified in argument ``epsilon``. [...] When used with ``loss_type='cispo'``,
  this corresponds to the ε_max param specified in the ScaleRL paper and the recommended value
  is ``5.0``."
* ``sapo``: "Replaces hard clipping with a smooth, temperature-controlled gate [...]". The docs
  say nothing of the aggregation; the SAPO paper (arXiv 2511.20347) averages each sequence's
  token mean over the sequences, as GRPO does, and TRL normalizes it with ``grpo``: the gate's
  derivative at ratio 1 is exactly 1 (sigmoid'(0) x 4), so `SAPO_INTENDED` = `GRPO_INTENDED`.
* ``luspo``: "A sequence-level loss that scales each sequence's loss by its length. This is a
  modification of GSPO and requires ``importance_sampling_level='sequence'``." GSPO's mean over
  sequences of each sequence's (length-normalized) loss, times the sequence's length: each row
  contributes the sum of its tokens, over the number of rows: `LUSPO_INTENDED`.
* ``vespo``: "Replaces hard clipping with a smooth, asymmetric Gamma weighting function
  applied directly to sequence-level importance weights." The docs say nothing of the
  aggregation; phi(1) = 1 on-policy, and TRL normalizes it as ``dapo`` and ``cispo`` (the
  default loss type's documented aggregation): `VESPO_INTENDED` = `DAPO_INTENDED`.

``scale_rewards="none"`` is a documented setting ("no scaling is applied", class docstring
lines 227-236), used so that the trainer's advantages are exactly ``r - mean(group)``, the
fixture's ``row_weights``; it is a choice of advantage, not of normalization.
"""

from __future__ import annotations

from typing import Any

#: The fixture's update: 24 completions (6 prompt groups of 4).
GRPO_GROUPS_ROWS = 24
#: ``max_completion_length`` the adapter configures: the fixture's longest completion.
MAX_COMPLETION_LENGTH = 20

#: grpo, sapo: each row's token mean, averaged over every row of the update.
GRPO_INTENDED: dict[str, Any] = {
    "name": "trl_grpo",
    "weight": {"soft": "row", "group": "row"},
    "denominator": {"kind": "all_groups", "group": "row"},
}
SAPO_INTENDED: dict[str, Any] = {**GRPO_INTENDED, "name": "trl_sapo"}

#: dapo, cispo, vespo: one token mean over the global accumulated batch (the update).
DAPO_INTENDED: dict[str, Any] = {"name": "trl_dapo", "weight": {"soft": "row"}}
CISPO_INTENDED: dict[str, Any] = {**DAPO_INTENDED, "name": "trl_cispo"}
VESPO_INTENDED: dict[str, Any] = {**DAPO_INTENDED, "name": "trl_vespo"}

#: bnpo: the batch-normalized token mean (the docs warn it is taken per local batch).
BNPO_INTENDED: dict[str, Any] = {"name": "trl_bnpo", "weight": {"soft": "row"}}

#: dr_grpo: every token's sum over the constant rows x max_completion_length.
DR_GRPO_INTENDED: dict[str, Any] = {
    "name": "trl_dr_grpo",
    "weight": {"soft": "row"},
    "denominator": {
        "kind": "configured",
        "value": GRPO_GROUPS_ROWS * MAX_COMPLETION_LENGTH,
    },
}

#: luspo: each row's token sum (length x its mean), averaged over every row of the update.
LUSPO_INTENDED: dict[str, Any] = {
    "name": "trl_luspo",
    "weight": {"soft": "row"},
    "denominator": {"kind": "all_groups", "group": "row"},
}
