"""Disaggregated prefill/decode, vLLM's request flow (its disaggregated-serving proxy's):

1. a prefill instance (`--kv-transfer-config '{"kv_role": "kv_producer", ...}'`) gets the request with
   `max_tokens` 1 (and `max_completion_tokens` 1 when the client set it), `stream` false, no `stream_options`
   or `min_tokens`, and `kv_transfer_params` {"do_remote_decode": true, ...}: it computes the prompt's KV and
   hands it to its connector;
2. the `kv_transfer_params` of its answer (where the KV is: engine, host, port, block ids; none for a shared
   store) go with the client's original request to a decode instance (`kv_consumer`), which loads that KV
   instead of computing it;
3. the decode instance's answer, streamed or not, goes to the client as it comes: its text and its usage
   (its `cached_tokens` count the prompt tokens it did not compute).

Both sides get the same X-Request-Id (the client's, else a new one), so their logs line up. A prefill instance
that fails before answering, or a decode instance that fails before the first byte of its answer, is taken
out of rotation and the step is retried on another member of its pool. An error answer of the prefill
instance (a bad body: 400) is the client's answer as it came. A client that leaves while its prompt is being
prefilled cancels that request (the prefill instance sees its connection close and aborts it); one that
leaves during decoding closes the decode stream the same way. KV that a prefill instance holds for a decode
that never comes is freed by its connector (a lease).
"""
from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx
from fastapi.responses import Response

from kvserve.router.policies import RoutingKey
from kvserve.router.proxy import Forwarder
from kvserve.server.errors import APIError

# What the prefill instance is told (vLLM's proxy sends every key, the remote ones empty).
PREFILL_KV_TRANSFER_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                              "remote_block_ids": None, "remote_host": None, "remote_port": None}
# NOTE: min_tokens > max_tokens (1) is a bad request; the decode instance gets them with the original body.
_NOT_FOR_PREFILL = ("stream_options", "min_tokens", "min_completion_tokens")


def prefill_body(body: dict) -> dict:
    """The request as the prefill instance gets it: one token, not streamed, with do_remote_decode."""
    out = {k: v for k, v in body.items() if k not in _NOT_FOR_PREFILL}
    out.update(stream=False, max_tokens=1, kv_transfer_params=dict(PREFILL_KV_TRANSFER_PARAMS))
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    return out


def decode_params(answer: httpx.Response) -> dict | None:
    """The prefill answer's kv_transfer_params (None when it has none); APIError 502 if it is not an OpenAI
    answer at all."""
    try:
        parsed = json.loads(answer.content)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise APIError(502, "the prefill instance's answer is not JSON", code="worker_failed") from None
    if not isinstance(parsed, dict):
        raise APIError(502, "the prefill instance's answer is not a JSON object", code="worker_failed")
    params = parsed.get("kv_transfer_params")
    if params is not None and not isinstance(params, dict):
        raise APIError(502, "the prefill instance's kv_transfer_params is not a JSON object", code="worker_failed")
    return params or None


def upstream_headers(headers) -> dict[str, str]:
    """The client's headers, with one X-Request-Id for both sides; the bodies sent on are JSON."""
    out = {k.lower(): v for k, v in headers.items()}
    out.setdefault("x-request-id", f"pd-{uuid.uuid4().hex}")
    out["content-type"] = "application/json"
    return out


def _message(answer: httpx.Response) -> str:
    try:
        return str(answer.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return answer.text[:200]


@dataclass
class PDFlow:
    prefill: Forwarder
    decode: Forwarder

    async def forward(self, path: str, body: dict, raw_body: bytes, headers, key: RoutingKey,
                      disconnected: Callable[[], Awaitable[None]]) -> Response:
        """`disconnected()` returns when the client has gone (the prefill step is then cancelled)."""
        headers = upstream_headers(headers)
        prefill = self.prefill.fetch(path, json.dumps(prefill_body(body)).encode(), headers, key)
        answer = await _unless(disconnected, prefill)
        if answer is None:
            return Response(status_code=499)  # NOTE: nginx's "client closed request"; nobody reads it
        if answer.status_code >= 500:
            raise APIError(502, f"the prefill instance answered {answer.status_code}: {_message(answer)}",
                           code="worker_failed")
        if answer.status_code != 200:  # the client's own error (a bad body), as the prefill instance said it
            return Response(answer.content, status_code=answer.status_code,
                            media_type=answer.headers.get("content-type"))
        params = decode_params(answer)
        if params is not None:
            raw_body = json.dumps({**body, "kv_transfer_params": params}).encode()
        return await self.decode.forward(path, raw_body, headers, key)


async def _unless(disconnected: Callable[[], Awaitable[None]], work: Awaitable):
    """work's result, or None when the client leaves first (work is then cancelled)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return None if task.cancelled() else task.result()
