"""Order of the waiting queue: FCFS, or LPM (longest cached prefix first, SGLang's policy).

LPM admits the requests that would reuse the most cached KV first, so a burst sharing a prefix runs while
that prefix is still cached. Bound: a request passed over by later arrivals MAX_SKIPS times goes to the
front, so none waits forever. Preempted requests always stay at the front (they hold no blocks but
already produced output).
"""
from __future__ import annotations

from collections import deque

from kvserve.kv_cache.manager import KVCacheManager
from kvserve.request import Request, RequestStatus

POLICIES = ("fcfs", "lpm")
MAX_SKIPS = 16
# Above this many waiting requests, sorting by cached prefix costs more than it saves (SGLang falls back too).
LPM_MAX_QUEUE = 256


class WaitingOrder:
    def __init__(self, policy: str, kv: KVCacheManager):
        if policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy = policy
        self.kv = kv
        self._skips: dict[str, int] = {}

    def reorder(self, waiting: deque[Request]) -> None:
        if self.policy == "fcfs" or len(waiting) < 2 or len(waiting) > LPM_MAX_QUEUE:
            return
        items = list(waiting)
        first = [r for r in items if r.status == RequestStatus.PREEMPTED
                 or self._skips.get(r.request_id, 0) >= MAX_SKIPS]
        first.sort(key=lambda r: (r.status != RequestStatus.PREEMPTED, r.metrics.arrival_time))
        rest = [r for r in items if r not in first]
        hits = {r.request_id: len(self.kv.get_computed_blocks(r)) for r in rest}
        rest.sort(key=lambda r: (-hits[r.request_id], r.metrics.arrival_time))
        waiting.clear()
        waiting.extend(first + rest)

    def after_admission(self, waiting: deque[Request], admitted: list[Request]) -> None:
        if self.policy == "fcfs" or not admitted:
            for r in admitted:
                self._skips.pop(r.request_id, None)
            return
        latest = max(r.metrics.arrival_time for r in admitted)
        for r in admitted:
            self._skips.pop(r.request_id, None)
        for r in waiting:
            if r.metrics.arrival_time < latest:
                self._skips[r.request_id] = self._skips.get(r.request_id, 0) + 1

    def forget(self, request_id: str) -> None:
        self._skips.pop(request_id, None)
