"""PinTable: explicit prompt caching with a TTL (Anthropic's `cache_control`).

A pin is one extra reference on a cached block, so the pool cannot evict it; it is dropped when its TTL
has passed since the block was last used (every prefix hit on it renews it). Pins count against the pool:
at most `max_blocks` blocks are pinned at once. Past that bound a new pin is simply not made (the request
still runs and its blocks stay cached as usual, evictable) — `pin` reports how many blocks it pinned.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from kvserve.kv_cache.block_pool import BlockPool, KVBlock


@dataclass
class _Pin:
    block: KVBlock
    ttl: float
    expires_at: float


class PinTable:
    def __init__(self, pool: BlockPool, max_blocks: int, clock: Callable[[], float] = time.monotonic):
        self.pool = pool
        self.max_blocks = max_blocks
        self.clock = clock
        self._pins: dict[int, _Pin] = {}  # block_id -> pin

    @property
    def num_pinned(self) -> int:
        return len(self._pins)

    @property
    def num_pin_only(self) -> int:
        """Pinned blocks that no request holds (the pin is their only reference)."""
        return sum(1 for pin in self._pins.values() if pin.block.ref_count == 1)

    def is_pinned(self, block: KVBlock) -> bool:
        return block.block_id in self._pins

    def pin(self, blocks: list[KVBlock], ttl: float) -> int:
        """Pin blocks (a prefix, in order) for `ttl` seconds from now; already pinned ones are renewed with
        the longer of the two TTLs. Stops at the bound. Returns the number of blocks pinned or renewed."""
        now = self.clock()
        done = 0
        for block in blocks:
            pin = self._pins.get(block.block_id)
            if pin is None:
                if len(self._pins) >= self.max_blocks:
                    break
                self.pool.touch([block])
                pin = self._pins[block.block_id] = _Pin(block, ttl, now + ttl)
            pin.ttl = max(pin.ttl, ttl)
            pin.expires_at = max(pin.expires_at, now + pin.ttl)
            done += 1
        return done

    def renew(self, blocks: list[KVBlock]) -> None:
        """A prefix hit used these blocks: their pins' TTLs restart now."""
        now = self.clock()
        for block in blocks:
            pin = self._pins.get(block.block_id)
            if pin is not None:
                pin.expires_at = now + pin.ttl

    def expire(self) -> int:
        """Drop the pins whose TTL has passed; returns how many were dropped."""
        now = self.clock()
        expired = [bid for bid, pin in self._pins.items() if pin.expires_at <= now]
        self._drop(expired)
        return len(expired)

    def release_oldest(self, num_blocks: int) -> int:
        """Drop up to num_blocks pins, soonest-expiring first (used only when a request could not run at
        all otherwise)."""
        order = sorted(self._pins, key=lambda bid: self._pins[bid].expires_at)[:num_blocks]
        self._drop(order)
        return len(order)

    def _drop(self, block_ids: list[int]) -> None:
        # NOTE: release leaves-last order doesn't matter here: each pin is one reference.
        for bid in block_ids:
            self.pool.release([self._pins.pop(bid).block])

    def holders(self) -> dict[int, int]:
        return {bid: 1 for bid in self._pins}
