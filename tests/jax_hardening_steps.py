"""A JAX step for tests/test_jax_hardening.py: starts child processes, then hangs.

Imported only by the verify worker (``tests.jax_hardening_steps:spawns_then_hangs``), never by
the test process. Correct on ``packed``; on ``ragged`` it starts two ``sleep 600`` processes
whose argv[0] is the test's marker (``GW_HARDENING_MARKER``), writes their pids to
``$GW_HARDENING_DIR/children`` and sleeps far past any time limit.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.jax_verify_steps import RAGGED_T, correct_grads


def spawns_then_hangs(params: Any, apply_fn: Callable, batch: dict[str, Any], mesh: Any) -> Any:
    """The token-mean gradient on packed; on ragged: two marked children, then a hang."""
    if batch["inputs"].shape[-1] == RAGGED_T:
        marker = os.environ["GW_HARDENING_MARKER"]
        sleep = shutil.which("sleep")
        children = [subprocess.Popen([marker, "600"], executable=sleep) for _ in range(2)]
        where = Path(os.environ["GW_HARDENING_DIR"]) / "children"
        where.with_suffix(".tmp").write_text(" ".join(str(c.pid) for c in children))
        where.with_suffix(".tmp").replace(where)
        time.sleep(3600)
    return correct_grads(params, apply_fn, batch)
