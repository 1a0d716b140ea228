"""BlockPool and KVCacheManager: exact block ids, eviction order, prefix hits, invariants."""
from __future__ import annotations

import pytest

from kvserve.kv_cache.block_pool import BlockPool
from kvserve.kv_cache.manager import KVCacheManager
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams


def _req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), cache_salt=salt)


def _ids(blocks):
    return [b.block_id for b in blocks]


def test_pool_allocates_in_order_and_reuses_lru():
    pool = BlockPool(4)
    a = pool.allocate(2)
    assert _ids(a) == [0, 1]
    b = pool.allocate(1)
    assert _ids(b) == [2]
    pool.release(a[::-1])           # tail first: 1 then 0 join the queue after 3
    assert _ids(pool.allocate(3)) == [3, 1, 0]
    pool.check_invariants()
    with pytest.raises(RuntimeError):
        pool.allocate(1)


def test_pool_counts_free_used_cached():
    pool = BlockPool(5)
    blocks = pool.allocate(3)
    pool.cache(blocks[0], "h0")
    pool.cache(blocks[1], "h1")
    pool.release(blocks)
    assert pool.counts() == {"total": 5, "in_use": 0, "cached": 2, "free": 3}
    assert pool.lookup("h1") is blocks[1]
    pool.touch([blocks[1]])         # a hit takes it out of the free queue
    assert pool.counts() == {"total": 5, "in_use": 1, "cached": 1, "free": 3}
    pool.check_invariants()
    with pytest.raises(RuntimeError):
        pool.release([blocks[2]])   # ref_count would go below zero


def test_manager_prefix_hit_shares_full_blocks_only():
    pool = BlockPool(16)
    kv = KVCacheManager(pool, block_size=4, enable_prefix_caching=True)
    a = _req("a", list(range(10)))
    assert kv.allocate_slots(a, 10)
    assert kv.block_ids("a") == [0, 1, 2]
    a.num_computed_tokens = 10
    kv.cache_full_blocks(a)         # blocks 0 and 1 are full; 2 holds 2 tokens
    b = _req("b", list(range(8)) + [99, 98, 97])
    hits = kv.get_computed_blocks(b)
    assert _ids(hits) == [0, 1]
    b.num_computed_tokens = 8
    assert kv.allocate_slots(b, 3, hits)
    assert kv.block_ids("b") == [0, 1, 3]
    assert [blk.ref_count for blk in pool.blocks[:4]] == [2, 2, 1, 1]
    kv.check_invariants({"a": a, "b": b})
    # a prefix differing in its first token hits nothing
    assert kv.get_computed_blocks(_req("c", [7] + list(range(1, 10)))) == []
    # a hit never covers the last token: an exact 8-token repeat reuses one block, recomputes the rest
    assert _ids(kv.get_computed_blocks(_req("d", list(range(8))))) == [0]
    # a different salt (e.g. another adapter) shares nothing
    assert kv.get_computed_blocks(_req("e", list(range(10)), salt="x")) == []


def test_manager_evicts_unreferenced_cached_blocks_tail_first():
    pool = BlockPool(6)
    kv = KVCacheManager(pool, block_size=2, enable_prefix_caching=True)
    a = _req("a", [1, 2, 3, 4, 5, 6])
    assert kv.allocate_slots(a, 6)
    a.num_computed_tokens = 6
    kv.cache_full_blocks(a)
    kv.free(a)                       # [0,1,2] cached, evictable; freed tail first
    assert pool.counts()["cached"] == 3
    b = _req("b", [9, 9, 9, 9, 9, 9])
    assert kv.allocate_slots(b, 6)   # 3 never-used blocks first, then none evicted
    assert kv.block_ids("b") == [3, 4, 5]
    c = _req("c", [8, 8])
    assert kv.allocate_slots(c, 2)   # must evict: the tail of a's sequence goes first
    assert kv.block_ids("c") == [2]
    assert pool.lookup(((hash((hash((None, (1, 2), None)), (3, 4), None))), (5, 6), None)) is None
    assert _ids(kv.get_computed_blocks(_req("a2", [1, 2, 3, 4, 5, 6, 7]))) == [0, 1]
    kv.check_invariants({"b": b, "c": c})


def test_allocation_failure_changes_nothing():
    pool = BlockPool(3)
    kv = KVCacheManager(pool, block_size=4, enable_prefix_caching=False)
    a = _req("a", list(range(8)))
    assert kv.allocate_slots(a, 8)
    b = _req("b", list(range(20, 28)))
    assert not kv.allocate_slots(b, 8)
    assert kv.block_ids("b") == []
    assert pool.counts()["free"] == 1
    kv.check_invariants({"a": a})
