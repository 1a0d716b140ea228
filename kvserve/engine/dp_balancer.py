"""Which data-parallel engine gets a request: the one that served its prompt's prefix recently, while the loads
stay within the balance window; otherwise the least loaded one.

Three ways such a balancer goes wrong, and what this one does about each:
- keyed on too little of the prompt (its first message): the key is the chained hash of every full KV block of
  the fully templated prompt (kv_cache/block_hash.py), so the longest prefix served before wins, and two
  conversations that share a system prompt only match on its blocks;
- a herd onto one engine: a load counts from the moment of dispatch (not from an engine's later report), and
  affinity holds only while the preferred engine's load is not past the window (more than `abs_threshold`
  above the least loaded engine's, and more than `rel_threshold` times it);
- a stale map: an entry is a hint that expires after `ttl_s`, the map holds at most `max_entries` blocks (least
  recently used go first), a later dispatch of the same prefix overwrites it, and a dead engine's entries go.

Load is in requests: the requests in flight on an engine plus its dispatched prompt tokens not yet prefilled,
counted in steps' worth of tokens (`step_tokens`, the scheduler's token budget): a long prompt waiting weighs
what the steps it will take weigh. Pure bookkeeping, no I/O: the data-parallel engine (engine/data_parallel.py)
feeds it.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from kvserve.kv_cache.block_hash import block_keys, hash_block_key


@dataclass(frozen=True)
class BalanceWindow:
    """How far the preferred engine's load may run ahead of the least loaded one's and keep its affinity."""

    abs_threshold: float = 4.0
    rel_threshold: float = 1.5

    def __post_init__(self) -> None:
        if self.abs_threshold < 0:
            raise ValueError(f"the balance window's absolute threshold must be >= 0, got {self.abs_threshold}")
        if self.rel_threshold < 1:
            raise ValueError(f"the balance window's relative threshold must be >= 1, got {self.rel_threshold}")

    def exceeded(self, load: float, min_load: float) -> bool:
        return load - min_load > self.abs_threshold and load > min_load * self.rel_threshold


@dataclass(frozen=True)
class Choice:
    engine: int
    matched_blocks: int
    """Leading blocks of the prompt the chosen engine served recently (0: chosen by load)."""
    reason: str  # "prefix" | "load"


@dataclass
class _Pending:
    engine: int
    waiting_tokens: int


class DPBalancer:
    def __init__(self, num_engines: int, block_size: int, *, window: BalanceWindow = BalanceWindow(),
                 step_tokens: int = 2048, ttl_s: float = 600.0, max_entries: int = 1 << 18,
                 clock: Callable[[], float] = time.monotonic):
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        self.num_engines = num_engines
        self.block_size = block_size
        self.window = window
        self.step_tokens = max(1, step_tokens)
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._owner: OrderedDict[int, tuple[int, float]] = OrderedDict()
        """block hash -> (engine, when it last served that prefix), least recently used first."""
        self._pending: dict[str, _Pending] = {}
        """Requests dispatched and not finished, by id."""
        self._requests = [0] * num_engines
        self._waiting_tokens = [0] * num_engines
        self._dispatched = [0] * num_engines
        self._next = 0  # rotates ties between equally loaded engines

    # ---- the choice ---------------------------------------------------------------------------------
    def prompt_hashes(self, token_ids: list[int], extra: Hashable = None) -> list[int]:
        return [hash_block_key(k) for k in block_keys(token_ids, self.block_size, extra)]

    def choose(self, hashes: list[int], eligible: list[bool]) -> Choice:
        """eligible[i]: engine i is alive and has room. Raises ValueError when none is."""
        candidates = [i for i, ok in enumerate(eligible) if ok]
        if not candidates:
            raise ValueError("no engine can take the request")
        loads = self.loads()
        min_load = min(loads[i] for i in candidates)
        engine, matched = self.affinity(hashes)
        if engine is not None and eligible[engine] and not self.window.exceeded(loads[engine], min_load):
            return Choice(engine, matched, "prefix")
        least = [i for i in candidates if loads[i] == min_load]
        pick = next((i for i in least if i >= self._next), least[0])
        self._next = (pick + 1) % self.num_engines
        return Choice(pick, 0, "load")

    def affinity(self, hashes: list[int]) -> tuple[int | None, int]:
        """The engine that most recently served the longest prefix of these blocks, and how many blocks."""
        now = self._clock()
        for n in range(len(hashes), 0, -1):
            entry = self._owner.get(hashes[n - 1])
            if entry is not None and now - entry[1] <= self.ttl_s:
                return entry[0], n
        return None, 0

    # ---- bookkeeping --------------------------------------------------------------------------------
    def dispatched(self, request_id: str, engine: int, hashes: list[int], num_prompt_tokens: int) -> None:
        now = self._clock()
        for h in hashes:
            self._owner[h] = (engine, now)
            self._owner.move_to_end(h)
        while len(self._owner) > self.max_entries:
            self._owner.popitem(last=False)
        self._pending[request_id] = _Pending(engine, num_prompt_tokens)
        self._requests[engine] += 1
        self._waiting_tokens[engine] += num_prompt_tokens
        self._dispatched[engine] += 1

    def started(self, request_id: str) -> None:
        """The request's first output arrived: its prompt is prefilled."""
        pending = self._pending.get(request_id)
        if pending is not None and pending.waiting_tokens:
            self._waiting_tokens[pending.engine] -= pending.waiting_tokens
            pending.waiting_tokens = 0

    def finished(self, request_id: str) -> None:
        self.started(request_id)
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            self._requests[pending.engine] -= 1

    def engine_died(self, engine: int) -> None:
        """Its requests are gone and it serves no prefix any more."""
        for request_id in [r for r, p in self._pending.items() if p.engine == engine]:
            self.finished(request_id)
        for h in [h for h, (e, _) in self._owner.items() if e == engine]:
            del self._owner[h]

    def forget_all(self) -> None:
        for request_id in list(self._pending):
            self.finished(request_id)

    def loads(self) -> list[float]:
        return [r + w / self.step_tokens for r, w in zip(self._requests, self._waiting_tokens)]

    @property
    def num_dispatched(self) -> list[int]:
        """Requests sent to each engine since start."""
        return list(self._dispatched)

    @property
    def num_prefix_entries(self) -> int:
        return len(self._owner)
