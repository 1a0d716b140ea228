"""`kvserve router` in front of two `kvserve serve` workers (subprocesses, a tiny checkpoint): every policy's
greedy answers to 52 requests (completions and multi-turn chats in groups sharing long prefixes) are the
same, token for token, as one engine's; a worker killed: requests go to the other, and its return is noticed."""
from __future__ import annotations

import json
import signal

import httpx
import pytest
from tests.helpers.prefix_workload import greedy_answers, prefix_group_requests
from tests.helpers.router import start_router, start_workers, wait_until
from tests.helpers.server import start_server, stop_server

EVENTS = ("--kv-events-config", '{"enable_kv_cache_events": true}')
FAST_HEALTH = ("--health-check-interval-secs", "0.3", "--health-failure-threshold", "2",
               "--health-success-threshold", "1")
@pytest.fixture(scope="module")
def workers(tiny_llama, tmp_path_factory):
    servers = start_workers(tiny_llama[0], tmp_path_factory.mktemp("workers"), 2, *EVENTS)
    yield servers
    for srv in servers:
        stop_server(srv)


@pytest.fixture(scope="module")
def reference(workers):
    return greedy_answers(workers[0].base_url, prefix_group_requests())


@pytest.mark.parametrize("policy", ["round_robin", "power_of_two", "cache_aware", "precise"])
def test_every_policy_answers_as_one_engine(policy, workers, reference, tmp_path):
    router = start_router([w.base_url for w in workers], tmp_path / "router.log", "--policy", policy)
    try:
        before = sum(w["num_requests_total"] for w in router.workers())
        assert greedy_answers(router.base_url, prefix_group_requests()) == reference
        counts = [w["num_requests_total"] for w in router.workers()]
        assert sum(counts) - before == len(reference)
        assert all(w["load"] == 0 for w in router.workers())
        if policy in ("round_robin", "power_of_two"):
            assert min(counts) > 0, counts
        if policy == "precise":  # the router learned the workers' blocks from their KV events
            assert sum(w["num_cached_blocks"] for w in router.workers()) > 0
        models = httpx.get(f"{router.base_url}/v1/models", timeout=10).json()
        assert models["data"][0]["id"]
        stream = _stream(router.base_url)
        assert stream[-1] == "[DONE]" and json.loads(stream[0])["choices"]
    finally:
        assert router.stop() == 0, router.log()


def _stream(base_url: str) -> list[str]:
    body = {"prompt": "stream me", "max_tokens": 4, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]


def test_bad_requests_and_no_worker_are_openai_errors(workers, tmp_path):
    router = start_router(["http://127.0.0.1:9"], tmp_path / "router.log", "--policy", "round_robin")
    try:
        r = httpx.post(f"{router.base_url}/v1/completions", content=b"{nope", timeout=10)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        r = httpx.post(f"{router.base_url}/v1/completions", json={"prompt": "x"}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_worker"
        assert httpx.get(f"{router.base_url}/health", timeout=10).status_code == 503
    finally:
        router.stop()


@pytest.mark.slow  # a worker restart; the same faults in process, fast: tests/server/test_router_app.py
def test_a_killed_worker_is_routed_around_and_its_return_noticed(workers, tiny_llama, tmp_path):
    router = start_router([w.base_url for w in workers], tmp_path / "router.log", "--policy", "round_robin",
                          *FAST_HEALTH)
    try:
        victim = workers[1]
        port = victim.base_url.rsplit(":", 1)[1]
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(30)
        requests = prefix_group_requests()[:10]
        assert greedy_answers(router.base_url, requests) == greedy_answers(workers[0].base_url, requests)
        wait_until(lambda: not router.workers()[1]["healthy"], 10, "the dead worker is out of rotation")
        workers[1] = start_server(tiny_llama[0], tmp_path / "back.log", "--port", port, *EVENTS, timeout=120)
        wait_until(lambda: router.workers()[1]["healthy"], 15, "the returned worker is back in rotation")
        before = router.workers()[1]["num_requests_total"]
        greedy_answers(router.base_url, requests)
        assert router.workers()[1]["num_requests_total"] > before
    finally:
        assert router.stop() == 0, router.log()
