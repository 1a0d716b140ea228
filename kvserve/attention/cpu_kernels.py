"""The C++ paged attention kernel (csrc/paged_attention.cpp), built through utils/cpp_extension.py.

Decode attention on CPU is memory-bound: the PyTorch path gathers every context into a padded copy per
layer (a write and a second read of all K/V) before SDPA reads it again, and a prefill chunk after cached
context gathers that context too. The kernel reads K/V in place through the block table, for both.
"""
from __future__ import annotations

import functools
import os

from kvserve.utils.cpp_extension import build_extension

_SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "paged_attention.cpp")


@functools.lru_cache(maxsize=1)
def load_paged_attention():
    """The compiled paged attention module (decode and prefill), or None (logged) when it cannot be built here."""
    return build_extension("kvserve_paged_attention", _SOURCE, "paged attention")
