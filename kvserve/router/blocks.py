"""What each worker's prefix cache holds, learned from its KV events (GET /kv_events; kv_cache/events.py).

One `WorkerBlocks` per worker: the hashes of its cached blocks, updated by applying each event batch in order.
A worker that restarts (new instance_id), a reader that fell behind (`missed`), or a worker out of rotation
voids the view: it is cleared and rebuilt from the events that follow (blocks cached before are then
unknown to the router: it under-estimates, never over-estimates, what a worker holds).

Between dispatch and the events of a request's prefill, its blocks are `pending` on the worker it went to
(for PENDING_TTL_S at most), so a burst of requests sharing a prefix follows the first one instead of
spreading before any event arrived; an event about a pending block settles it.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import httpx

from kvserve.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, event_from_json

logger = logging.getLogger("kvserve.router")

_POLL_TIMEOUT_S = 10.0
PENDING_TTL_S = 10.0


@dataclass
class WorkerBlocks:
    hashes: set[int] = field(default_factory=set)
    block_size: int | None = None
    instance_id: str | None = None
    next_seq: int = 0
    pending: dict[int, float] = field(default_factory=dict)
    """Hashes of blocks a dispatched request will store -> when to stop expecting them (time.monotonic)."""
    _prune_at: float = field(default=0.0, repr=False)

    def clear(self) -> None:
        self.hashes.clear()
        self.pending.clear()
        self.instance_id, self.next_seq = None, 0

    def apply(self, answer: dict) -> None:
        """One GET /kv_events answer."""
        if answer["instance_id"] != self.instance_id or answer["missed"]:
            self.hashes.clear()
            self.instance_id = answer["instance_id"]
        self.block_size = answer["block_size"]
        for batch in answer["batches"]:
            for data in batch["events"]:
                self._apply_event(event_from_json(data))
        self.next_seq = answer["next"]

    def _apply_event(self, event) -> None:
        if isinstance(event, BlockStored):
            self.hashes.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            self.hashes.difference_update(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            self.hashes.clear()
            self.pending.clear()
            return
        for h in event.block_hashes:
            self.pending.pop(h, None)

    def expect(self, block_hashes: list[int], now: float) -> None:
        """A request holding these blocks was sent here: count them as held until its events arrive."""
        if now >= self._prune_at:
            # NOTE: blocks whose events never come (an aborted request, a prompt the worker tokenized otherwise)
            # would otherwise stay here for the router's life
            self.pending = {h: t for h, t in self.pending.items() if t > now}
            self._prune_at = now + PENDING_TTL_S
        for h in block_hashes:
            if h not in self.hashes:
                self.pending[h] = now + PENDING_TTL_S

    def num_prefix_blocks(self, block_hashes: list[int], now: float) -> int:
        """Leading blocks of a prompt (its chained hashes) this worker holds or is about to."""
        n = 0
        for h in block_hashes:
            if h not in self.hashes and self.pending.get(h, 0.0) <= now:
                break
            n += 1
        return n


async def follow_events(url: str, blocks: WorkerBlocks, client: httpx.AsyncClient, retry_s: float,
                        headers: dict[str, str] | None = None) -> None:
    """Long-poll a worker's /kv_events forever, applying each answer; on an error, wait retry_s and go on.
    A worker that refuses (no --kv-events-config, a wrong --api-key) is logged once per distinct answer."""
    last_error = None
    while True:
        try:
            response = await client.get(f"{url}/kv_events", params={"since": blocks.next_seq,
                                                                     "timeout": _POLL_TIMEOUT_S},
                                        headers=headers, timeout=_POLL_TIMEOUT_S + 5)
            if response.status_code != 200:
                error = f"/kv_events answered {response.status_code}: {response.text[:200]}"
                if error != last_error:
                    logger.warning("no KV events from %s (precise routing sees none of its cache): %s", url, error)
                last_error = error
                raise RuntimeError(error)
            blocks.apply(response.json())
            last_error = None
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the worker is down or restarting: the health checks say which
            logger.debug("KV events of %s: %s", url, e)
            blocks.clear()
            await asyncio.sleep(retry_s)
