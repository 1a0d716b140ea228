"""Routing policies: which healthy worker gets a request.

    round_robin    in turn
    power_of_two   the less loaded of two picked at random
    cache_aware    SGLang's: the worker whose past requests share the longest prefix of this one's text
                   (router/tree.py), if it covers at least --cache-threshold of it; else the least loaded
    precise        the worker whose cache holds the most leading blocks of this prompt, from its own KV events
                   (router/blocks.py), hashed as the engine hashes them (kv_cache/block_hash.py)

Both cache policies keep affinity only within the balance window: when the loads are imbalanced (max - min >
--balance-abs-threshold and max > min x --balance-rel-threshold), or the preferred worker would be the outlier,
the least loaded worker gets the request instead, so one hot prefix cannot pile every request onto one worker.
"""
from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass, field

from kvserve.kv_cache.block_hash import block_keys, hash_block_key
from kvserve.router.blocks import WorkerBlocks
from kvserve.router.tree import PrefixTree
from kvserve.router.workers import Worker

POLICIES = ("round_robin", "power_of_two", "cache_aware", "precise")


@dataclass(frozen=True)
class RoutingKey:
    """What a request is routed on: the fully templated prompt (chat: every message, as the worker renders it)."""

    text: str
    token_ids: list[int] | None = None
    """The prompt's token ids as the worker will see them (None: the router has no tokenizer for it)."""
    cache_salt: str | None = None


@dataclass(frozen=True)
class BalanceRule:
    abs_threshold: int = 64
    rel_threshold: float = 1.5

    def outlier(self, load: int, min_load: int) -> bool:
        """A worker at `load` is past the balance window of the least loaded one."""
        return load - min_load > self.abs_threshold and load > min_load * self.rel_threshold

    def imbalanced(self, workers: list[Worker]) -> bool:
        loads = [w.load for w in workers]
        return self.outlier(max(loads), min(loads))


def least_loaded(workers: list[Worker], tie_break=None) -> Worker:
    """The least loaded worker; ties by `tie_break(worker)` (smaller first), then by position."""
    return min(workers, key=lambda w: (w.load, tie_break(w) if tie_break else 0))


class RoundRobin:
    def __init__(self):
        self._counter = itertools.count()

    def choose(self, key: RoutingKey, workers: list[Worker]) -> Worker:
        return workers[next(self._counter) % len(workers)]

    def forget(self, worker: Worker) -> None:
        pass


class PowerOfTwo:
    def __init__(self, rng: random.Random | None = None):
        self._rng = rng or random.Random()

    def choose(self, key: RoutingKey, workers: list[Worker]) -> Worker:
        if len(workers) == 1:
            return workers[0]
        a, b = self._rng.sample(workers, 2)
        return a if a.load <= b.load else b

    def forget(self, worker: Worker) -> None:
        pass


@dataclass
class CacheAware:
    cache_threshold: float = 0.3
    balance: BalanceRule = field(default_factory=BalanceRule)
    max_tree_size: int = 2 ** 26
    trees: dict[str, PrefixTree] = field(default_factory=dict)

    def choose(self, key: RoutingKey, workers: list[Worker]) -> Worker:
        trees = [self.trees.setdefault(w.url, PrefixTree()) for w in workers]
        fallback = least_loaded(workers, lambda w: self.trees[w.url].size)
        chosen = fallback
        if not self.balance.imbalanced(workers) and key.text:
            matches = [tree.match(key.text) for tree in trees]
            best = max(range(len(workers)), key=lambda i: (matches[i], -workers[i].load))
            if (matches[best] / len(key.text) >= self.cache_threshold
                    and not self.balance.outlier(workers[best].load, fallback.load)):
                chosen = workers[best]
        self.trees[chosen.url].insert(key.text)
        return chosen

    def evict(self) -> None:
        """Bound every tree to max_tree_size characters (the router runs this every --eviction-interval-secs)."""
        for tree in self.trees.values():
            tree.evict(self.max_tree_size)

    def forget(self, worker: Worker) -> None:
        """A worker left rotation: what it cached is gone (a restart) or unreachable."""
        self.trees.pop(worker.url, None)


@dataclass
class Precise:
    balance: BalanceRule = field(default_factory=BalanceRule)
    blocks: dict[str, WorkerBlocks] = field(default_factory=dict)
    """Per worker url: its cached block hashes, kept current by router/blocks.py's follow_events."""

    def prompt_hashes(self, key: RoutingKey, block_size: int) -> list[int]:
        if key.token_ids is None:
            return []
        return [hash_block_key(k) for k in block_keys(key.token_ids, block_size, key.cache_salt)]

    def choose(self, key: RoutingKey, workers: list[Worker]) -> Worker:
        now = time.monotonic()
        fallback = least_loaded(workers)
        hashes_by_size: dict[int, list[int]] = {}
        best, best_blocks = fallback, 0
        for worker in workers:
            blocks = self.blocks.get(worker.url)
            if blocks is None or blocks.block_size is None:
                continue
            size = blocks.block_size
            if size not in hashes_by_size:
                hashes_by_size[size] = self.prompt_hashes(key, size)
            n = blocks.num_prefix_blocks(hashes_by_size[size], now)
            if n > best_blocks or (n == best_blocks and n and worker.load < best.load):
                best, best_blocks = worker, n
        chosen = fallback
        if (best_blocks and not self.balance.imbalanced(workers)
                and not self.balance.outlier(best.load, fallback.load)):
            chosen = best
        blocks = self.blocks.get(chosen.url)
        if blocks is not None and blocks.block_size is not None:
            blocks.expect(hashes_by_size.get(blocks.block_size) or self.prompt_hashes(key, blocks.block_size), now)
        return chosen

    def forget(self, worker: Worker) -> None:
        blocks = self.blocks.get(worker.url)
        if blocks is not None:
            blocks.clear()
