"""Keep freed host memory in the process for the next step, instead of handing it back to the OS.

A prefill step on CPU allocates its activations afresh (a 512-token chunk: ~100-160 MB over its 30 layers)
and frees them at the end. glibc's malloc serves such blocks with mmap or grows the heap for them, and gives
them back on free (munmap, or a trim of the heap's top): the next step then touches fresh pages, each a page
fault that the kernel zeroes. Measured on SmolLM2 (one 1,072-token prompt, 512-token steps): 25,000-54,000
minor faults per step, 24-311 ms of system time on top of 330-440 ms steps, the slow end whenever the two
cores were contended. The same reason is why vLLM's CPU guide preloads tcmalloc. With a fixed mmap
threshold at glibc's largest (32 MiB) and a trim threshold of 1 GiB, freed blocks stay on malloc's free lists
and the next step reuses them: 0 faults a step after the first, for at most the activation peak kept
resident (the worker's warm-up forward touches it anyway). Blocks above 32 MiB still come from mmap.

glibc only (mallopt through ctypes); elsewhere, or with KVSERVE_KEEP_FREED_MEMORY=0, nothing changes.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

import kvserve.envs as envs

logger = logging.getLogger(__name__)

# mallopt parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20
"""glibc's upper bound for M_MMAP_THRESHOLD on 64-bit (HEAP_MAX_SIZE / 2)."""
TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Set the thresholds (module docstring) for this process; True if they are now in force."""
    if not envs.keep_freed_memory():
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018 (glibc's own symbol: what tells it from musl or macOS)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False  # not glibc: other allocators have no such knobs
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not ok:
        logger.warning("mallopt refused the thresholds: freed host memory goes back to the OS after each step")
    return ok
