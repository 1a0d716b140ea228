"""KV events from a real engine (tiny checkpoint, in process): with --kv-events-config each step's cache changes
are drained (Engine.last_kv_events); under a small pool evictions are reported, and the blocks stored less those
removed are, after every step, exactly the blocks the pool holds."""
from __future__ import annotations

from tests.helpers.engine import step_until_idle

from kvserve.config import EngineArgs
from kvserve.engine.engine import Engine
from kvserve.kv_cache.block_hash import hash_block_key
from kvserve.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvserve.sampling_params import SamplingParams


def test_stored_less_removed_is_what_the_pool_holds_after_every_step(tiny_llama):
    engine = Engine(EngineArgs(model=tiny_llama[0], num_gpu_blocks_override=10, block_size=4,
                               kv_events_config={"enable_kv_cache_events": True}))
    held: set[int] = set()
    removed: list[int] = []

    def apply(eng) -> None:
        for event in eng.last_kv_events:
            if isinstance(event, BlockStored):
                held.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                held.difference_update(event.block_hashes)
                removed.extend(event.block_hashes)
        assert held == {hash_block_key(k) for k in eng.block_pool.cached_keys()}

    for i in range(5):
        engine.add_request(str(i), [100 + 20 * i + j for j in range(13)], SamplingParams(max_tokens=2, temperature=0))
        step_until_idle(engine, after_step=apply)
    assert removed and held
    engine.scheduler.kv.reset_prefix_cache()
    assert engine.core.drain_kv_events() == [AllBlocksCleared()]


def test_no_events_unless_asked(tiny_llama):
    engine = Engine(EngineArgs(model=tiny_llama[0], num_gpu_blocks_override=16))
    engine.add_request("a", list(range(40)), SamplingParams(max_tokens=1, temperature=0))

    def check(eng) -> None:
        assert eng.last_kv_events == []

    step_until_idle(engine, after_step=check)
    assert engine.core.kv_events is None and engine.block_pool.num_cached_blocks > 0
