"""KVEventsConfig: vLLM's `--kv-events-config`, same keys.

    {"enable_kv_cache_events": true, "publisher": "http"}
    {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv-events"}

The events (kv_cache/events.py) are served by `kvserve serve` at GET /kv_events. vLLM publishes them over
ZMQ with msgpack; pyzmq is not a kvserve dependency, so "zmq" (vLLM's default) is accepted and the events go
to /kv_events too: endpoint, replay_endpoint, hwm and topic are then unused (docs/SCALING.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserve.config.json_flag import json_object_fields

PUBLISHERS = ("null", "http", "zmq")


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    """Record what enters and leaves the prefix cache."""
    publisher: str | None = None
    """null (record nothing), http (GET /kv_events), zmq (vLLM's name; served as http); default: http when enabled."""
    endpoint: str = "tcp://*:5557"
    """vLLM's ZMQ endpoint (unused: the events are served on the API port)."""
    replay_endpoint: str | None = None
    """vLLM's ZMQ replay endpoint (unused: /kv_events?since=N replays from the log)."""
    buffer_steps: int = 10_000
    """Event batches (one per engine step that changed the cache) kept for readers that fall behind."""
    hwm: int = 100_000
    """vLLM's ZMQ high-water mark (unused)."""
    max_queue_size: int = 100_000
    """vLLM's publisher queue bound (unused: batches past buffer_steps are dropped, readers see `missed`)."""
    topic: str = ""
    """Reported with each /kv_events answer, as vLLM prefixes its ZMQ messages."""

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError("kv_events_config.enable_kv_cache_events must be true or false")
        if self.publisher is not None and self.publisher not in PUBLISHERS:
            raise ValueError(f"kv_events_config.publisher must be one of {', '.join(PUBLISHERS)}, "
                             f"got {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"kv_events_config.{name} must be an integer >= 1, got {value!r}")

    @property
    def enabled(self) -> bool:
        """Events are recorded and served."""
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def parse(cls, value: "KVEventsConfig | dict[str, Any] | str | None") -> "KVEventsConfig | None":
        """From a dict, a JSON object string (the CLI flag) or None / "" (off). Unknown keys are an error."""
        if isinstance(value, cls):
            return value
        value = json_object_fields(value, cls, "kv_events_config")
        return None if value is None else cls(**value)
