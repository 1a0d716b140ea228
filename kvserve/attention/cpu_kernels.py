"""The C++ paged decode-attention kernel (csrc/paged_decode.cpp), compiled on first use.

Decode attention on CPU is memory-bound: the PyTorch path gathers every context into a padded copy per
layer (a write and a second read of all K/V) before SDPA reads it again. The kernel reads K/V in place
through the block table. It is built with torch's cpp_extension (ninja + the system C++ compiler) into
torch's extension cache, so only the first process on a machine pays the compile (~1 min).
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform

logger = logging.getLogger(__name__)

_SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "paged_decode.cpp")


def _cpu_tag() -> str:
    """A short digest of this CPU's instruction-set flags. The build uses -march=native, and torch's
    extension cache outlives the machine it was built on: a new CPU must not load an old build."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = platform.processor()
    return hashlib.sha256(flags.encode()).hexdigest()[:10]


def build_extension(name: str, source: str, what: str):
    """Compile `source` (one C++ file with its own PYBIND11_MODULE) for this CPU, or return None (logged)
    when it cannot be built here, so the caller falls back to PyTorch."""
    try:
        from torch.utils.cpp_extension import load

        return load(name=f"{name}_{_cpu_tag()}", sources=[source],
                    extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no compiler / ninja, unsupported platform: fall back to the PyTorch path
        logger.warning("C++ %s unavailable (%s); using the PyTorch path", what,
                       str(e).splitlines()[0] if str(e) else type(e).__name__)
        return None


@functools.lru_cache(maxsize=1)
def load_paged_decode():
    """The compiled paged decode-attention module, or None (logged) when it cannot be built here."""
    return build_extension("kvserve_paged_decode", _SOURCE, "paged decode attention")
