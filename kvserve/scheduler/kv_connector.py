"""The scheduler's side of a KV connector (kv_transfer/base.py): external prefix hits at admission, requests parked
while a connector loads their KV asynchronously, and what a failed load does to the requests that owned the bad
blocks (kv_load_failure_policy)."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvserve.kv_cache.manager import KVCacheManager
from kvserve.request import Request


def external_hit(connector, req: Request, num_hit: int) -> tuple[int | None, bool]:
    """(tokens past the local hit `num_hit` that the connector loads, whether asynchronously); None: it does not
    know yet (the request waits). At least the last token is always computed (the step needs its logits)."""
    num, load_async = connector.get_num_new_matched_tokens(req, num_hit)
    if num is None:
        return None, False
    num = max(0, min(num, req.num_tokens - 1 - num_hit))
    return num, load_async and num > 0


@dataclass
class RemoteLoads:
    """Requests in WAITING_FOR_REMOTE_KVS: admitted with blocks for their whole prompt, which the connector fills
    in the background. Neither waiting (they hold blocks) nor running (no step computes them)."""
    loading: dict[str, tuple[Request, int]] = field(default_factory=dict)
    """Request id -> (request, tokens being loaded past its num_computed_tokens)."""
    ready: deque[Request] = field(default_factory=deque)
    """Loaded (num_computed_tokens advanced): they resume ahead of the waiting queue."""

    def __len__(self) -> int:
        return len(self.loading) + len(self.ready)

    def requests(self) -> list[Request]:
        return [r for r, _ in self.loading.values()] + list(self.ready)

    def remove(self, req: Request) -> None:
        if self.loading.pop(req.request_id, None) is None and req in self.ready:
            self.ready.remove(req)


def first_invalid_block(kv: KVCacheManager, req: Request, invalid_block_ids: set[int]) -> int | None:
    """Index in req's table of its first block whose load failed; None: none of its blocks did."""
    return next((i for i, b in enumerate(kv.block_ids(req.request_id)) if b in invalid_block_ids), None)


def load_error_message(req: Request, num_bad: int) -> str:
    return (f"request {req.request_id}: loading its prompt's KV from the KV connector failed ({num_bad} block(s) "
            "missing or corrupt); kv_load_failure_policy is 'fail'")
