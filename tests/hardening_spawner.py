"""A worker for tests/test_jax_hardening.py that starts a child, then exits or hangs as told.

``python -m hardening_spawner MARKER PID_FILE SLEEP_S EXIT_CODE [ignore-term]``: starts
``sleep 600`` with ``MARKER`` as its argv[0] (so a test finds it by its command line), writes
the child's pid to PID_FILE, sleeps SLEEP_S and exits with EXIT_CODE, leaving the child
running. With ``ignore-term`` it ignores SIGTERM, so only a SIGKILL ends it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

if __name__ == "__main__":
    marker, pid_file, sleep_s, code = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
    if "ignore-term" in sys.argv[5:]:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([marker, "600"], executable=shutil.which("sleep"))
    tmp = f"{pid_file}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    os.replace(tmp, pid_file)
    time.sleep(sleep_s)
    sys.exit(int(code))
