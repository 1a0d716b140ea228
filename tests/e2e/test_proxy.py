"""`kvserve proxy` in front of real prefill and decode instances (`kvserve serve` subprocesses on a tiny
checkpoint, `--kv-transfer-config` kv_producer / kv_consumer), for each connector in CONNECTORS.

Greedy answers through the proxy (52 requests at once: completions and multi-turn chats in groups sharing long
prefixes, repetitive prompts, response_format json_schema, a third streamed) are the same, token for token, as
one engine's, with chunked prefill on the prefill side, speculative decoding (ngram) and a small KV pool
(preemptions) on the decode side, and again with an int8 KV cache (small KV pool, no speculation). The one engine is the prefill instance
itself, asked for the whole answers afterwards: a kv_producer computes as a plain engine does (it only saves
what it computed), and asking it after the disaggregated pass leaves that pass's transfers untouched.
`kvserve router --pd-disaggregation` runs the same flow. Then the faults: a member that stops answering /health (SIGSTOP) leaves rotation and comes back (SIGCONT); a
prefill instance killed after answering; a decode instance killed mid-stream; a client that leaves. Every
surviving instance's free KV block count returns to its starting value.

The servers are started once for the module; the fault tests come last and kill p1, then d1.
"""
from __future__ import annotations

import json
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.helpers.pd import assert_free_blocks_return, free_blocks, start_proxy, stop_servers, transfer_config
from tests.helpers.router import start_router, wait_until
from tests.helpers.server import metric, start_server
from tests.helpers.structured_schemas import SCHEMAS

# The lead adds "NixlConnector" (the network pull connector) here.
CONNECTORS = ["SharedStorageConnector", "NixlConnector"]
NGRAM = ("--speculative-config",
         ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'))
PREFILL_FLAGS = ("--speculative-config", "none", "--max-num-batched-tokens", "32")  # long prompts are chunked
SMALL_KV = ("--num-gpu-blocks-override", "14", "--max-model-len", "224")  # preemptions under 52 requests
INSTANCES = {  # name: (role, flags)
    "p0": ("prefill", PREFILL_FLAGS), "p1": ("prefill", PREFILL_FLAGS),
    "d0": ("decode", (*NGRAM, *SMALL_KV)), "d1": ("decode", NGRAM),
    "p8": ("prefill", (*PREFILL_FLAGS, "--kv-cache-dtype", "int8")),
    # NOTE: no speculation here: an int8 block's scale follows how its tokens were written (kv_cache/quant.py),
    # so k drafted tokens written at once are not bit for bit k tokens written one by one, even on one engine.
    "d8": ("decode", ("--speculative-config", "none", *SMALL_KV, "--kv-cache-dtype", "int8")),
}
FAST_HEALTH = ("--health-check-interval-secs", "0.3", "--health-check-timeout-secs", "1",
               "--health-failure-threshold", "2", "--health-success-threshold", "1")
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


@pytest.fixture(scope="module", params=CONNECTORS)
def instances(request, tiny_llama, tmp_path_factory):
    """name -> Server, and the free block counts they started with."""
    store, logs = tmp_path_factory.mktemp("kv_store"), tmp_path_factory.mktemp("pd_logs")

    def start(name: str):
        role, flags = INSTANCES[name]
        config = transfer_config(request.param, role, store / ("int8" if name.endswith("8") else "fp32"))
        return start_server(tiny_llama[0], logs / f"{name}.log", "--kv-transfer-config", config, *flags,
                            timeout=300)

    with ThreadPoolExecutor(len(INSTANCES)) as pool:
        servers = dict(zip(INSTANCES, pool.map(start, INSTANCES)))
    try:
        for srv in servers.values():  # NOTE: /metrics has the pool's size once the engine has stepped
            httpx.post(f"{srv.base_url}/v1/completions", json={"prompt": "warm", "max_tokens": 1}, timeout=60)
        yield servers, {name: free_blocks(srv) for name, srv in servers.items()}
    finally:
        stop_servers(list(servers.values()))


def _requests() -> list[tuple[str, dict]]:
    """52 requests: 4 groups of 6 completions sharing a long prefix, 2 groups of 6 chats sharing a system prompt
    (half multi-turn, some with max_completion_tokens), 6 repetitive completions (ngram drafts hit; min_tokens),
    6 chats with a json_schema; every third one streamed (with usage)."""
    out = []
    for g in range(4):
        prefix = " ".join(WORDS[(g + i) % len(WORDS)] for i in range(60))
        out += [("/v1/completions", {"prompt": f"{prefix} question {r}: {WORDS[r]}", "max_tokens": 16})
                for r in range(6)]
    for g in range(2):
        system = {"role": "system", "content": " ".join(WORDS[(3 * g + i) % len(WORDS)] for i in range(50))}
        for r in range(6):
            turns = [system, {"role": "user", "content": f"tell me about {WORDS[r]}"}]
            if r % 2:
                turns += [{"role": "assistant", "content": WORDS[r + 1]}, {"role": "user", "content": "more"}]
            limit = "max_completion_tokens" if r % 3 == 0 else "max_tokens"  # the prefill side gets 1 of either
            out.append(("/v1/chat/completions", {"messages": turns, limit: 16}))
    out += [("/v1/completions", {"prompt": " ".join(WORDS[r:r + 4] * 8), "max_tokens": 24, "min_tokens": 8})
            for r in range(6)]  # min_tokens: for the decode side only (1 token on the prefill side)
    for name, prompt, schema in SCHEMAS[:6]:
        out.append(("/v1/chat/completions", {
            "messages": [{"role": "user", "content": prompt}], "max_tokens": 24,
            "response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}}))
    for i, (_, body) in enumerate(out):
        body["temperature"] = 0
        if i % 3 == 2:
            body.update(stream=True, stream_options={"include_usage": True})
    return out


def _answer(base_url: str, path: str, body: dict) -> dict:
    """text, finish_reason and usage of one answer, streamed or not."""
    if not body.get("stream"):
        r = httpx.post(f"{base_url}{path}", json=body, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text = choice["text"] if "text" in choice else choice["message"]["content"]
        return {"text": text, "finish_reason": choice["finish_reason"], "usage": r.json()["usage"]}
    text, finish, usage = "", None, None
    with httpx.stream("POST", f"{base_url}{path}", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            assert "error" not in event, event
            for choice in event["choices"]:
                text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                finish = choice.get("finish_reason") or finish
            usage = event.get("usage") or usage
    return {"text": text, "finish_reason": finish, "usage": usage}


def _answers(base_url: str, requests: list[tuple[str, dict]], concurrency: int = 16) -> list[dict]:
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda item: _answer(base_url, *item), requests))


def _same(ours: list[dict], reference: list[dict]) -> None:
    """Token for token: the texts, finish reasons and token counts (cached tokens differ by design)."""
    def key(a: dict) -> tuple:
        return a["text"], a["finish_reason"], a["usage"]["prompt_tokens"], a["usage"]["completion_tokens"]
    assert [key(a) for a in ours] == [key(a) for a in reference]


def _counter(server, name: str, **labels) -> float:
    with httpx.Client(base_url=server.base_url, timeout=10) as http:
        return metric(http, f"kvserve:{name}", **labels)


def test_disaggregated_answers_are_one_engines(instances, tmp_path):
    servers, start = instances
    proxy = start_proxy([servers["p0"].base_url, servers["p1"].base_url],
                        [servers["d0"].base_url, servers["d1"].base_url], tmp_path / "proxy.log")
    try:
        requests = _requests()
        ours = _answers(proxy.base_url, requests)
        assert all(w["load"] == 0 and w["num_requests_total"] > 0 for w in proxy.workers())
        _same(ours, _answers(servers["p0"].base_url, requests))
        usage = [a["usage"] for a in ours]
        assert all(0 <= u["prompt_tokens_details"]["cached_tokens"] <= u["prompt_tokens"] for u in usage)
        # the decode side computed little of the prompts: their KV came from the prefill side
        assert sum(u["prompt_tokens_details"]["cached_tokens"] for u in usage) >= 0.5 * sum(
            u["prompt_tokens"] for u in usage)
        assert _counter(servers["d0"], "num_preemptions_total") > 0
        assert sum(_counter(servers[d], "spec_decode_num_drafts_total") for d in ("d0", "d1")) > 0
        assert_free_blocks_return({n: servers[n] for n in ("p0", "p1", "d0", "d1")}, start)
    finally:
        assert proxy.stop() == 0, proxy.log()


def test_disaggregated_answers_with_an_int8_kv_cache_are_one_engines(instances, tmp_path):
    servers, start = instances
    proxy = start_proxy([servers["p8"].base_url], [servers["d8"].base_url], tmp_path / "proxy.log",
                        "--policy", "power_of_two")
    try:
        requests = _requests()[::3] + _requests()[1::9]  # every kind of request, some streamed
        # NOTE: one at a time: an int8 block's scale follows how its tokens were written, so where concurrent
        # prompts' chunks split a block decides its codes, on one engine as much as across two
        ours = _answers(proxy.base_url, requests, concurrency=1)
        _same(ours, _answers(servers["p8"].base_url, requests, concurrency=1))
        assert sum(a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in ours) > 0
        assert_free_blocks_return({n: servers[n] for n in ("p8", "d8")}, start)
    finally:
        assert proxy.stop() == 0, proxy.log()


def test_the_router_with_pd_disaggregation_runs_the_same_flow(instances, tmp_path):
    """SGLang's spelling, its default policy (cache_aware: keys from the tokenizer the decode pool names)."""
    servers, start = instances
    router = start_router([], tmp_path / "router.log", "--pd-disaggregation", "--prefill", servers["p0"].base_url,
                          "--decode", servers["d0"].base_url, "--decode", servers["d1"].base_url)
    try:
        requests = _requests()[1::4]
        _same(_answers(router.base_url, requests), _answers(servers["p0"].base_url, requests))
        assert {w["role"] for w in router.workers()} == {"prefill", "decode"}
        assert "routing keys from the tokenizer" in router.log()
        assert_free_blocks_return({n: servers[n] for n in ("p0", "d0", "d1")}, start)
    finally:
        assert router.stop() == 0, router.log()


def test_bad_input_and_empty_pools_are_openai_errors(instances, tmp_path):
    servers, _ = instances
    proxy = start_proxy([servers["p0"].base_url], [servers["d0"].base_url], tmp_path / "proxy.log")
    dead = start_proxy(["http://127.0.0.1:9"], [servers["d0"].base_url], tmp_path / "dead.log")
    try:
        r = httpx.post(f"{proxy.base_url}/v1/completions", content=b"{nope", timeout=30)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        r = httpx.post(f"{proxy.base_url}/v1/completions", json={"prompt": "x", "temperature": -1}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"  # as the prefill side said
        r = httpx.post(f"{proxy.base_url}/v1/chat/completions", json={"messages": "hi"}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        r = httpx.post(f"{proxy.base_url}/v1/completions", json={"prompt": "x", "max_tokens": -2}, timeout=30)
        assert r.status_code == 400  # the decode side refuses what the prefill side (max_tokens 1) accepted
        assert httpx.get(f"{proxy.base_url}/v1/models", timeout=30).json()["data"][0]["id"]
        assert httpx.get(f"{proxy.base_url}/health", timeout=30).status_code == 200
        r = httpx.post(f"{dead.base_url}/v1/completions", json={"prompt": "x"}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_worker"
        assert httpx.get(f"{dead.base_url}/health", timeout=30).status_code == 503
    finally:
        assert proxy.stop() == 0, proxy.log()
        dead.stop()


def test_a_client_leaving_mid_stream_aborts_on_the_decode_side(instances, tmp_path):
    servers, start = instances
    proxy = start_proxy([servers["p0"].base_url], [servers["d1"].base_url], tmp_path / "proxy.log")
    try:
        aborted = _counter(servers["d1"], "request_success_total", finished_reason="abort")
        body = {"prompt": "leave me", "max_tokens": 400, "ignore_eos": True, "stream": True, "temperature": 0}
        with httpx.stream("POST", f"{proxy.base_url}/v1/completions", json=body, timeout=60) as r:
            assert next(r.iter_lines()).startswith("data: ")
        wait_until(lambda: _counter(servers["d1"], "request_success_total", finished_reason="abort") == aborted + 1,
                   15, "the decode instance aborted the request")
        assert_free_blocks_return({n: servers[n] for n in ("p0", "d1")}, start)
    finally:
        assert proxy.stop() == 0, proxy.log()


# ---- faults (last: they stop and kill instances) ------------------------------------------------
def _check_after(proxy, servers: dict, start: dict, survivors: tuple[str, ...]) -> None:
    requests = _requests()[:12:2]
    _same(_answers(proxy.base_url, requests), _answers(servers["p0"].base_url, requests))
    assert_free_blocks_return({n: servers[n] for n in survivors}, start)


def _healthy(proxy) -> dict[str, bool]:
    return {w["url"]: w["healthy"] for w in proxy.workers()}


def _sent(proxy) -> dict[str, int]:
    return {w["url"]: w["num_requests_total"] for w in proxy.workers()}


def test_a_member_that_stops_answering_health_leaves_rotation_and_returns(instances, tmp_path):
    servers, start = instances
    d1 = servers["d1"]
    proxy = start_proxy([servers["p0"].base_url], [servers["d0"].base_url, d1.base_url], tmp_path / "proxy.log",
                        *FAST_HEALTH)
    try:
        d1.proc.send_signal(signal.SIGSTOP)
        wait_until(lambda: not _healthy(proxy)[d1.base_url], 15, "the stopped decode instance out of rotation")
        assert httpx.get(f"{proxy.base_url}/health", timeout=10).status_code == 200
        sent = _sent(proxy)[d1.base_url]
        _check_after(proxy, servers, start, ("p0", "d0"))
        assert _sent(proxy)[d1.base_url] == sent
        d1.proc.send_signal(signal.SIGCONT)
        wait_until(lambda: _healthy(proxy)[d1.base_url], 15, "the decode instance back in rotation")
        _check_after(proxy, servers, start, ("p0", "d0", "d1"))
        assert _sent(proxy)[d1.base_url] > sent
    finally:
        d1.proc.send_signal(signal.SIGCONT)
        assert proxy.stop() == 0, proxy.log()


def test_a_prefill_instance_killed_after_answering(instances, tmp_path):
    servers, start = instances
    p1 = servers["p1"]
    proxy = start_proxy([p1.base_url, servers["p0"].base_url], [servers["d1"].base_url], tmp_path / "proxy.log")
    try:
        body = {"prompt": " ".join(WORDS * 3), "max_tokens": 120, "ignore_eos": True, "temperature": 0}
        reference = _answer(servers["p0"].base_url, "/v1/completions", body)
        text = ""
        with httpx.stream("POST", f"{proxy.base_url}/v1/completions", json={**body, "stream": True},
                          timeout=60) as r:
            for i, line in enumerate(line for line in r.iter_lines() if line.startswith("data: {")):
                if i == 0:  # p1 (round robin's first) has answered: the decode side streams
                    p1.proc.send_signal(signal.SIGKILL)
                event = json.loads(line.removeprefix("data: "))
                assert "error" not in event, event
                text += "".join(c["text"] for c in event["choices"])
        assert text == reference["text"]
        p1.proc.wait(30)
        _check_after(proxy, servers, start, ("p0", "d1"))  # p1 refuses: each request retried on p0
        assert not _healthy(proxy)[p1.base_url]
    finally:
        assert proxy.stop() == 0, proxy.log()


def test_a_decode_instance_killed_mid_stream(instances, tmp_path):
    servers, start = instances
    d1 = servers["d1"]
    proxy = start_proxy([servers["p0"].base_url], [d1.base_url, servers["d0"].base_url], tmp_path / "proxy.log")
    try:
        body = {"prompt": "a long answer", "max_tokens": 400, "ignore_eos": True, "stream": True, "temperature": 0}
        with httpx.stream("POST", f"{proxy.base_url}/v1/completions", json=body, timeout=60) as r:
            events = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
                    if len(events) == 1:  # d1 (round robin's first) is streaming
                        d1.proc.send_signal(signal.SIGKILL)
        error = json.loads(events[-2])["error"]
        assert error["code"] == "worker_failed" and "decode" in error["message"] and events[-1] == "[DONE]"
        d1.proc.wait(30)
        _check_after(proxy, servers, start, ("p0", "d0"))  # d1 refuses: each request retried on d0
        assert not _healthy(proxy)[d1.base_url]
    finally:
        assert proxy.stop() == 0, proxy.log()
