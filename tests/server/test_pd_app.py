"""`kvserve proxy` / `kvserve router --pd-disaggregation` in process, in front of scripted prefill and decode
workers (an httpx transport, no sockets): retries before anything reached the client, a decode stream cut
midway, members that die and come back, errors as OpenAI JSON; the flags."""
from __future__ import annotations

import argparse
import json
from collections import Counter

import httpx
import pytest
from fastapi.testclient import TestClient

from kvserve.router.app import build_router_app
from kvserve.router.config import RouterConfig
from kvserve.router.pd_cli import add_arguments
from tests.helpers.router import scripted_stream, wait_until

PREFILL = ("http://p0", "http://p1")
DECODE = ("http://d0", "http://d1")
DECODE_HOSTS = {"d0", "d1"}


class ScriptedPools:
    """Prefill workers answer one token and kv_transfer_params naming themselves; decode workers answer (or
    stream) the name of the prefill worker whose params they got and their own. `dead` refuse connections,
    `bad` prefill workers answer 400 as a server does for a bad body, `cut` decode workers drop the stream
    after one event."""

    def __init__(self):
        self.dead: set[str] = set()
        self.cut: set[str] = set()
        self.calls: Counter = Counter()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if host in self.dead:
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path == "/health":
            return httpx.Response(200)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": host, "root": "/nowhere"}]})
        self.calls[host] += 1
        body = json.loads(request.content)
        if host.startswith("p"):
            if body.get("temperature", 0) < 0:
                return httpx.Response(400, json={"error": {"message": "temperature must be non-negative",
                                                           "type": "invalid_request_error", "param": "temperature",
                                                           "code": None}})
            return httpx.Response(200, json={"choices": [{"text": "t"}], "kv_transfer_params": {"remote_engine_id": host}})
        text = f"{body['kv_transfer_params']['remote_engine_id']}>{host}"
        if body.get("stream"):
            return scripted_stream(text, request, cut=host in self.cut)
        return httpx.Response(200, json={"choices": [{"text": text}], "usage": {"prompt_tokens": 1}})


@pytest.fixture
def pools():
    return ScriptedPools()


def _proxy(pools: ScriptedPools, **overrides) -> TestClient:
    config = RouterConfig(pd_disaggregation=True, prefill=PREFILL, decode=DECODE, policy="round_robin",
                          health_check_interval_secs=0.05, health_failure_threshold=2, health_success_threshold=1,
                          **overrides)
    return TestClient(build_router_app(config, transport=httpx.MockTransport(pools)))


def _text(client: TestClient, **body) -> str:
    r = client.post("/v1/completions", json={"prompt": "x", **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _health(client: TestClient) -> dict[str, bool]:
    return {w["url"].removeprefix("http://"): w["healthy"] for w in client.get("/workers").json()["workers"]}


def test_each_request_is_prefilled_on_one_pool_and_decoded_on_the_other(pools):
    with _proxy(pools) as client:
        assert [_text(client) for _ in range(4)] == ["p0>d0", "p1>d1", "p0>d0", "p1>d1"]
        roles = {w["url"]: w["role"] for w in client.get("/workers").json()["workers"]}
        assert roles == {"http://p0": "prefill", "http://p1": "prefill", "http://d0": "decode", "http://d1": "decode"}
        assert client.get("/health").status_code == 200
        assert client.get("/v1/models").json()["data"][0]["id"] in ("d0", "d1")  # a decode instance's
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "p0>d0"


def test_a_dead_member_of_either_pool_is_retried_around_then_noticed_back(pools):
    with _proxy(pools) as client:
        pools.dead.update({"p1", "d0"})
        assert {_text(client) for _ in range(6)} == {"p0>d1"}
        assert _health(client) == {"p0": True, "p1": False, "d0": False, "d1": True}
        pools.dead.clear()
        wait_until(lambda: all(_health(client).values()), 5, "the members back in rotation")
        assert {_text(client) for _ in range(4)} == {"p0>d0", "p1>d1"}
        assert all(w["load"] == 0 for w in client.get("/workers").json()["workers"])


def test_a_bad_body_is_answered_as_the_prefill_instance_answered_it(pools):
    with _proxy(pools) as client:
        r = client.post("/v1/completions", json={"prompt": "x", "temperature": -1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
        assert sum(n for host, n in pools.calls.items() if host.startswith("d")) == 0
        for raw in (b"{nope", b"[1]"):
            r = client.post("/v1/completions", content=raw)
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_an_empty_pool_is_503_and_a_failing_one_502(pools):
    with _proxy(pools) as client:
        pools.dead.update(DECODE_HOSTS)
        r = client.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 502 and r.json()["error"]["code"] == "worker_failed"
        assert "decode" in r.json()["error"]["message"]
        r = client.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["message"] == "no healthy decode"
        assert client.get("/health").status_code == 503
        pools.dead = {"p0", "p1"}
        wait_until(lambda: _health(client) == {"p0": False, "p1": False, "d0": True, "d1": True}, 5,
                   "decode back, prefill out")
        r = client.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["message"] == "no healthy prefill"


def test_a_decode_stream_cut_midway_ends_with_an_error_event_and_done(pools):
    with _proxy(pools) as client:
        pools.cut.update(DECODE_HOSTS)
        with client.stream("POST", "/v1/completions", json={"prompt": "x", "stream": True}) as r:
            events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
        assert json.loads(events[0])["choices"][0]["text"] == "p0>d0"
        error = json.loads(events[1])["error"]
        assert error["code"] == "worker_failed" and "decode" in error["message"] and events[-1] == "[DONE]"
        assert all(w["load"] == 0 for w in client.get("/workers").json()["workers"])


def _parse(*argv: str) -> RouterConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return RouterConfig.from_cli(parser.parse_args(argv))


def test_the_proxy_flags():
    config = _parse("--prefill", "http://a:1", "--prefill", "b:2", "--decode", "http://c:3", "--port", "0")
    assert config.pd_disaggregation and config.policy == "round_robin"
    assert config.pools() == [("prefill", ("http://a:1", "http://b:2"), "round_robin"),
                              ("decode", ("http://c:3",), "round_robin")]
    assert _parse("--prefill", "http://a", "--decode", "http://c", "--decode-policy", "power_of_two").pools()[1][2] \
        == "power_of_two"
    with pytest.raises(ValueError, match="at least one --prefill and one --decode"):
        _parse("--prefill", "http://a")
    with pytest.raises(ValueError, match="--decode must be an http"):
        _parse("--prefill", "http://a", "--decode", "ftp://c")
    with pytest.raises(ValueError, match="bootstrap port has no use here"):
        _parse("--prefill", "http://a", "8998", "--decode", "http://c")


def test_the_routers_pd_flags_are_checked():
    with pytest.raises(ValueError, match="--worker is not used"):
        RouterConfig(worker=("http://w",), pd_disaggregation=True, prefill=("http://a",), decode=("http://b",))
    with pytest.raises(ValueError, match="need --pd-disaggregation"):
        RouterConfig(worker=("http://w",), prefill=("http://a",))
    with pytest.raises(ValueError, match="--prefill-policy must be one of"):
        RouterConfig(pd_disaggregation=True, prefill=("http://a",), decode=("http://b",), prefill_policy="lru")
