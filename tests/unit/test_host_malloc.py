"""utils/host_malloc.py: freed activation-sized blocks stay in the process, so the next step touches no fresh
pages (glibc, as on every Linux machine this runs on)."""
from __future__ import annotations

import resource

import torch

from kvserve.utils.host_malloc import keep_freed_memory


def _touch_8mib() -> None:
    x = torch.empty(2 << 20)   # 8 MiB of float32: above glibc's default mmap threshold, below 32 MiB
    x.fill_(1.0)
    del x


def test_freed_blocks_are_reused_without_page_faults():
    assert keep_freed_memory()
    for _ in range(6):   # the first few rounds may still grow the heap
        _touch_8mib()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        _touch_8mib()
    # without the thresholds each round can fault its 2,048 pages in afresh (10,240 here)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before < 200


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("KVSERVE_KEEP_FREED_MEMORY", "0")
    assert keep_freed_memory() is False
