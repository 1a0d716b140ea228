"""BlockPool: the one owner of KV block state (reference counts, free list, cached-block map).

Every block is in exactly one of three states:
  - in use:  ref_count > 0 (held by one or more request block tables);
  - cached:  ref_count == 0 and a block hash (its KV can be reused by a later request with the same prefix);
  - free:    ref_count == 0 and no hash.
Cached and free blocks both sit in one LRU queue; allocation takes from its front and evicts a cached
block's hash as it reuses it, so cached blocks live exactly until the pool needs them.

With a KVEventRecorder, every block that enters or leaves the cache is reported (kv_cache/events.py).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable

from kvserve.kv_cache.events import KVEventRecorder


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: Hashable | None = None


class BlockPool:
    def __init__(self, num_blocks: int, *, events: KVEventRecorder | None = None):
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # block_id -> block for every block with ref_count == 0, least recently released first.
        self._free_queue: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[Hashable, KVBlock] = {}
        self.num_evictions = 0
        self.events = events

    # ---- queries ------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free + evictable cached)."""
        return len(self._free_queue)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with a hash (in use or not)."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-unused blocks count as available)."""
        return 1.0 - len(self._free_queue) / self.num_blocks

    def lookup(self, block_hash: Hashable) -> KVBlock | None:
        return self._cached.get(block_hash)

    def cached_keys(self):
        return self._cached.keys()

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks no request or pin holds (the pool may reuse them at any time)."""
        return sum(1 for b in self._free_queue.values() if b.block_hash is not None)

    # ---- mutations ----------------------------------------------------------------------
    def allocate(self, n: int) -> list[KVBlock]:
        """Take n blocks from the LRU front, evicting their cached hashes. Pre: n <= num_free_blocks."""
        if n > len(self._free_queue):
            raise RuntimeError(f"asked for {n} blocks with {len(self._free_queue)} free")
        out = []
        for _ in range(n):
            _, block = self._free_queue.popitem(last=False)
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                if self.events is not None:
                    self.events.removed(block.block_hash)
                block.block_hash = None
                self.num_evictions += 1
            block.ref_count = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take one more reference on each block (a prefix-cache hit); a cached block leaves the free queue."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free_queue[block.block_id]
            block.ref_count += 1

    def release(self, blocks: list[KVBlock]) -> None:
        """Drop one reference on each block, in the given order; unreferenced blocks join the LRU tail.

        Callers pass a table's blocks tail first so that, among equally old blocks, the ends of
        sequences are evicted before the prefixes other requests are likelier to share.
        """
        for block in blocks:
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block.block_id} released with ref_count {block.ref_count}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free_queue[block.block_id] = block

    def cache(self, block: KVBlock, block_hash: Hashable) -> None:
        """Register a full, in-use block under its hash. A second block with the same content stays
        uncached (its twin already serves hits)."""
        if block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block
        if self.events is not None:
            self.events.stored(block_hash)

    def reset_cache(self) -> int:
        """Forget every unreferenced cached block; returns how many were dropped."""
        dropped = 0
        for block in self._free_queue.values():
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                if self.events is not None:
                    self.events.removed(block.block_hash)
                block.block_hash = None
                dropped += 1
        if dropped and not self._cached and self.events is not None:
            self.events.cleared()
        return dropped

    # ---- invariants ---------------------------------------------------------------------
    def counts(self) -> dict[str, int]:
        in_use = sum(1 for b in self.blocks if b.ref_count > 0)
        cached = sum(1 for b in self._free_queue.values() if b.block_hash is not None)
        return {"total": self.num_blocks, "in_use": in_use, "cached": cached,
                "free": len(self._free_queue) - cached}

    def check_invariants(self) -> None:
        """free + in use + cached == total; ref counts >= 0; queue and hash map agree with the blocks."""
        c = self.counts()
        assert c["free"] + c["in_use"] + c["cached"] == self.num_blocks, c
        for b in self.blocks:
            assert b.ref_count >= 0, f"block {b.block_id} has ref_count {b.ref_count}"
            assert (b.ref_count == 0) == (b.block_id in self._free_queue), f"block {b.block_id} queue state"
            if b.block_hash is not None:
                assert self._cached.get(b.block_hash) is b, f"block {b.block_id} hash map mismatch"
        assert all(blk.block_hash == h for h, blk in self._cached.items())
