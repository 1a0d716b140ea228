"""The current process's resident memory (for leak checks: the soak's slope, the engine's gauge)."""
from __future__ import annotations

import os
import resource


def resident_memory_bytes() -> int:
    """Resident set size now, from /proc where there is one; elsewhere the peak (an upper bound)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if os.uname().sysname == "Darwin" else peak * 1024
