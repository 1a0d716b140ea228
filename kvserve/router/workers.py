"""The router's workers: where each is, whether it is healthy, and how many requests it has in flight.

Load counts from the moment of dispatch (`dispatched`), not from what a worker last reported, so a burst of
requests arriving together spreads instead of all seeing the same idle worker (a herd). Health: a worker is
polled at GET /health every interval; `failure_threshold` failed polls in a row (or one refused connection
on dispatch) take it out of rotation, `success_threshold` good ones bring it back.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

logger = logging.getLogger("kvserve.router")


@dataclass(eq=False)
class Worker:
    url: str
    healthy: bool = True
    load: int = 0
    """Requests dispatched to it and not yet finished."""
    num_failures: int = 0
    num_successes: int = 0
    num_requests_total: int = 0


@dataclass(frozen=True)
class HealthConfig:
    interval_s: float = 5.0
    timeout_s: float = 5.0
    failure_threshold: int = 3
    success_threshold: int = 2

    def __post_init__(self) -> None:
        if not self.interval_s > 0 or not self.timeout_s > 0:
            raise ValueError("health check interval and timeout must be > 0 seconds")
        if self.failure_threshold < 1 or self.success_threshold < 1:
            raise ValueError("health failure and success thresholds must be >= 1")


@dataclass
class WorkerPool:
    """Every worker; `on_down(worker)` runs when one leaves rotation (its routing state is then stale)."""

    workers: list[Worker]
    health: HealthConfig = field(default_factory=HealthConfig)
    on_down: list[Callable[[Worker], None]] = field(default_factory=list)

    @classmethod
    def of(cls, urls: list[str], health: HealthConfig) -> "WorkerPool":
        return cls([Worker(url.rstrip("/")) for url in urls], health)

    def healthy(self) -> list[Worker]:
        return [w for w in self.workers if w.healthy]

    def begin(self, worker: Worker) -> Callable[[], None]:
        """Count a request against the worker from now; call what this returns (once) when it ends there."""
        worker.load += 1
        worker.num_requests_total += 1
        ended = False

        def end() -> None:
            nonlocal ended
            if not ended:
                ended = True
                worker.load -= 1
        return end

    async def probe(self, client: httpx.AsyncClient) -> None:
        """One poll whose outcome is each worker's state at once (start-up: no thresholds)."""
        async def check(worker: Worker) -> None:
            try:
                ok = (await client.get(f"{worker.url}/health", timeout=self.health.timeout_s)).status_code == 200
            except httpx.HTTPError:
                ok = False
            worker.healthy = ok
            if not ok:
                logger.warning("worker %s does not answer /health yet", worker.url)

        await asyncio.gather(*(check(w) for w in self.workers))

    def mark_down(self, worker: Worker, reason: str) -> None:
        if worker.healthy:
            logger.warning("worker %s is out of rotation: %s", worker.url, reason)
        worker.healthy, worker.num_successes = False, 0
        for callback in self.on_down:
            callback(worker)

    def record(self, worker: Worker, ok: bool, reason: str = "") -> None:
        """One health poll's outcome."""
        if ok:
            worker.num_failures = 0
            worker.num_successes += 1
            if not worker.healthy and worker.num_successes >= self.health.success_threshold:
                worker.healthy = True
                logger.info("worker %s is back in rotation", worker.url)
            return
        worker.num_successes = 0
        worker.num_failures += 1
        if worker.healthy and worker.num_failures >= self.health.failure_threshold:
            self.mark_down(worker, reason)

    async def poll_once(self, client: httpx.AsyncClient) -> None:
        async def check(worker: Worker) -> None:
            try:
                response = await client.get(f"{worker.url}/health", timeout=self.health.timeout_s)
            except httpx.HTTPError as e:
                self.record(worker, False, f"/health: {type(e).__name__}")
            else:
                self.record(worker, response.status_code == 200, f"/health answered {response.status_code}")

        await asyncio.gather(*(check(w) for w in self.workers))

    async def poll_forever(self, client: httpx.AsyncClient) -> None:
        while True:
            await self.poll_once(client)
            await asyncio.sleep(self.health.interval_s)
