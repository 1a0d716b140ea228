"""The router's app in process, in front of scripted workers (an httpx transport, no sockets): what it does when
a worker dies before answering, answers 503, dies mid-stream, or comes back; errors as OpenAI JSON."""
from __future__ import annotations

import json
import time
from collections import Counter

import httpx
import pytest
from fastapi.testclient import TestClient

from kvserve.router.app import build_router_app
from kvserve.router.config import RouterConfig
from tests.helpers.router import scripted_stream

URLS = ["http://w0", "http://w1"]


class ScriptedWorkers:
    """Two workers: each answers /health, /v1/models and completions (its own name as the text) unless `dead`;
    `busy` ones answer 503; `cut` ones stream one event and then drop the connection."""

    def __init__(self):
        self.dead: set[str] = set()
        self.busy: set[str] = set()
        self.cut: set[str] = set()
        self.completions: Counter = Counter()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if host in self.dead:
            raise httpx.ConnectError("connection refused", request=request)
        path = request.url.path
        if path == "/health":
            return httpx.Response(200)
        if path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "m", "root": "/nowhere/model"}]})
        if host in self.busy:
            return httpx.Response(503, json={"error": {"message": "draining"}})
        self.completions[host] += 1
        body = json.loads(request.content)
        if body.get("stream"):
            return scripted_stream(host, request, cut=host in self.cut)
        return httpx.Response(200, json={"choices": [{"text": host, "finish_reason": "length"}]})


@pytest.fixture
def workers():
    return ScriptedWorkers()


def _router(workers: ScriptedWorkers, policy: str = "round_robin") -> TestClient:
    config = RouterConfig(worker=tuple(URLS), policy=policy, health_check_interval_secs=0.05,
                          health_failure_threshold=2, health_success_threshold=1)
    return TestClient(build_router_app(config, transport=httpx.MockTransport(workers)))


def _wait(predicate, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _healthy(client: TestClient) -> list[bool]:
    return [w["healthy"] for w in client.get("/workers").json()["workers"]]


def test_a_dead_worker_is_retried_around_then_noticed_back(workers):
    with _router(workers) as client:
        workers.dead.add("w1")
        texts = [client.post("/v1/completions", json={"prompt": "x"}).json()["choices"][0]["text"]
                 for _ in range(6)]
        assert texts == ["w0"] * 6
        assert _healthy(client) == [True, False]
        workers.dead.clear()
        _wait(lambda: _healthy(client) == [True, True], "the worker back in rotation")
        texts = {client.post("/v1/completions", json={"prompt": "x"}).json()["choices"][0]["text"] for _ in range(4)}
        assert texts == {"w0", "w1"}
        assert all(w["load"] == 0 for w in client.get("/workers").json()["workers"])


def test_a_503_from_a_worker_is_retried_on_another(workers):
    with _router(workers) as client:
        workers.busy.add("w0")
        answers = [client.post("/v1/completions", json={"prompt": "x"}) for _ in range(3)]
        assert [a.json()["choices"][0]["text"] for a in answers] == ["w1"] * 3


def test_every_worker_failing_is_502_and_none_healthy_is_503(workers):
    with _router(workers) as client:
        workers.dead.update({"w0", "w1"})
        r = client.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 502 and r.json()["error"]["code"] == "worker_failed"
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_worker"
        assert client.get("/health").status_code == 503
        assert client.get("/v1/models").status_code == 503


def test_a_stream_cut_midway_ends_with_an_error_event_and_done(workers):
    with _router(workers) as client:
        workers.cut.update({"w0", "w1"})
        with client.stream("POST", "/v1/completions", json={"prompt": "x", "stream": True}) as r:
            events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
        assert json.loads(events[0])["choices"][0]["text"] in ("w0", "w1")
        assert json.loads(events[1])["error"]["code"] == "worker_failed" and events[-1] == "[DONE]"
        assert all(w["load"] == 0 for w in client.get("/workers").json()["workers"])


def test_bodies_that_are_not_json_objects_are_400(workers):
    with _router(workers, policy="cache_aware") as client:
        for body in (b"{nope", b"[1, 2]"):
            r = client.post("/v1/completions", content=body)
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        assert sum(workers.completions.values()) == 0
        assert client.get("/v1/models").json()["data"][0]["id"] == "m"


def test_a_client_leaving_mid_stream_frees_the_workers_load(workers):
    with _router(workers) as client:
        with client.stream("POST", "/v1/completions", json={"prompt": "x", "stream": True}) as r:
            assert next(r.iter_lines()).startswith("data: ")
        _wait(lambda: all(w["load"] == 0 for w in client.get("/workers").json()["workers"]), "load back to 0")
