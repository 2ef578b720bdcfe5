"""Peak resident memory of one call, for the torch ranks on the CPU (Linux only).

torch's CPU allocator keeps no statistics of its own (tracemalloc does not see its tensors),
so a path's peak is read from the kernel: free memory is first handed back to the system
(``gc.collect`` and glibc's ``malloc_trim(0)``, so that the path cannot reuse pages an
earlier path left in malloc's free lists without them counting), the process's peak-RSS
counter is reset (writing 5 to /proc/self/clear_refs, Linux >= 4.0), the call runs, and the
peak is VmHWM minus the RSS just before. It counts every byte the call made resident:
tensors, autograd's saved activations, the collective's buffers, malloc's overhead.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from collections.abc import Callable
from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_bytes(field: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024  # the kernel reports kB
    raise RuntimeError(f"{_STATUS} has no {field} line")


def rss_supported() -> str:
    """'' where `peak_rss_delta` works here, else why not."""
    if not _STATUS.exists() or not _CLEAR_REFS.exists():
        return "no /proc/self/status or /proc/self/clear_refs (not Linux)"
    if ctypes.util.find_library("c") is None:
        return "no C library to call malloc_trim in"
    return ""


def peak_rss_delta(call: Callable[[], object]) -> int:
    """Bytes by which the process's resident set peaked above its size just before `call`."""
    gc.collect()
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if hasattr(libc, "malloc_trim"):  # glibc; another libc keeps what it keeps
        libc.malloc_trim(0)
    _CLEAR_REFS.write_text("5")  # resets VmHWM to the current RSS
    before = _status_bytes("VmRSS")
    call()
    return max(0, _status_bytes("VmHWM") - before)
