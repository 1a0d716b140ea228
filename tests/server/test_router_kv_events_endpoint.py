"""GET /kv_events on the server (its app in process): a prompt's blocks are published with the hashes a
router computes from the same token ids; replay from a sequence number; off unless --kv-events-config."""
from __future__ import annotations

import pytest
from tests.helpers.server import in_process

from kvserve.kv_cache.block_hash import block_keys, hash_block_key

BLOCK = 16


@pytest.fixture(scope="module")
def server(tiny_llama):
    yield from in_process(tiny_llama[0], "--stats-interval", "0", "--kv-events-config",
                          '{"enable_kv_cache_events": true, "publisher": "zmq", "topic": "kv"}')


def test_a_prompts_blocks_are_published_with_the_routers_hashes(server):
    prompt = list(range(300, 300 + 3 * BLOCK + 5))
    with server.http() as http:
        start = http.get("/kv_events").json()["next"]
        assert http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}).status_code == 200
        answer = http.get("/kv_events", params={"since": start, "timeout": 5}).json()
        stored = [h for b in answer["batches"] for e in b["events"] if e["type"] == "BlockStored"
                  for h in e["block_hashes"]]
        expected = [hash_block_key(k) for k in block_keys(prompt, BLOCK)]
        assert stored[:3] == expected
        assert answer["block_size"] == BLOCK and answer["topic"] == "kv" and not answer["missed"]
        assert answer["next"] > start and all(b["seq"] >= start for b in answer["batches"])
        again = http.get("/kv_events", params={"since": answer["next"], "timeout": 0}).json()
        assert again["batches"] == [] and again["instance_id"] == answer["instance_id"]
        bad = http.get("/kv_events", params={"since": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "since"


def test_kv_events_are_off_by_default(tiny_llama):
    for srv in in_process(tiny_llama[0], "--stats-interval", "0"):
        with srv.http() as http:
            answer = http.get("/kv_events")
            assert answer.status_code == 404 and answer.json()["error"]["code"] == "kv_events_disabled"


def test_a_router_applying_every_event_knows_exactly_what_a_small_pool_holds(tiny_llama):
    """Under eviction pressure (a pool of 12 blocks), the hashes a router learns from /kv_events are exactly
    the blocks the engine's prefix cache holds: as many, and every prompt's stored hashes among them or
    removed since."""
    from kvserve.router.blocks import WorkerBlocks

    for srv in in_process(tiny_llama[0], "--stats-interval", "0", "--enable-debug-endpoints",
                          "--num-gpu-blocks-override", "12", "--kv-events-config", '{"enable_kv_cache_events": true}'):
        with srv.http() as http:
            view = WorkerBlocks()
            for i in range(6):
                prompt = [1000 + 50 * i + j for j in range(2 * BLOCK + 3)]
                assert http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}).status_code == 200
                view.apply(http.get("/kv_events", params={"since": view.next_seq}).json())
            stats = http.get("/debug/prefix-cache").json()
            assert stats["evictions"] > 0
            assert len(view.hashes) == stats["cached_blocks"]
            last = [hash_block_key(k) for k in block_keys([1000 + 250 + j for j in range(2 * BLOCK + 3)], BLOCK)]
            assert view.num_prefix_blocks(last, now=0.0) == 2
