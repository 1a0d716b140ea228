"""KV events, vLLM's (vllm/distributed/kv_events.py): what enters and leaves an engine's prefix cache.

    BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id)   blocks became cached
    BlockRemoved(block_hashes)                                                      cached blocks were evicted
    AllBlocksCleared()                                                              the cache was emptied

The BlockPool reports each change to a KVEventRecorder; the engine loop drains it after every step and the
server publishes the batches in order, each with a sequence number (server: GET /kv_events). A router that
applies them knows which blocks each replica holds, evictions included (kvserve/router/precise.py). Hashes
are kv_cache/block_hash.py's, equal in every process, so the router can hash a prompt the same way.
"""
from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field

from kvserve.kv_cache.block_hash import BlockKey, hash_block_key


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    """The stored blocks' tokens, concatenated (len(block_hashes) * block_size)."""
    block_size: int
    lora_id: int | None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[int]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
_TYPES = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved, "AllBlocksCleared": AllBlocksCleared}


def event_to_json(event: KVEvent) -> dict:
    return {"type": type(event).__name__, **asdict(event)}


def event_from_json(data: dict) -> KVEvent:
    """The inverse of event_to_json; ValueError for an unknown type or fields."""
    fields = dict(data)
    kind = _TYPES.get(fields.pop("type", None))
    if kind is None:
        raise ValueError(f"unknown KV event type {data.get('type')!r}")
    try:
        return kind(**fields)
    except TypeError as e:
        raise ValueError(f"bad {kind.__name__} event: {e}") from None


def _lora_id(extra) -> int | None:
    return extra[1] if isinstance(extra, tuple) else None


@dataclass
class KVEventRecorder:
    """Collects the BlockPool's changes between two drains; consecutive changes of one kind are merged
    (blocks stored along one chain become one BlockStored, as vLLM batches them)."""

    block_size: int
    _events: list[KVEvent] = field(default_factory=list)

    def stored(self, key: BlockKey) -> None:
        parent, token_ids, extra = key
        block_hash, lora_id = hash_block_key(key), _lora_id(extra)
        last = self._events[-1] if self._events else None
        if (isinstance(last, BlockStored) and last.block_hashes[-1] == parent and last.lora_id == lora_id):
            last.block_hashes.append(block_hash)
            last.token_ids.extend(token_ids)
            return
        self._events.append(BlockStored([block_hash], parent, list(token_ids), self.block_size, lora_id))

    def removed(self, key: BlockKey) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(hash_block_key(key))
        else:
            self._events.append(BlockRemoved([hash_block_key(key)]))

    def cleared(self) -> None:
        self._events = [AllBlocksCleared()]  # NOTE: whatever came before is void once everything is gone

    def drain(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events


@dataclass(frozen=True)
class EventBatch:
    seq: int
    timestamp: float
    events: list[KVEvent]


class KVEventLog:
    """The last `max_batches` event batches, numbered from 0 in publication order (what /kv_events serves).

    A reader that asks for batches past `since` gets them all if they are still held; if some were dropped
    (the reader fell behind by more than max_batches), `missed` is True: its view of the cache is stale and
    must be rebuilt from what follows (a router forgets the replica's blocks)."""

    def __init__(self, max_batches: int):
        if max_batches < 1:
            raise ValueError(f"the KV event log needs room for at least one batch, got {max_batches}")
        self._batches: deque[EventBatch] = deque(maxlen=max_batches)
        self.next_seq = 0

    def append(self, events: list[KVEvent], timestamp: float) -> None:
        if events:
            self._batches.append(EventBatch(self.next_seq, timestamp, events))
            self.next_seq += 1

    def since(self, seq: int) -> tuple[list[EventBatch], bool]:
        """(batches numbered >= seq, whether some of those were already dropped)."""
        oldest = self._batches[0].seq if self._batches else self.next_seq
        batches = [b for b in self._batches if b.seq >= seq]
        return batches, seq < oldest
