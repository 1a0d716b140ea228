"""KVCacheManager: per-request block tables over the BlockPool, plus prefix reuse through chained block hashes.

A full block's key is (hash of the previous block's key, its tokens, extra key), so equal keys mean equal
prefixes; the dict lookup compares the tokens exactly, so only a 64-bit collision of the parent hash could
alias two prefixes. The extra key (`Request.cache_salt`, and with an adapter `(cache_salt, lora_int_id)`)
keeps KV that must not be shared apart: the same tokens under two adapters have different K/V. With prefix
caching off, only requests given the same salt (the n samples of one prompt) share.

With a sliding window on every layer (`sliding_window`), blocks no query of a request can read any more are
released while it runs and prefix hits need only the window's blocks (kv_cache/window.py); a released entry
of a table is the null block, a placeholder past the pool's blocks that is never allocated.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Hashable

from kvserve.kv_cache.block_hash import extend_block_keys, hash_block_key
from kvserve.kv_cache.block_pool import BlockPool, KVBlock
from kvserve.kv_cache.pins import PinTable
from kvserve.kv_cache.reservation import Reservations
from kvserve.kv_cache.window import first_live_block, longest_window_hit
from kvserve.request import Request


@dataclass
class PrefixExplanation:
    """Why a prompt would (not) hit the prefix cache."""

    num_prompt_tokens: int
    num_hit_tokens: int
    """Tokens that admission would take from the cache (full blocks; never the last prompt token)."""
    num_matched_tokens: int
    """Tokens matching the closest cached sequence: where the prompt and that sequence diverge."""
    cached_continuation: list[int] | None
    """The closest cached sequence's tokens from the block where they diverge (None: it ends there)."""


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, enable_prefix_caching: bool,
                 max_pinned_blocks: int | None = None, clock: Callable[[], float] = time.monotonic, *,
                 sliding_window: int | None = None, reserve_blocks: int | None = None):
        """`sliding_window`: every layer attends through a window of at most this many positions, so blocks
        before a request's window are released while it runs (None: some layer reads every block). The KV
        cache then needs one block past the pool's, block id `pool.num_blocks`: the null block.
        `reserve_blocks`: contiguous reservation, each admitted request has this many blocks set aside
        (kv_cache/reservation.py); None: paged."""
        self.reservations = Reservations(reserve_blocks)
        self.pool = pool
        self.pins = PinTable(pool, pool.num_blocks // 2 if max_pinned_blocks is None else max_pinned_blocks, clock)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._tables: dict[str, list[KVBlock]] = {}
        self._hashes: dict[str, list[Hashable]] = {}   # keys of the request's full blocks, computed lazily
        self._num_registered: dict[str, int] = {}      # leading blocks of the table already in the cache
        self.sliding_window = sliding_window
        self.null_block: KVBlock | None = None if sliding_window is None else KVBlock(pool.num_blocks)
        """Stands for a released block in a table (it leads the table: see window.py); no kernel reads it."""

    def _cacheable(self, request: Request) -> bool:
        return self.enable_prefix_caching or request.cache_salt is not None

    def _block_keys(self, request: Request, num_full_blocks: int) -> list[Hashable]:
        keys = self._hashes.setdefault(request.request_id, [])
        extend_block_keys(keys, request.token_slice, num_full_blocks, self.block_size, extra_key(request))
        return keys

    # ---- admission ----------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> list[KVBlock]:
        """The longest run of cached blocks that prefixes the request's tokens.

        NOTE: at most (num_tokens - 1) // block_size blocks, so at least the last token is computed:
        the step needs its logits. No blocks for a request that must recompute (prompt logprobs).
        """
        if not self._cacheable(request) or request.skip_reading_prefix_cache:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        if self.sliding_window is not None:
            return self._window_hit(self._block_keys(request, max_blocks)[:max_blocks])
        hits = []
        for key in self._block_keys(request, max_blocks):
            block = self.pool.lookup(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def _window_hit(self, keys: list[Hashable]) -> list[KVBlock]:
        """The longest hit a windowed model can take: null blocks, then the cached blocks its next query reads."""
        num_hit = longest_window_hit(lambda i: self.pool.lookup(keys[i]), len(keys), self.sliding_window,
                                     self.block_size)
        live = first_live_block(num_hit * self.block_size, self.sliding_window, self.block_size)
        return [self.null_block] * live + [self.pool.lookup(key) for key in keys[live:num_hit]]

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[KVBlock] | None = None) -> bool:
        """Grow the request's table to hold num_computed_tokens + num_new_tokens (after taking the
        computed blocks, which must prefix it). Returns False, changing nothing, if the pool is short.

        With a sliding window, the blocks before the window of the step's first query (at
        num_computed_tokens) are released first, whatever the outcome: no later step reads them."""
        computed_blocks = computed_blocks or []
        if self.sliding_window is not None:
            self._release_out_of_window(request)
        real = [b for b in computed_blocks if b is not self.null_block]
        table = self._tables.get(request.request_id, [])
        num_tokens = request.num_computed_tokens + num_new_tokens
        num_needed = -(-num_tokens // self.block_size) - len(table) - len(computed_blocks)
        # Touching an unreferenced cached block takes it off the free queue.
        num_available = self.pool.num_free_blocks - sum(1 for b in real if b.ref_count == 0)
        num_to_find = self.reservations.blocks_to_find(request.request_id, num_needed,
                                                       len(table) + len(computed_blocks))
        if num_to_find > num_available - self.reservations.set_aside(self._tables, request.request_id):
            return False
        self.reservations.admit(request.request_id)
        self.pool.touch(real)
        self.pins.renew(real)
        table = self._tables.setdefault(request.request_id, [])
        table.extend(computed_blocks)
        if computed_blocks:
            self._num_registered[request.request_id] = len(table)
        if num_needed > 0:
            table.extend(self.pool.allocate(num_needed))
        return True

    def _release_out_of_window(self, request: Request) -> None:
        """Release the table's blocks before the window of a step starting at num_computed_tokens, oldest first
        (the pool evicts them first: a later hit needs the blocks just before its end, not the oldest)."""
        table = self._tables.get(request.request_id)
        if not table:
            return
        live = min(first_live_block(request.num_computed_tokens, self.sliding_window, self.block_size), len(table))
        first = live
        while first > 0 and table[first - 1] is not self.null_block:  # nulls lead the table
            first -= 1
        if first == live:
            return
        released = table[first:live]
        table[first:live] = [self.null_block] * (live - first)
        self.pool.release(released)

    def cache_full_blocks(self, request: Request) -> None:
        """Register the blocks that became full of computed KV (call after each step)."""
        if not self._cacheable(request):
            return
        num_full = request.num_computed_tokens // self.block_size
        start = self._num_registered.get(request.request_id, 0)
        if num_full <= start:
            return
        table = self._tables[request.request_id]
        keys = self._block_keys(request, num_full)
        for i in range(start, num_full):
            if table[i] is not self.null_block:  # released ones were registered while in the window
                self.pool.cache(table[i], keys[i])
        self._num_registered[request.request_id] = num_full

    def pin_prefix(self, request: Request, num_tokens: int, ttl: float) -> int:
        """Pin the request's cached full blocks covering its first num_tokens tokens for ttl seconds.
        Returns the number of tokens pinned (fewer when the pin bound is reached). With a window: the blocks
        still held (the earlier ones were released), and the tokens a later hit can take through them."""
        table = self._tables.get(request.request_id, [])
        blocks = [b for b in table[:num_tokens // self.block_size] if b.block_hash is not None]
        pinned = self.pins.pin(blocks, ttl)
        if self.sliding_window is None:
            return pinned * self.block_size
        held = set(blocks[:pinned])
        prefix = table[:num_tokens // self.block_size]
        return longest_window_hit(lambda i: prefix[i] if prefix[i] in held else None, len(prefix),
                                  self.sliding_window, self.block_size) * self.block_size

    def explain(self, token_ids: list[int], cache_salt: str | None = None, lora_int_id: int = 0) -> PrefixExplanation:
        """Longest cached prefix of token_ids (as the base model, or adapter lora_int_id, would look it up), and
        where the closest cached sequence diverges from it. With a window, a prefix is cached when the blocks
        its next query reads are (get_computed_blocks)."""
        bs = self.block_size
        keys: list[Hashable] = []
        extra = block_extra_key(cache_salt, lora_int_id)
        extend_block_keys(keys, lambda a, b: token_ids[a:b], len(token_ids) // bs, bs, extra)
        max_admitted = (len(token_ids) - 1) // bs
        if self.sliding_window is not None:
            hit, admitted = len(self._window_hit(keys)), len(self._window_hit(keys[:max_admitted])) * bs
        else:
            hit = 0
            while hit < len(keys) and self.pool.lookup(keys[hit]) is not None:
                hit += 1
            admitted = min(hit, max_admitted) * bs
        parent = hash_block_key(keys[hit - 1]) if hit else None
        rest = token_ids[hit * bs:(hit + 1) * bs]
        best, continuation = 0, None
        for key in self.pool.cached_keys():
            if key[0] != parent or key[2] != extra:
                continue
            common = next((i for i, (a, b) in enumerate(zip(rest, key[1])) if a != b), min(len(rest), bs))
            if continuation is None or common > best:
                best, continuation = common, list(key[1])
        return PrefixExplanation(len(token_ids), admitted, hit * bs + best, continuation)

    def free(self, request: Request, finished: bool = True) -> None:
        """Release the request's blocks (tail first). A preempted request keeps its block keys."""
        table = self._tables.pop(request.request_id, [])
        self.reservations.release(request.request_id)
        self.pool.release([b for b in table[::-1] if b is not self.null_block])
        self._num_registered.pop(request.request_id, None)
        if finished:
            self._hashes.pop(request.request_id, None)

    def free_tail(self, request: Request) -> int:
        """Return the blocks past the request's computed tokens (KV of drafts the target rejected) to the
        pool; they hold no verified token, so none is in the prefix cache. Returns how many."""
        table = self._tables.get(request.request_id)
        if not table:
            return 0
        keep = -(-request.num_computed_tokens // self.block_size)
        tail = table[keep:]
        if tail:
            del table[keep:]
            self.pool.release(tail[::-1])
        return len(tail)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._tables.get(request_id, ())]

    @property
    def num_request_blocks(self) -> int:
        """Distinct blocks held by request tables: zero whenever no request is running (else a leak)."""
        in_use = self.pool.num_blocks - self.pool.num_free_blocks
        return in_use - self.pins.num_pin_only

    def num_blocks_held(self, request_id: str) -> int:
        """The request's table length (released entries of a windowed model included)."""
        return len(self._tables.get(request_id, ()))

    def num_live_blocks(self, request_id: str) -> int:
        """Pool blocks the request's table holds (its table less the released entries)."""
        return sum(1 for b in self._tables.get(request_id, ()) if b is not self.null_block)

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_cache()

    # ---- invariants ---------------------------------------------------------------------
    def check_invariants(self, requests: dict[str, Request], held: dict[str, Request] | None = None) -> None:
        """Pool invariants, plus: each block's ref_count equals the number of live tables holding it,
        no block twice in one table, each table covers its request's computed tokens. `held`: finished
        requests whose tables a KV connector still reads (they hold their blocks until it is done)."""
        held = held or {}
        self.pool.check_invariants()
        holders: dict[int, int] = self.pins.holders()
        for req_id, table in self._tables.items():
            self._check_released(req_id, table, requests.get(req_id))
            ids = [b.block_id for b in table if b is not self.null_block]
            assert len(ids) == len(set(ids)), f"request {req_id} holds a block twice: {ids}"
            for i in ids:
                holders[i] = holders.get(i, 0) + 1
            if req_id in held:
                assert req_id not in requests and held[req_id].is_finished, f"held table of live request {req_id}"
                continue
            req = requests.get(req_id)
            assert req is not None and not req.is_finished, f"table of dead request {req_id}"
            assert len(table) * self.block_size >= req.num_computed_tokens, f"{req_id} table too short"
        for b in self.pool.blocks:
            assert b.ref_count == holders.get(b.block_id, 0), (
                f"block {b.block_id}: ref_count {b.ref_count} but {holders.get(b.block_id, 0)} holders")
        assert self.pins.num_pinned <= self.pins.max_blocks
        assert self.reservations.set_aside(self._tables) <= self.pool.num_free_blocks, "reserved blocks overdrawn"
        for bid in self.pins.holders():
            assert self.pool.blocks[bid].block_hash is not None, f"pinned block {bid} is not cached"

    def _check_released(self, req_id: str, table: list[KVBlock], req: Request | None) -> None:
        """Null entries only with a window, leading the table, and only before the window of the request's
        next step; the null block itself is never referenced, cached or handed out."""
        num_null = sum(1 for b in table if b is self.null_block)
        if self.null_block is None or not num_null:
            return
        null = self.null_block
        assert null.ref_count == 0 and null.block_hash is None, f"null block touched: {null}"
        assert all(b is null for b in table[:num_null]), f"request {req_id}: released entries do not lead its table"
        if req is not None:
            live = first_live_block(req.num_computed_tokens, self.sliding_window, self.block_size)
            assert num_null <= live, f"request {req_id}: {num_null} entries released, window starts at block {live}"


def extra_key(request: Request) -> Hashable:
    return block_extra_key(request.cache_salt, request.lora_int_id)


def block_extra_key(cache_salt: str | None, lora_int_id: int) -> Hashable:
    """What besides the tokens keys a block. NOTE: the base model keeps the bare salt, so its keys are the
    same whether or not LoRA is enabled."""
    return cache_salt if not lora_int_id else (cache_salt, lora_int_id)

