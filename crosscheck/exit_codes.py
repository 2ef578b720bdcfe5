"""The exit status of every `python -m crosscheck` command, named once.

A script or CI job can act on the status without reading the output, so each code means one
thing in every command:

- `OK` (0): verified; every row is what the contract expects.
- `MISMATCH` (1): a mismatch was found: a weighting bug, a failing row, a buggy step that was
  not detected or not named. It wins over `STEP_FAILED` when both happened.
- `SETUP_ERROR` (2): a usage or set-up error, found before any work starts: bad arguments
  (argparse's own usage errors are 2 as well), an unknown fixture or scheme, a plan that runs
  nothing, an output path (``--json``, ``--log``, ``--plot``, the export directory) that cannot
  be written, a non-empty export directory without ``--force``, a ``--step`` whose module or
  function does not exist. A set-up error is never reported as a mismatch.
- `STEP_FAILED` (3): something could not be run and nothing showed a mismatch: the step (or a
  buggy step of the catalogue) raised, hung or returned what could not be read.
- `INTERRUPTED` (130, 128 + SIGINT as shells report Ctrl-C): SIGINT or SIGTERM; every process
  the command started has been stopped, and one line on stderr says so.

Per command:

- ``verify``: 0, 1 (some case was diagnosed as not matching the intended scheme, a non-finite
  gradient included), 2, 3 (no case mismatched, but some case could not be run or read: a
  `crosscheck.verification.protocol.StepError`), 130.
- ``bugs``: 0, 1, 2, 3 (every failure is a buggy step that could not be run, or a skew run that
  had no measured minimum because its correct run could not be run), 130.
- ``run``: 0, 1, 2, 3 (no row mismatched, but some row could not be run: an implementation
  raised, timed out or came back with nothing comparable; its rows carry ``not_run``), 130.
- ``export-vectors``: 0, 2, 130.
"""

from __future__ import annotations

OK = 0
MISMATCH = 1
SETUP_ERROR = 2
STEP_FAILED = 3
INTERRUPTED = 130

__all__ = ["INTERRUPTED", "MISMATCH", "OK", "SETUP_ERROR", "STEP_FAILED", "of_outcome"]


def of_outcome(ok: bool, mismatched: bool) -> int:
    """The status of a command that ran its work: OK when it passed; else MISMATCH when
    something ran and mismatched (a mismatch wins over a crash), else STEP_FAILED (every
    failure is something that could not be run or read)."""
    if ok:
        return OK
    return MISMATCH if mismatched else STEP_FAILED
