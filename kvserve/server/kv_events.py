"""GET /kv_events: the engine's KV events (--kv-events-config), replayable and long-polled.

    GET /kv_events?since=N&timeout=S
    -> {"instance_id", "topic", "block_size", "next": M, "missed": bool,
        "batches": [{"seq": N, "timestamp": t, "events": [{"type": "BlockStored", ...}, ...]}, ...]}

`batches` holds every batch numbered >= since that the log still holds (at most --kv-events-config's
buffer_steps); with none yet, the answer waits up to `timeout` seconds (at most 30) for one. The reader
then asks again with since=next. `missed` says batches it asked for were already dropped, and a new
`instance_id` says the server restarted: either way the reader's view of the cache is void and it starts
over from what it gets (kvserve/router/precise.py).
"""
from __future__ import annotations

import asyncio
import time
import uuid

from fastapi.responses import JSONResponse

from kvserve.config.kv_events import KVEventsConfig
from kvserve.kv_cache.events import KVEventLog, event_to_json
from kvserve.server.errors import APIError

_MAX_WAIT_S = 30.0


class KVEventFeed:
    """The server's KV event log, fed from the engine's step reports on the event loop."""

    def __init__(self, config: KVEventsConfig, block_size: int):
        self.config = config
        self.block_size = block_size
        self.instance_id = uuid.uuid4().hex
        self.log = KVEventLog(config.buffer_steps)
        self._changed = asyncio.Event()

    def on_step(self, report) -> None:
        """AsyncEngine listener: one batch per step that changed the cache."""
        if report.kv_events:
            self.log.append(report.kv_events, time.time())
            self._changed.set()
            self._changed = asyncio.Event()

    async def answer(self, since: int, timeout: float) -> JSONResponse:
        if since < 0:
            raise APIError(400, f"since must be >= 0, got {since}", param="since")
        if not timeout >= 0:
            raise APIError(400, f"timeout must be >= 0, got {timeout}", param="timeout")
        if since >= self.log.next_seq and timeout > 0:
            try:
                await asyncio.wait_for(self._changed.wait(), min(timeout, _MAX_WAIT_S))
            except asyncio.TimeoutError:
                pass
        batches, missed = self.log.since(since)
        return JSONResponse({
            "instance_id": self.instance_id, "topic": self.config.topic, "block_size": self.block_size,
            "next": self.log.next_seq, "missed": missed,
            "batches": [{"seq": b.seq, "timestamp": b.timestamp, "events": [event_to_json(e) for e in b.events]}
                        for b in batches]})
