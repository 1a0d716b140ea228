"""The router's rules at their edges, without a network: each balance threshold alone never breaks affinity (SGLang
needs both), the prefix tree's pruning keeps the most recent texts (and runs every --eviction-interval-secs in the
app), and precise routing follows BlockStored / BlockRemoved / AllBlocksCleared sequences as a worker's cache
changes, forgetting what it expected once that expires."""
from __future__ import annotations

import time

import httpx
import pytest
from fastapi.testclient import TestClient

from kvserve.kv_cache.block_hash import block_keys, hash_block_key
from kvserve.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, event_to_json
from kvserve.router.app import build_router_app
from kvserve.router.blocks import PENDING_TTL_S, WorkerBlocks
from kvserve.router.config import RouterConfig
from kvserve.router.policies import BalanceRule, CacheAware, Precise, RoutingKey
from kvserve.router.tree import PrefixTree
from kvserve.router.workers import Worker

BS = 4


def _workers(*loads: int) -> list[Worker]:
    return [Worker(f"http://w{i}", load=load) for i, load in enumerate(loads)]


# ---- balance rules ------------------------------------------------------------------------------
@pytest.mark.parametrize("loads, imbalanced", [
    ((0, 3), False),      # gap 3 = abs: not past it (and 3 > 0 x 1.5)
    ((0, 4), True),       # gap 4 > 3 and 4 > 0
    ((10, 14), False),    # gap 4 > 3 but 14 < 15: the relative threshold holds it
    ((10, 15), False),    # 15 = 10 x 1.5: not past it
    ((10, 16), True),
    ((20, 29), False),    # gap 9, ratio 1.45
    ((5, 5, 9), True),    # the most and the least loaded of three decide
    ((9,), False),        # one worker is never imbalanced
])
def test_imbalance_is_past_both_thresholds(loads, imbalanced):
    assert BalanceRule(abs_threshold=3, rel_threshold=1.5).imbalanced(_workers(*loads)) is imbalanced


def test_outlier_compares_one_worker_with_the_least_loaded():
    rule = BalanceRule(abs_threshold=2, rel_threshold=2.0)
    assert not rule.outlier(2, 0) and rule.outlier(3, 0)
    assert not rule.outlier(8, 4) and rule.outlier(9, 4)
    assert not rule.outlier(4, 4)


@pytest.mark.parametrize("make", [
    lambda: CacheAware(cache_threshold=0.2, balance=BalanceRule(abs_threshold=3, rel_threshold=1.5)),
    lambda: Precise(balance=BalanceRule(abs_threshold=3, rel_threshold=1.5)),
])
def test_affinity_holds_until_both_thresholds_are_past(make):
    policy = make()
    w = _workers(0, 0)
    tokens = list(range(40))
    key = RoutingKey("".join(f"{t}," for t in tokens), tokens)
    if isinstance(policy, Precise):
        policy.blocks = {w[0].url: WorkerBlocks(block_size=BS), w[1].url: WorkerBlocks(block_size=BS)}
        policy.blocks[w[0].url].apply(_answer("i0", 1, _stored(tokens)))
    else:
        policy.trees[w[0].url] = PrefixTree()
        policy.trees[w[0].url].insert(key.text)
    for loads, expected in (((3, 0), 0),     # gap 3: not past abs
                            ((14, 10), 0),   # gap 4 but ratio 1.4
                            ((4, 0), 1),     # past both: the least loaded
                            ((16, 10), 1)):
        w[0].load, w[1].load = loads
        assert policy.choose(key, w) is w[expected], loads


# ---- the prefix tree's pruning --------------------------------------------------------------------
def test_pruning_keeps_the_shared_stem_of_a_surviving_text():
    tree = PrefixTree()
    tree.insert("system prompt: old question")
    tree.insert("system prompt: new question")
    tree.insert("unrelated text")
    tree.insert("system prompt: new question")  # most recent
    dropped = tree.evict(len("system prompt: new question"))
    tree.check_invariants()
    assert dropped == len("old question") + len("unrelated text")
    assert tree.match("system prompt: new question") == len("system prompt: new question")
    assert tree.match("system prompt: old question") == len("system prompt: ")
    assert tree.match("unrelated text") == 0


def test_pruning_under_the_bound_changes_nothing_and_a_pruned_tree_takes_new_texts():
    tree = PrefixTree()
    tree.insert("abcdef")
    assert tree.evict(6) == 0 and tree.size == 6
    assert tree.evict(0) == 6 and tree.size == 0 and tree.match("abcdef") == 0
    tree.insert("abcxyz")
    tree.insert("abc")
    tree.check_invariants()
    assert tree.size == 6 and tree.match("abcdef") == 3
    tree.evict(3)  # "xyz" is the least recent leaf; "abc" was just touched
    tree.check_invariants()
    assert tree.size == 3 and tree.match("abc") == 3


class _Workers:
    """Two workers that answer every request (an httpx transport)."""

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m", "root": "/nowhere/model"}]})
        return httpx.Response(200, json={"choices": [{"text": request.url.host, "finish_reason": "length"}]})


def _tree_sizes(client: TestClient) -> list[int]:
    return [tree.size for tree in client.app.state.router.routes[0].policy.trees.values()]


@pytest.mark.parametrize("interval, pruned", [(0.05, True), (3600.0, False)])
def test_the_app_prunes_its_trees_every_eviction_interval(interval, pruned):
    config = RouterConfig(worker=("http://w0", "http://w1"), policy="cache_aware", max_tree_size=40,
                          eviction_interval_secs=interval)
    with TestClient(build_router_app(config, transport=httpx.MockTransport(_Workers()))) as client:
        for i in range(6):
            prompt = f"request number {i} with a text of its own, long enough"
            assert client.post("/v1/completions", json={"prompt": prompt}).status_code == 200
        deadline = time.monotonic() + 5
        while pruned and max(_tree_sizes(client)) > 40 and time.monotonic() < deadline:
            time.sleep(0.02)
        if pruned:
            assert max(_tree_sizes(client)) <= 40
        else:
            time.sleep(0.2)
            assert max(_tree_sizes(client)) > 40


# ---- precise: event sequences ---------------------------------------------------------------------
def _answer(instance: str, nxt: int, *events, missed=False) -> dict:
    return {"instance_id": instance, "block_size": BS, "next": nxt, "missed": missed, "topic": "",
            "batches": [{"seq": nxt - 1, "timestamp": 0.0, "events": [event_to_json(e) for e in events]}]}


def _hashes(tokens: list[int]) -> list[int]:
    return [hash_block_key(k) for k in block_keys(tokens, BS)]


def _stored(tokens: list[int]) -> BlockStored:
    hashes = _hashes(tokens)
    return BlockStored(hashes, None, tokens[:len(hashes) * BS], BS, None)


def test_a_removed_middle_block_ends_the_prefix_there():
    blocks = WorkerBlocks()
    prompt = list(range(16))
    blocks.apply(_answer("i0", 1, _stored(prompt)))
    assert blocks.num_prefix_blocks(_hashes(prompt), 0.0) == 4
    blocks.apply(_answer("i0", 2, BlockRemoved([_hashes(prompt)[2]])))
    assert blocks.num_prefix_blocks(_hashes(prompt), 0.0) == 2


def test_events_apply_in_order_within_an_answer():
    blocks = WorkerBlocks()
    a, b = list(range(8)), list(range(100, 108))
    answer = _answer("i0", 3, _stored(a), AllBlocksCleared(), _stored(b))
    answer["batches"].append({"seq": 3, "timestamp": 0.0, "events": [event_to_json(BlockRemoved(_hashes(b)[1:]))]})
    blocks.apply(answer)
    assert blocks.hashes == {_hashes(b)[0]}


def test_precise_follows_a_workers_stores_evictions_and_clears():
    policy = Precise(balance=BalanceRule(abs_threshold=8, rel_threshold=2.0))
    w = _workers(0, 0)
    policy.blocks = {w[0].url: WorkerBlocks(), w[1].url: WorkerBlocks()}
    prompt = list(range(24))
    key = RoutingKey("", prompt + [7])
    policy.blocks[w[1].url].apply(_answer("i1", 1, _stored(prompt)))
    policy.blocks[w[0].url].apply(_answer("i0", 1, _stored(prompt[:8])))
    w[1].load = 1
    assert policy.choose(key, w) is w[1]                       # 6 blocks beat 2, the load is inside the window
    policy.blocks[w[1].url].pending.clear()
    policy.blocks[w[1].url].apply(_answer("i1", 2, BlockRemoved(_hashes(prompt)[1:])))
    assert policy.choose(key, w) is w[0]                       # now 1 block against 2
    policy.blocks[w[0].url].pending.clear()
    policy.blocks[w[0].url].apply(_answer("i0", 2, AllBlocksCleared()))
    assert policy.choose(key, w) is w[1]                       # w0 holds nothing; w1 still its first block
    policy.blocks[w[1].url].pending.clear()
    policy.blocks[w[1].url].apply(_answer("i1", 3, AllBlocksCleared()))
    w[0].load, w[1].load = 2, 1
    assert policy.choose(key, w) is w[1]                       # nothing cached anywhere: the least loaded


def test_a_stored_event_settles_what_was_expected_and_expectations_expire():
    blocks = WorkerBlocks(block_size=BS)
    prompt = list(range(12))
    blocks.expect(_hashes(prompt), now=0.0)
    assert blocks.num_prefix_blocks(_hashes(prompt), now=1.0) == 3
    blocks.apply(_answer("i0", 1, _stored(prompt[:8])))
    assert set(blocks.pending) == {_hashes(prompt)[2]}
    assert blocks.num_prefix_blocks(_hashes(prompt), now=PENDING_TTL_S + 1) == 2


def test_expectations_that_never_come_true_do_not_pile_up():
    """A request whose blocks never reach the cache (aborted, or tokenized otherwise by the worker) must not
    leave its hashes in the router forever."""
    blocks = WorkerBlocks(block_size=BS)
    for i in range(1000):
        blocks.expect(_hashes(list(range(i * 8, i * 8 + 8))), now=float(i))
    assert len(blocks.pending) <= 2 * (PENDING_TTL_S + 1) * 2
