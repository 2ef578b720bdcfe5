"""The keys of `crosscheck run`'s JSON report and per-update log, as docs/run.md documents them.

Written once here for the tests that read those files (test_cli, test_matrix, test_plan). They
are the documented contract, typed out, not imported from the package: the package's writers
are what they check.
"""

from __future__ import annotations

#: What names a case, in the same words in result rows and skipped rows.
CASE_KEYS = ("impl", "fixture", "scheme", "strategy", "world_size", "accum_steps", "dtype")
#: Every row of "results" has at least these.
RESULT_KEYS = {
    "check",
    *CASE_KEYS,
    *("max_rel_err", "ok", "reference", "weight_ratio", "deviation", "detail"),
}
#: Every row of "skipped" has exactly these: the case, and why it did not run.
SKIP_KEYS = {"check", *CASE_KEYS, "reason"}
#: Every record of the per-update log (--log) has at least these.
LOG_KEYS = {
    *CASE_KEYS[:-1],  # the log names no dtype
    *("rank", "update", "valid_tokens", "loss_sum", "denominator", "objective"),
    *("grad_norm", "clipped_grad_norm"),
}
