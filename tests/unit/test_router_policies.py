"""The router's policies without a network: SGLang's balance rules and cache threshold, the prefix tree's
pruning, precise routing on block hashes learned from KV events (an eviction moves the request), health
thresholds, and routing keys built from the whole templated chat."""
from __future__ import annotations

import random

import pytest

from kvserve.kv_cache.block_hash import block_keys, hash_block_key
from kvserve.kv_cache.events import BlockRemoved, BlockStored, event_to_json
from kvserve.router.blocks import PENDING_TTL_S, WorkerBlocks
from kvserve.router.config import RouterConfig
from kvserve.router.keys import KeyMaker
from kvserve.router.policies import BalanceRule, CacheAware, PowerOfTwo, Precise, RoundRobin, RoutingKey
from kvserve.router.tree import PrefixTree
from kvserve.router.workers import HealthConfig, Worker, WorkerPool

BS = 4


def _workers(*loads: int) -> list[Worker]:
    return [Worker(f"http://w{i}", load=load) for i, load in enumerate(loads)]


# ---- balance rules ------------------------------------------------------------------------------
def test_imbalance_needs_both_the_absolute_and_the_relative_gap():
    rule = BalanceRule(abs_threshold=4, rel_threshold=1.5)
    assert not rule.imbalanced(_workers(10, 14))   # gap 4: not > 4
    assert not rule.imbalanced(_workers(10, 15))   # gap 5 but 15 <= 10 x 1.5
    assert rule.imbalanced(_workers(10, 16))       # gap 6 and 16 > 15
    assert rule.imbalanced(_workers(0, 5))


def test_cache_aware_follows_the_prefix_above_the_threshold_and_balances_below_it():
    policy = CacheAware(cache_threshold=0.5, balance=BalanceRule(4, 1.5))
    w = _workers(0, 0)
    prompt = "You are a helpful assistant. Question one?"
    assert policy.choose(RoutingKey(prompt), w) is w[0]           # equal loads: the first
    w[0].load = 2
    same_prefix = "You are a helpful assistant. Question two?"
    assert policy.choose(RoutingKey(same_prefix), w) is w[0]      # match ratio > 0.5, within the window
    other = "Translate into French: the cat sleeps."
    assert policy.choose(RoutingKey(other), w) is w[1]            # no match: the least loaded


def test_cache_aware_gives_up_affinity_outside_the_balance_window():
    policy = CacheAware(cache_threshold=0.1, balance=BalanceRule(4, 1.5))
    w = _workers(0, 0)
    prefix = "shared system prompt " * 5
    assert policy.choose(RoutingKey(prefix + "a"), w) is w[0]
    w[0].load = 10  # the matching worker is the outlier: a herd would form there
    assert policy.choose(RoutingKey(prefix + "b"), w) is w[1]
    other = "another long shared prompt " * 4
    policy.trees["http://w0"].insert(other + "x")
    w[0].load = 3   # inside the window: affinity, though w1 is idler
    assert policy.choose(RoutingKey(other + "y"), w) is w[0]


def test_cache_aware_routes_a_global_imbalance_to_the_least_loaded_even_on_a_match():
    policy = CacheAware(cache_threshold=0.1, balance=BalanceRule(2, 1.2))
    w = _workers(0, 0, 0)
    policy.choose(RoutingKey("prefix-x-1"), w)
    w[0].load, w[1].load, w[2].load = 1, 9, 5
    assert policy.choose(RoutingKey("prefix-x-2"), w) is w[0]  # w0 matches and is the least loaded anyway
    policy.trees["http://w2"].insert("prefix-y-0")
    assert policy.choose(RoutingKey("prefix-y-1"), w) is w[0]  # imbalanced: w2's match is ignored


def test_cache_aware_evicts_each_tree_to_max_tree_size_least_recent_first():
    policy = CacheAware(cache_threshold=0.5, max_tree_size=30)
    w = _workers(0)
    for text in ("a" * 20 + "old", "b" * 20 + "new"):
        policy.choose(RoutingKey(text), w)
    tree = policy.trees["http://w0"]
    assert tree.size == 46
    policy.evict()
    tree.check_invariants()
    assert tree.size <= 30
    assert tree.match("b" * 20 + "new") == 23 and tree.match("a" * 20 + "old") == 0


def test_a_dead_workers_tree_is_forgotten():
    policy = CacheAware()
    w = _workers(0, 0)
    policy.choose(RoutingKey("hello"), w)
    policy.forget(w[0])
    assert "http://w0" not in policy.trees


# ---- the prefix tree ----------------------------------------------------------------------------
def test_prefix_tree_shares_prefixes_and_matches_the_longest_one():
    tree = PrefixTree()
    tree.insert("hello world")
    tree.insert("hello there")
    tree.insert("help")
    tree.check_invariants()
    assert tree.size == len("hello world") + len("there") + len("p")
    assert tree.match("hello thermos") == len("hello ther")
    assert tree.match("hel") == 3 and tree.match("xyz") == 0 and tree.match("") == 0


def test_prefix_tree_random_inserts_keep_invariants_and_evict_to_bound():
    rng = random.Random(0)
    tree, texts = PrefixTree(), []
    for _ in range(200):
        text = "".join(rng.choice("ab") for _ in range(rng.randint(1, 12)))
        tree.insert(text)
        texts.append(text)
        tree.check_invariants()
    assert all(tree.match(t) == len(t) for t in texts)
    tree.evict(20)
    tree.check_invariants()
    assert tree.size <= 20
    assert tree.match(texts[-1]) == len(texts[-1])  # the most recent survives


# ---- precise -------------------------------------------------------------------------------------
def _answer(instance: str, nxt: int, *events, missed=False) -> dict:
    return {"instance_id": instance, "block_size": BS, "next": nxt, "missed": missed, "topic": "",
            "batches": [{"seq": nxt - 1, "timestamp": 0.0, "events": [event_to_json(e) for e in events]}]}


def _stored(tokens: list[int]) -> BlockStored:
    hashes = [hash_block_key(k) for k in block_keys(tokens, BS)]
    return BlockStored(hashes, None, tokens[:len(hashes) * BS], BS, None)


def test_precise_routes_to_the_worker_holding_the_longest_prefix_and_follows_its_evictions():
    policy = Precise(balance=BalanceRule(4, 1.5))
    w = _workers(0, 0)
    prompt = list(range(100, 113))  # 3 full blocks
    short = prompt[:4]
    policy.blocks = {"http://w0": WorkerBlocks(), "http://w1": WorkerBlocks()}
    policy.blocks["http://w0"].apply(_answer("i0", 1, _stored(short)))
    policy.blocks["http://w1"].apply(_answer("i1", 1, _stored(prompt[:12])))
    w[1].load = 2
    assert policy.choose(RoutingKey("", prompt), w) is w[1]       # 3 blocks beat 1, within the window
    removed = BlockRemoved([hash_block_key(k) for k in block_keys(prompt[:12], BS)])
    policy.blocks["http://w1"].apply(_answer("i1", 2, removed))
    policy.blocks["http://w1"].pending.clear()                      # what choose() expected has expired
    assert policy.choose(RoutingKey("", prompt), w) is w[0]       # w1 evicted it: the router knows


def test_precise_expects_a_dispatched_prompt_until_its_events_arrive():
    policy = Precise()
    w = _workers(0, 0)
    policy.blocks = {"http://w0": WorkerBlocks(block_size=BS), "http://w1": WorkerBlocks(block_size=BS)}
    prompt = list(range(20))
    first = policy.choose(RoutingKey("", prompt), w)
    first.load += 1  # in flight
    assert policy.choose(RoutingKey("", prompt + [1, 2]), w) is first  # the burst follows the first request
    blocks = policy.blocks[first.url]
    assert 0 < blocks.num_prefix_blocks([hash_block_key(k) for k in block_keys(prompt, BS)], 0.0)
    assert blocks.num_prefix_blocks([hash_block_key(k) for k in block_keys(prompt, BS)], PENDING_TTL_S * 1e6) == 0


def test_a_restarted_or_lagging_worker_voids_what_the_router_knew():
    blocks = WorkerBlocks()
    blocks.apply(_answer("i0", 1, _stored(list(range(8)))))
    assert len(blocks.hashes) == 2
    blocks.apply(_answer("i0-restarted", 1, _stored(list(range(50, 54)))))
    assert len(blocks.hashes) == 1
    blocks.apply(_answer("i0-restarted", 9, _stored(list(range(60, 64))), missed=True))
    assert blocks.hashes == {hash_block_key(block_keys(list(range(60, 64)), BS)[0])}


def test_precise_without_token_ids_balances_by_load():
    policy = Precise()
    w = _workers(3, 1)
    policy.blocks = {"http://w0": WorkerBlocks(block_size=BS)}
    assert policy.choose(RoutingKey("text only"), w) is w[1]


# ---- round robin, power of two -------------------------------------------------------------------
def test_round_robin_and_power_of_two():
    w = _workers(0, 0, 0)
    rr = RoundRobin()
    assert [rr.choose(RoutingKey(""), w) for _ in range(4)] == [w[0], w[1], w[2], w[0]]
    w[0].load, w[1].load, w[2].load = 5, 1, 9
    p2 = PowerOfTwo(random.Random(0))
    picks = [p2.choose(RoutingKey(""), w) for _ in range(50)]
    assert w[2] not in picks or all(p.load <= 9 for p in picks)
    assert all(p is not w[2] for p in picks)  # the most loaded of three never wins a pair


# ---- health --------------------------------------------------------------------------------------
def test_health_thresholds_take_a_worker_out_and_bring_it_back():
    pool = WorkerPool.of(["http://a/"], HealthConfig(failure_threshold=2, success_threshold=2))
    (worker,) = pool.workers
    downs = []
    pool.on_down.append(downs.append)
    assert worker.url == "http://a"
    pool.record(worker, False)
    assert worker.healthy
    pool.record(worker, False)
    assert not worker.healthy and downs == [worker] and pool.healthy() == []
    pool.record(worker, True)
    assert not worker.healthy
    pool.record(worker, True)
    assert worker.healthy


def test_load_counts_from_dispatch_until_the_end_once():
    pool = WorkerPool.of(["http://a"], HealthConfig())
    (worker,) = pool.workers
    end = pool.begin(worker)
    assert worker.load == 1
    end()
    end()
    assert worker.load == 0 and worker.num_requests_total == 1


# ---- routing keys and flags ----------------------------------------------------------------------
def test_chat_keys_cover_the_whole_templated_conversation(smollm2_path):
    from kvserve.model_loader.loader import ModelSource, load_tokenizer

    keys = KeyMaker(load_tokenizer(ModelSource.resolve(smollm2_path)))
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    a = keys.key("/v1/chat/completions", {"messages": first})
    b = keys.key("/v1/chat/completions", {"messages": [first[0], {"role": "user", "content": "Bye"}]})
    longer = keys.key("/v1/chat/completions", {"messages": first + [{"role": "assistant", "content": "Hello"},
                                                                   {"role": "user", "content": "More"}]})
    assert a.text != b.text and "Hi" in a.text and "<|im_start|>" in a.text
    assert a.token_ids is not None and a.token_ids != b.token_ids
    assert longer.text.startswith(a.text.rsplit("<|im_start|>assistant", 1)[0])
    assert keys.key("/v1/completions", {"prompt": [5, 6, 7]}).token_ids == [5, 6, 7]
    assert keys.key("/v1/chat/completions", {"messages": "junk"}) == RoutingKey("")


def test_router_flags_are_validated():
    with pytest.raises(ValueError, match="--worker"):
        RouterConfig()
    with pytest.raises(ValueError, match="http"):
        RouterConfig(worker=("localhost:8000",))
    with pytest.raises(ValueError, match="cache-threshold"):
        RouterConfig(worker=("http://a",), cache_threshold=2.0)
    with pytest.raises(ValueError, match="balance-rel-threshold"):
        RouterConfig(worker=("http://a",), balance_rel_threshold=0.5)
    assert RouterConfig(worker=("http://a",)).policy == "cache_aware"


def test_the_event_follower_sends_the_key_and_applies_answers_after_a_refusal():
    import asyncio

    import httpx

    from kvserve.router.blocks import follow_events

    answers = [httpx.Response(401, json={"error": {"message": "bad key"}}),
               httpx.Response(200, json=_answer("i0", 1, _stored(list(range(8)))))]
    seen_headers = []

    async def handler(request: httpx.Request) -> httpx.Response:
        seen_headers.append(request.headers.get("authorization"))
        await asyncio.sleep(0.01)  # as a long poll waits: an instant answer would never yield to the loop
        return answers.pop(0) if answers else httpx.Response(200, json=_answer("i0", 1))

    async def run() -> WorkerBlocks:
        blocks = WorkerBlocks()
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            task = asyncio.create_task(follow_events("http://w0", blocks, client, 0.01, {"Authorization": "Bearer k"}))
            while len(blocks.hashes) < 2:
                await asyncio.sleep(0.01)
            task.cancel()
        return blocks

    blocks = asyncio.run(asyncio.wait_for(run(), 10))
    assert blocks.next_seq >= 1 and seen_headers[0] == "Bearer k"
