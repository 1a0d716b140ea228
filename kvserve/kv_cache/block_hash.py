"""The chained key of a full KV block, and a hash of it that is the same in every process.

A block's key is (parent, token ids, extra key): `parent` is `hash_block_key` of the previous block's key
(None for the first), the extra key is what keeps KV that must not be shared apart (cache salt, adapter).
NOTE: Python's own hash() of None (before 3.12) and of str differs from process to process, so keys are
hashed with those parts replaced by stable integers: a router in another process (kvserve/router/) computes
the same hashes as the engine that publishes them in its KV events (kv_cache/events.py).
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable
from functools import lru_cache
from typing import Hashable

BlockKey = tuple  # (parent hash | None, tuple of token ids, extra key)


@lru_cache(maxsize=1024)
def _stable_str(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def _stable(value: Hashable) -> Hashable:
    if value is None:
        return 0
    if isinstance(value, str):
        return _stable_str(value)
    if isinstance(value, tuple):
        return tuple(_stable(v) for v in value)
    return value


def hash_block_key(key: BlockKey) -> int:
    """A 64-bit hash of a block key, equal across processes (the parent of the next block's key)."""
    parent, token_ids, extra = key
    return hash((0 if parent is None else parent, token_ids, _stable(extra)))


def extend_block_keys(keys: list[BlockKey], token_slice: Callable[[int, int], list[int]], num_full_blocks: int,
                      block_size: int, extra: Hashable) -> None:
    """Append chained block keys until keys covers num_full_blocks full blocks of the token sequence."""
    while len(keys) < num_full_blocks:
        i = len(keys)
        parent = hash_block_key(keys[-1]) if keys else None
        keys.append((parent, tuple(token_slice(i * block_size, (i + 1) * block_size)), extra))


def block_keys(token_ids: list[int], block_size: int, extra: Hashable = None) -> list[BlockKey]:
    """The keys of every full block of token_ids."""
    keys: list[BlockKey] = []
    extend_block_keys(keys, lambda a, b: token_ids[a:b], len(token_ids) // block_size, block_size, extra)
    return keys
