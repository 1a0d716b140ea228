"""KVCacheManager with a sliding window on every layer: blocks before a running request's window are released,
prefix hits need only the window's blocks; exact block ids, invariants after every change."""
from __future__ import annotations

import pytest

from kvserve.kv_cache.block_pool import BlockPool
from kvserve.kv_cache.manager import KVCacheManager
from kvserve.kv_cache.window import first_live_block, longest_window_hit
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams

BS, W = 4, 8
NULL = 32  # the null block of a 32-block pool: the cache's block past the pool's


def _req(rid: str, tokens: list[int], **kw) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=64), **kw)


def _manager(num_blocks: int = 32, caching: bool = True, window: int | None = W, **kw) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks), BS, caching, sliding_window=window, **kw)


def _compute(kv: KVCacheManager, req: Request, num_new: int, reqs: dict) -> None:
    """One step of `req` computing num_new tokens, as the scheduler drives it, invariants after it."""
    assert kv.allocate_slots(req, num_new)
    req.num_computed_tokens += num_new
    kv.cache_full_blocks(req)
    kv.check_invariants(reqs)


def _run_prompt(kv: KVCacheManager, req: Request, chunk: int) -> None:
    reqs = {req.request_id: req}
    while req.num_computed_tokens < req.num_tokens:
        _compute(kv, req, min(chunk, req.num_tokens - req.num_computed_tokens), reqs)


def test_first_live_block_is_the_first_block_the_window_reads():
    # A query at p reads (p - W, p]: with W 8, position 12 reads 5..12, so block 1 (4..7) on.
    assert [first_live_block(p, W, BS) for p in (0, 7, 8, 11, 12, 15, 16)] == [0, 0, 0, 1, 1, 2, 2]
    assert first_live_block(100, 1, BS) == 25


def _window_hit(found: list) -> int:
    return longest_window_hit(found.__getitem__, len(found), W, BS)


def test_longest_window_hit_needs_only_the_blocks_before_its_end():
    hit = object()
    # Blocks 0-1 evicted, 2-5 cached: h = 6 needs blocks first_live(24) = 4 .. 5.
    assert _window_hit([None, None, hit, hit, hit, hit]) == 6
    # Block 4 missing: h = 6 fails; h = 4 needs blocks 2..3 (cached).
    assert _window_hit([None, None, hit, hit, None, hit]) == 4
    # One cached block is too few for any end past the first window.
    assert _window_hit([None, hit, None, hit]) == 0
    # A run from block 0 is a hit whatever its length.
    assert _window_hit([hit, None, None]) == 1
    assert _window_hit([]) == 0


def test_running_request_holds_a_bounded_number_of_blocks():
    kv = _manager()
    req = _req("a", list(range(64)))
    reqs = {"a": req}
    held = []
    while req.num_computed_tokens < 64:
        _compute(kv, req, 4, reqs)
        held.append(kv.num_live_blocks("a"))
    # Each step reads its own block and the two before (W 8 = 2 blocks): never more than 3 held.
    assert max(held) == 3 and kv.num_blocks_held("a") == 16
    ids = kv.block_ids("a")
    assert ids[:13] == [NULL] * 13 and NULL not in ids[13:]
    # Released blocks stay cached (evictable), oldest released first in the LRU queue.
    assert kv.pool.counts() == {"total": 32, "in_use": 3, "cached": 13, "free": 16}
    kv.free(req)
    kv.check_invariants({})
    assert kv.num_request_blocks == 0
    assert kv.pool.counts()["in_use"] == 0


def test_released_blocks_go_back_free_without_caching():
    kv = _manager(caching=False)
    req = _req("a", list(range(40)))
    _run_prompt(kv, req, 8)
    assert kv.num_live_blocks("a") <= 4
    assert kv.pool.counts()["cached"] == 0
    assert kv.pool.num_free_blocks == 32 - kv.num_live_blocks("a")


def test_a_long_request_runs_in_a_pool_smaller_than_it():
    kv = _manager(num_blocks=4)
    req = _req("a", list(range(100)))
    _run_prompt(kv, req, 4)
    assert kv.num_blocks_held("a") == 25 and kv.num_live_blocks("a") == 3


def test_prefill_chunk_keeps_the_window_of_its_first_query():
    kv = _manager()
    req = _req("a", list(range(40)))
    _compute(kv, req, 20, {"a": req})
    # The next chunk starts at 20: it reads 13.. (block 3) on; blocks 0-2 go.
    assert kv.allocate_slots(req, 12)
    assert kv.block_ids("a")[:4] == [NULL, NULL, NULL, 3]
    kv.check_invariants({"a": req})


def test_full_attention_manager_has_no_null_block():
    kv = _manager(window=None)
    req = _req("a", list(range(40)))
    _run_prompt(kv, req, 4)
    assert kv.null_block is None and kv.num_live_blocks("a") == kv.num_blocks_held("a") == 10


def _finish_cached_prompt(kv: KVCacheManager, tokens: list[int]) -> None:
    req = _req("first", tokens)
    _run_prompt(kv, req, 4)
    kv.free(req)
    kv.check_invariants({})


def test_prefix_hit_with_early_blocks_evicted():
    kv = _manager(num_blocks=12)
    prompt = list(range(40))
    _finish_cached_prompt(kv, prompt)
    # Fill the pool with another request: the oldest released blocks (the prompt's first ones) are evicted.
    other = _req("other", [1000 + i for i in range(20)])
    assert kv.allocate_slots(other, 20)
    kv.free(other)
    second = _req("second", prompt + [7, 7, 7])
    hits = kv.get_computed_blocks(second)
    # Full attention would need block 0 cached: no hit. The window needs blocks 8-9 for a hit of 10 blocks.
    assert kv.pool.lookup(kv._block_keys(second, 10)[0]) is None
    assert len(hits) == 10 and hits[:8] == [kv.null_block] * 8
    assert kv.explain(second.prompt_token_ids).num_hit_tokens == 40
    second.num_computed_tokens = 40
    assert kv.allocate_slots(second, 3, hits)
    assert kv.num_live_blocks("second") == 3
    kv.check_invariants({"second": second})
    second.num_computed_tokens = 43
    kv.cache_full_blocks(second)
    kv.free(second)
    kv.check_invariants({})
    assert kv.pool.counts()["in_use"] == 0


def _evict(pool: BlockPool, block) -> None:
    """Evict one unreferenced cached block: every other unreferenced block goes behind it in the LRU queue (a hit
    and its release), then one allocation takes it."""
    others = [b for b in pool.blocks if b.ref_count == 0 and b is not block]
    for other in others:
        pool.touch([other])
        pool.release([other])
    taken = pool.allocate(1)
    assert taken == [block] and block.block_hash is None
    pool.release(taken)
    pool.check_invariants()


def test_prefix_hit_stops_before_a_missing_window_block():
    kv = _manager()
    prompt = list(range(40))
    _finish_cached_prompt(kv, prompt)
    keys = kv._block_keys(_req("x", prompt), 10)
    _evict(kv.pool, kv.pool.lookup(keys[8]))
    hits = kv.get_computed_blocks(_req("second", prompt + [1]))
    # h = 10 needs blocks 8-9; h = 8 needs blocks 6-7: cached.
    assert len(hits) == 8 and hits[:6] == [kv.null_block] * 6 and None not in hits


def test_rollback_after_rejected_drafts_keeps_released_entries():
    kv = _manager()
    req = _req("a", list(range(30)))
    _run_prompt(kv, req, 8)
    reqs = {"a": req}
    # A verification step: 1 token + 5 drafts, 2 drafts accepted.
    assert kv.allocate_slots(req, 6)
    held = kv.num_blocks_held("a")
    req.num_computed_tokens += 3
    assert kv.free_tail(req) == held - (-(-req.num_computed_tokens // BS))
    kv.check_invariants(reqs)
    ids = kv.block_ids("a")
    assert ids[:first_live_block(30, W, BS)] == [NULL] * first_live_block(30, W, BS)
    assert NULL not in ids[first_live_block(30, W, BS):]


def test_preempted_request_comes_back_through_its_window_hit():
    kv = _manager()
    req = _req("a", list(range(30)))
    _run_prompt(kv, req, 4)
    kv.free(req, finished=False)   # preempted: all its blocks go back, the cached ones stay cached
    req.num_computed_tokens = 0
    kv.check_invariants({"a": req})
    assert kv.pool.counts()["in_use"] == 0
    hits = kv.get_computed_blocks(req)
    # 7 blocks (28 tokens, the last never: it is recomputed); position 28 reads 21.. (block 5) on.
    assert len(hits) == 7 and hits[:5] == [kv.null_block] * 5 and None not in hits
    req.num_computed_tokens = 28
    assert kv.allocate_slots(req, 2, hits)
    kv.check_invariants({"a": req})
    assert kv.num_live_blocks("a") == 3


def test_pin_prefix_pins_only_blocks_still_held():
    now = [0.0]
    kv = _manager(clock=lambda: now[0])
    req = _req("a", list(range(40)))
    _run_prompt(kv, req, 4)
    pinned = kv.pin_prefix(req, 40, ttl=60.0)
    # The last step (from 36) read from 29 (block 7) on: blocks 0-6 were released, 7-9 are pinned, and a hit
    # on the 40 tokens needs 8-9 (position 40 reads 33..).
    assert pinned == 40 and kv.pins.num_pinned == 3
    kv.free(req)
    kv.check_invariants({})
    assert kv.num_request_blocks == 0 and kv.pins.num_pinned == 3
    again = _req("again", list(range(40)) + [1])
    hits = kv.get_computed_blocks(again)
    assert len(hits) == 10 and all(kv.pins.is_pinned(b) for b in hits[8:])


def test_pin_bound_reports_the_tokens_its_blocks_keep():
    kv = _manager(max_pinned_blocks=2)
    req = _req("a", list(range(40)))
    _run_prompt(kv, req, 4)
    # Blocks 7 and 8 pinned: a hit of 36 tokens needs blocks 7-8 (position 36 reads 29..).
    assert kv.pin_prefix(req, 40, ttl=60.0) == 36
    kv.check_invariants({"a": req})


def test_salts_keep_windowed_hits_apart():
    kv = _manager()
    _finish_cached_prompt(kv, list(range(40)))
    assert len(kv.get_computed_blocks(_req("plain", list(range(41))))) == 10
    assert kv.get_computed_blocks(_req("salted", list(range(41)), cache_salt="s")) == []


@pytest.mark.parametrize("chunk", [1, 3, 4, 9])
def test_every_chunking_keeps_invariants_and_frees_all(chunk):
    kv = _manager(num_blocks=10, window=6)  # 5 blocks each at most: 5 + 9 positions
    a, b = _req("a", list(range(50))), _req("b", list(range(50)))
    reqs = {"a": a, "b": b}
    while a.num_computed_tokens < 50:
        for req in (a, b):
            _compute(kv, req, min(chunk, 50 - req.num_computed_tokens), reqs)
    for req in (a, b):
        kv.free(req)
    kv.check_invariants({})
    assert kv.pool.counts()["in_use"] == 0
    kv.reset_prefix_cache()
    assert kv.pool.counts()["free"] == 10


def test_admission_counts_a_windowed_request_by_its_bound():
    from kvserve.engine.core import EngineInfo
    from kvserve.engine.processor import Processor
    from kvserve.kv_cache.window import window_blocks_bound

    # W 8, steps of up to 8 tokens from p0: positions p0 - 7 .. p0 + 7, 15 of them: 5 blocks of 4 at most.
    assert window_blocks_bound(8, BS, 8) == 5 and window_blocks_bound(None, BS, 8) is None
    info = dict(max_model_len=512, vocab_size=16, max_num_seqs=4, num_kv_blocks=6, block_size=BS, max_logprobs=5,
                enable_prefix_caching=True)
    params = SamplingParams(max_tokens=100)
    Processor(None, EngineInfo("m", **info, max_blocks_per_request=5), ()).validate([1] * 200, params)
    with pytest.raises(ValueError, match="needs 75 KV blocks"):
        Processor(None, EngineInfo("m", **info), ()).validate([1] * 200, params)
    with pytest.raises(ValueError, match="needs 7 KV blocks"):
        Processor(None, EngineInfo("m", **info, max_blocks_per_request=7), ()).validate([1] * 200, params)


def test_blocks_are_released_only_when_every_layer_is_windowed():
    from types import SimpleNamespace

    import transformers as tf

    from kvserve.config.engine import EngineConfig
    from kvserve.model_loader.architectures import block_release_window

    small = dict(num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    mistral = tf.MistralConfig(**small, sliding_window=10)
    assert block_release_window(mistral) == 10
    assert block_release_window(tf.MistralConfig(**small, sliding_window=None)) is None
    # max_window_layers 1: layer 0 attends to everything, so it reads every block.
    assert block_release_window(tf.Qwen2Config(**small, use_sliding_window=True, sliding_window=10,
                                               max_window_layers=1)) is None
    assert block_release_window(tf.Qwen2Config(**small, use_sliding_window=False, sliding_window=10)) is None
    # A draft model reads the target's blocks from where it last stopped: nothing is released.
    window = EngineConfig.kv_release_window.fget
    assert window(SimpleNamespace(model=SimpleNamespace(hf_config=mistral), draft_model=None)) == 10
    assert window(SimpleNamespace(model=SimpleNamespace(hf_config=mistral), draft_model=object())) is None
