"""Sliding-window block release: which blocks of a request no query can read any more, and the prefix-cache hit
a windowed model needs (as vLLM's SlidingWindowManager).

With every layer windowed (window W at most), a query at position p reads positions (p - W, p] only. A step
that computes positions >= p0 therefore never reads a block that ends before p0 - W + 1, and no later step
does either: such a block can go back to the pool while the request runs, so a request holds about
W / block_size + 1 blocks however long it gets. Its table keeps its length: a released entry becomes a
placeholder (the manager's null block). A prefix hit of h blocks needs only the blocks its next query reads
cached, not the whole prefix.
"""
from __future__ import annotations

from collections.abc import Callable


def first_live_block(num_computed_tokens: int, window: int, block_size: int) -> int:
    """The first block a step computing positions >= num_computed_tokens may read (every block before it lies
    wholly before the window of the step's first query, and so of every later query)."""
    return max(0, num_computed_tokens - window + 1) // block_size


def longest_window_hit(lookup: Callable[[int], object | None], num_blocks: int, window: int, block_size: int) -> int:
    """The most leading blocks h (<= num_blocks) of a sequence a windowed model can take from the cache, given
    `lookup(i)`, the cached block holding the sequence's block i (None: not cached). The hit needs blocks
    first_live_block(h * block_size) .. h - 1 cached; earlier ones may have been evicted. Scans from the right:
    the first run of cached blocks long enough for its own end is the longest hit."""
    run = 0
    for i in range(num_blocks - 1, -1, -1):
        if lookup(i) is None:
            run = 0
            continue
        run += 1
        if i <= first_live_block((i + run) * block_size, window, block_size):
            return i + run
    return 0


def window_blocks_bound(window: int | None, block_size: int, max_step_tokens: int) -> int | None:
    """The most blocks a request of a windowed model holds at once: a step of up to max_step_tokens tokens from
    p0 reads and writes positions p0 - window + 1 .. p0 + max_step_tokens - 1. None without a window."""
    if window is None:
        return None
    return -(-(window - 1 + max_step_tokens) // block_size) + 1
