"""KV events (kv_cache/events.py): what the BlockPool reports as blocks enter and leave the prefix cache, the
event log /kv_events serves, and block hashes that are the same in every process (what the router relies on)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvserve.config.kv_events import KVEventsConfig
from kvserve.kv_cache.block_hash import block_keys, hash_block_key
from kvserve.kv_cache.block_pool import BlockPool
from kvserve.kv_cache.events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventLog, KVEventRecorder,
                                     event_from_json, event_to_json)
from kvserve.kv_cache.manager import KVCacheManager
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams

BS = 4


def _pool(num_blocks: int) -> tuple[BlockPool, KVEventRecorder]:
    recorder = KVEventRecorder(BS)
    return BlockPool(num_blocks, events=recorder), recorder


def _run(kv: KVCacheManager, req_id: str, tokens: list[int]) -> Request:
    """Admit a request, compute its whole prompt, cache its full blocks and finish it."""
    req = Request(req_id, tokens, SamplingParams(max_tokens=1))
    hits = kv.get_computed_blocks(req)
    req.num_computed_tokens = len(hits) * BS
    assert kv.allocate_slots(req, len(tokens) - req.num_computed_tokens, hits)
    req.num_computed_tokens = len(tokens)
    kv.cache_full_blocks(req)
    kv.free(req)
    return req


def test_stored_blocks_of_one_prompt_are_one_event_chained_by_hash():
    pool, rec = _pool(8)
    kv = KVCacheManager(pool, BS, enable_prefix_caching=True)
    tokens = list(range(10))  # two full blocks and a partial one
    _run(kv, "a", tokens)
    (event,) = rec.drain()
    keys = block_keys(tokens, BS)
    assert event == BlockStored([hash_block_key(k) for k in keys], None, tokens[:8], BS, None)
    assert keys[1][0] == event.block_hashes[0]  # the engine's own chain: a key holds its parent's hash
    assert rec.drain() == []
    pool.check_invariants()


def test_eviction_reports_the_removed_hashes_and_a_shared_prefix_is_stored_once():
    pool, rec = _pool(3)
    kv = KVCacheManager(pool, BS, enable_prefix_caching=True)
    _run(kv, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])          # caches 2 blocks, uses 3
    rec.drain()
    _run(kv, "b", [1, 2, 3, 4, 50, 60, 70, 80, 90])     # hits block 0; its new blocks evict a's
    events = rec.drain()
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    stored = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
    a_keys = block_keys([1, 2, 3, 4, 5, 6, 7, 8], BS)
    b_keys = block_keys([1, 2, 3, 4, 50, 60, 70, 80], BS)
    assert hash_block_key(a_keys[1]) in removed and hash_block_key(a_keys[0]) not in removed
    assert stored == [hash_block_key(b_keys[1])]
    assert [e for e in events if isinstance(e, BlockStored)][0].parent_block_hash == hash_block_key(b_keys[0])
    pool.check_invariants()


def test_reset_of_the_whole_cache_is_all_blocks_cleared():
    pool, rec = _pool(8)
    kv = KVCacheManager(pool, BS, enable_prefix_caching=True)
    _run(kv, "a", list(range(9)))
    rec.drain()
    assert kv.reset_prefix_cache() == 2
    assert rec.drain() == [AllBlocksCleared()]
    assert pool.num_cached_blocks == 0


def test_a_pool_without_a_recorder_reports_nothing_and_behaves_the_same():
    pool = BlockPool(4)
    kv = KVCacheManager(pool, BS, enable_prefix_caching=True)
    _run(kv, "a", list(range(9)))
    assert pool.num_cached_blocks == 2 and pool.events is None


def test_adapter_blocks_carry_the_lora_id():
    rec = KVEventRecorder(BS)
    key = (None, (1, 2, 3, 4), (None, 7))
    rec.stored(key)
    (event,) = rec.drain()
    assert event.lora_id == 7 and event.block_hashes == [hash_block_key(key)]


def test_events_round_trip_through_json():
    for event in (BlockStored([1, 2], None, [1] * 8, 4, None), BlockRemoved([3]), AllBlocksCleared()):
        assert event_from_json(event_to_json(event)) == event
    with pytest.raises(ValueError, match="unknown KV event type"):
        event_from_json({"type": "Nope"})


def test_the_log_replays_from_a_sequence_number_and_says_when_batches_were_dropped():
    log = KVEventLog(max_batches=2)
    for i in range(3):
        log.append([BlockRemoved([i])], timestamp=float(i))
    log.append([], timestamp=9.0)  # an empty step is no batch
    assert log.next_seq == 3
    batches, missed = log.since(1)
    assert [b.seq for b in batches] == [1, 2] and not missed
    batches, missed = log.since(0)
    assert [b.seq for b in batches] == [1, 2] and missed
    assert log.since(3) == ([], False)


def test_block_hashes_are_the_same_in_another_process():
    """Python's hash() of None and str changes from process to process; block hashes must not."""
    code = ("from kvserve.kv_cache.block_hash import block_keys, hash_block_key;"
            "print([hash_block_key(k) for k in block_keys(list(range(12)), 4, 'salt')]);"
            "print([hash_block_key(k) for k in block_keys(list(range(12)), 4, None)])")
    env = {**os.environ, "PYTHONHASHSEED": "random"}
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
            for _ in range(2)}
    here = (f"{[hash_block_key(k) for k in block_keys(list(range(12)), 4, 'salt')]}\n"
            f"{[hash_block_key(k) for k in block_keys(list(range(12)), 4, None)]}\n")
    assert outs == {here}


def test_kv_events_config_takes_vllm_keys_and_refuses_unknown_ones():
    config = KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "zmq", '
                                  '"endpoint": "tcp://*:5557", "topic": "kv"}')
    assert config.enabled and config.topic == "kv"
    assert not KVEventsConfig.parse({"enable_kv_cache_events": True, "publisher": "null"}).enabled
    assert not KVEventsConfig.parse({}).enabled
    with pytest.raises(ValueError, match="unknown kv_events_config key"):
        KVEventsConfig.parse('{"enable_kv_cache_events": true, "bogus": 1}')
    with pytest.raises(ValueError, match="publisher"):
        KVEventsConfig.parse({"publisher": "kafka"})
    with pytest.raises(ValueError, match="JSON object"):
        KVEventsConfig.parse("{not json")
