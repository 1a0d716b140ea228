"""Forwarding one request to a worker: the body as sent, the answer (or its stream) as received.

A request is retried on another worker when the one chosen fails before anything reached the client (the
connection is refused or cut before the answer's first bytes, or it answers 503: it is shutting down or its
engine died); that worker leaves rotation. A stream cut midway ends with an OpenAI error event and
`data: [DONE]`: what was streamed cannot be taken back.
"""
from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import httpx
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from kvserve.router.policies import RoutingKey
from kvserve.router.workers import Worker, WorkerPool
from kvserve.server.errors import APIError

logger = logging.getLogger("kvserve.router")

# Request headers passed on to the worker (the client's API key among them); hop-by-hop ones are not.
_FORWARDED_HEADERS = ("authorization", "x-api-key", "content-type", "x-request-id")
_RETRYABLE = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError,
              httpx.WriteError)


class _WorkerGone(Exception):
    """The worker failed before the client got anything: try another."""


@dataclass
class Forwarder:
    pool: WorkerPool
    client: httpx.AsyncClient
    choose: Callable[[RoutingKey, list[Worker]], Worker]
    name: str = "worker"
    """What the pool's members are called in error messages (disaggregated pools: prefill, decode)."""

    async def forward(self, path: str, raw_body: bytes, headers, key: RoutingKey) -> Response:
        return await self._on_some_worker(key, lambda worker: self._send(worker, path, raw_body, headers))

    async def fetch(self, path: str, raw_body: bytes, headers, key: RoutingKey) -> httpx.Response:
        """A worker's whole answer, read to its end (retried on another worker as forward() is)."""
        return await self._on_some_worker(key, lambda worker: self._fetch(worker, path, raw_body, headers))

    async def _on_some_worker(self, key: RoutingKey, attempt: Callable[[Worker], Awaitable]):
        tried: set[str] = set()
        while True:
            workers = [w for w in self.pool.healthy() if w.url not in tried]
            if not workers:
                if tried:
                    raise APIError(502, f"every {self.name} tried failed ({', '.join(sorted(tried))})",
                                   code="worker_failed")
                raise APIError(503, f"no healthy {self.name}", code="no_healthy_worker")
            worker = self.choose(key, workers)
            tried.add(worker.url)
            try:
                return await attempt(worker)
            except _WorkerGone as e:
                self.pool.mark_down(worker, str(e))

    def _request(self, worker: Worker, path: str, raw_body: bytes, headers) -> httpx.Request:
        fwd = {k: v for k, v in headers.items() if k.lower() in _FORWARDED_HEADERS}
        return self.client.build_request("POST", f"{worker.url}{path}", content=raw_body, headers=fwd)

    async def _fetch(self, worker: Worker, path: str, raw_body: bytes, headers) -> httpx.Response:
        done = self.pool.begin(worker)
        try:
            response = await self.client.send(self._request(worker, path, raw_body, headers))
        except _RETRYABLE as e:  # the answer never reached the client: another worker may give it
            raise _WorkerGone(f"{type(e).__name__} on {path}") from None
        except httpx.HTTPError as e:
            raise APIError(502, f"{self.name} {worker.url} failed: {type(e).__name__}", code="worker_failed") from None
        finally:
            done()
        if response.status_code == 503:
            raise _WorkerGone(f"{path} answered 503")
        return response

    async def _send(self, worker: Worker, path: str, raw_body: bytes, headers) -> Response:
        request = self._request(worker, path, raw_body, headers)
        done = self.pool.begin(worker)
        try:
            response = await self.client.send(request, stream=True)
        except _RETRYABLE as e:
            done()
            raise _WorkerGone(f"{type(e).__name__} on {path}") from None
        except httpx.HTTPError as e:
            done()
            raise APIError(502, f"{self.name} {worker.url} failed: {type(e).__name__}",
                           code="worker_failed") from None
        if response.status_code == 503:
            await response.aclose()
            done()
            raise _WorkerGone(f"{path} answered 503")
        chunks = response.aiter_bytes()  # decoded: content-encoding is not passed on
        try:
            first = await chunks.__anext__()
        except StopAsyncIteration:
            first = b""
        except _RETRYABLE as e:  # nothing reached the client yet
            await response.aclose()
            done()
            raise _WorkerGone(f"{type(e).__name__} before the answer's first bytes") from None
        except BaseException:
            await response.aclose()
            done()
            raise
        media_type = response.headers.get("content-type")
        # NOTE: the background task also runs when the client left before the relay started (its finally never runs).
        return StreamingResponse(self._relay(first, chunks, response, done, worker), status_code=response.status_code,
                                 media_type=media_type, background=BackgroundTask(_close, response, done))

    async def _relay(self, first: bytes, chunks: AsyncIterator[bytes], response: httpx.Response, done,
                     worker: Worker) -> AsyncIterator[bytes]:
        try:
            if first:
                yield first
            async for chunk in chunks:
                yield chunk
        except httpx.HTTPError as e:
            logger.warning("worker %s failed mid-answer: %s", worker.url, type(e).__name__)
            if response.headers.get("content-type", "").startswith("text/event-stream"):
                error = APIError(502, f"the {self.name} serving this request failed mid-stream ({type(e).__name__})",
                                 code="worker_failed")
                yield f"data: {json.dumps(error.body())}\n\ndata: [DONE]\n\n".encode()
        finally:
            await response.aclose()
            done()


async def _close(response: httpx.Response, done: Callable[[], None]) -> None:
    await response.aclose()
    done()
