"""The disaggregated request flow (router/pd.py) over scripted prefill and decode workers (an httpx mock
transport): what each side is sent, and a client leaving during the prefill cancels it."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from kvserve.router.pd import PREFILL_KV_TRANSFER_PARAMS, PDFlow, prefill_body
from kvserve.router.policies import RoundRobin, RoutingKey
from kvserve.router.proxy import Forwarder
from kvserve.router.workers import HealthConfig, WorkerPool
from kvserve.server.errors import APIError


def test_the_prefill_body_is_one_unstreamed_token_with_do_remote_decode():
    body = {"prompt": "x", "max_tokens": 50, "max_completion_tokens": 50, "stream": True, "min_tokens": 5,
            "stream_options": {"include_usage": True}, "temperature": 0, "kv_transfer_params": {"mine": 1}}
    out = prefill_body(body)
    assert out == {"prompt": "x", "max_tokens": 1, "max_completion_tokens": 1, "stream": False, "temperature": 0,
                   "kv_transfer_params": PREFILL_KV_TRANSFER_PARAMS}
    assert out["kv_transfer_params"]["do_remote_decode"] is True
    assert body["max_tokens"] == 50 and body["stream"] is True  # the client's body is left as it was
    assert "max_completion_tokens" not in prefill_body({"messages": [], "max_tokens": 3})


class Script:
    """`prefill` answers with `params` as its kv_transfer_params (after `release` is set, when `hold`);
    `decode` answers with the body it got."""

    def __init__(self, params: dict | None = None, hold: bool = False):
        self.params, self.hold = params, hold
        self.release = asyncio.Event()
        self.seen: dict[str, list[dict]] = {"prefill": [], "decode": []}
        self.headers: dict[str, list[str]] = {"prefill": [], "decode": []}
        self.keys: dict[str, list[str]] = {"prefill": [], "decode": []}
        self.cancelled = 0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        role = request.url.host
        body = json.loads(request.content)
        self.seen[role].append(body)
        self.headers[role].append(request.headers.get("x-request-id"))
        self.keys[role].append(request.headers.get("authorization"))
        if role == "decode":
            return httpx.Response(200, json={"got": body})
        if self.hold:
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        return httpx.Response(200, json={"choices": [{"text": "a"}], "kv_transfer_params": self.params})


def _flow(script: Script) -> PDFlow:
    client = httpx.AsyncClient(transport=httpx.MockTransport(script))

    def forwarder(role: str) -> Forwarder:
        return Forwarder(WorkerPool.of([f"http://{role}"], HealthConfig()), client, RoundRobin().choose, name=role)
    return PDFlow(forwarder("prefill"), forwarder("decode"))


async def _never() -> None:
    await asyncio.Event().wait()


async def _body(response) -> dict:
    chunks = [chunk async for chunk in response.body_iterator]
    return json.loads(b"".join(c if isinstance(c, bytes) else c.encode() for c in chunks))


def _send(flow: PDFlow, body: dict, headers: dict | None = None, disconnected=_never):
    return flow.forward("/v1/completions", body, json.dumps(body).encode(), headers or {}, RoutingKey("x"),
                        disconnected)


def test_the_prefill_answers_params_go_with_the_original_request_to_decode():
    params = {"do_remote_prefill": True, "remote_block_ids": [3, 4], "remote_engine_id": "p0"}

    async def run():
        script = Script(params)
        body = {"prompt": "x", "max_tokens": 7, "stream": False, "min_tokens": 2}
        got = await _body(await _send(_flow(script), body, {"X-Request-Id": "req-1", "Authorization": "Bearer k"}))
        assert got == {"got": {**body, "kv_transfer_params": params}}
        assert script.seen["prefill"][0]["max_tokens"] == 1
        assert script.headers == {"prefill": ["req-1"], "decode": ["req-1"]}
        assert script.keys == {"prefill": ["Bearer k"], "decode": ["Bearer k"]}  # the client's key, both sides
        # no params (a shared store): the decode instance gets the body as the client sent it
        script.params = None
        assert await _body(await _send(_flow(script), body)) == {"got": body}
        assert script.headers["prefill"][1] == script.headers["decode"][1] is not None
    asyncio.run(run())


def test_a_client_leaving_during_the_prefill_cancels_it_and_sends_nothing_to_decode():
    async def run():
        script = Script(hold=True)
        left = asyncio.Event()

        async def disconnected() -> None:
            while not script.seen["prefill"]:
                await asyncio.sleep(0.01)
            left.set()

        response = await _send(_flow(script), {"prompt": "x"}, disconnected=disconnected)
        assert left.is_set() and response.status_code == 499
        assert script.cancelled == 1 and script.seen["decode"] == []
    asyncio.run(run())


@pytest.mark.parametrize("answer, status", [(httpx.Response(200, content=b"<html>"), 502),
                                             (httpx.Response(200, json=[1]), 502),
                                             (httpx.Response(200, json={"kv_transfer_params": 5}), 502),
                                             (httpx.Response(500, json={"error": {"message": "boom"}}), 502)])
def test_a_prefill_answer_that_is_not_an_openai_answer_is_502(answer, status):
    async def handler(request: httpx.Request) -> httpx.Response:
        return answer

    async def run():
        client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        pools = [Forwarder(WorkerPool.of([f"http://{r}"], HealthConfig()), client, RoundRobin().choose, name=r)
                 for r in ("prefill", "decode")]
        with pytest.raises(APIError) as e:
            await _send(PDFlow(*pools), {"prompt": "x"})
        assert e.value.status_code == status and e.value.code == "worker_failed"
    asyncio.run(run())
