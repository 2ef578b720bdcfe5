"""A worker for tests/test_jax_zygote.py: report what the process sees, exit as told.

``python -m zygote_probe EXIT_CODE [SLEEP_S]`` prints one JSON line (device count, argv, the
GW_PROBE variable, pid and parent pid, the objects frozen out of the garbage collector's sight),
writes a line to stderr, sleeps, and exits.
"""

import gc
import json
import os
import sys
import time

import jax

if __name__ == "__main__":
    code, sleep_s = int(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
    report = {
        "devices": len(jax.devices()),
        "argv": sys.argv[1:],
        "probe": os.environ.get("GW_PROBE"),
        "cwd": os.getcwd(),
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "frozen": gc.get_freeze_count(),
    }
    print(json.dumps(report), flush=True)
    print(f"probe exiting with {code}", file=sys.stderr, flush=True)
    time.sleep(sleep_s)
    sys.exit(code)
