"""`kvserve router` (a subprocess) under faults and bursts: a replica that stops answering /health (it hangs, or
answers 503) leaves rotation and comes back when it answers again (fake replicas whose health a test switches:
tests/helpers/fake_worker.py); a burst of requests sharing one hot prefix is split inside the
balance window on real replicas (a tiny checkpoint), and every replica's KV blocks are free at the end."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from tests.helpers.fake_worker import FakeWorker
from tests.helpers.router import start_router, start_workers, wait_until
from tests.helpers.server import metric, stop_server, wait_idle

FAST_HEALTH = ("--health-check-interval-secs", "0.1", "--health-check-timeout-secs", "0.5",
               "--health-failure-threshold", "2", "--health-success-threshold", "2")
EVENTS = ("--kv-events-config", '{"enable_kv_cache_events": true}')


@pytest.fixture
def fakes():
    workers = [FakeWorker(f"w{i}").start() for i in range(2)]
    yield workers
    for w in workers:
        w.stop()


def _send(router, n: int) -> list[str]:
    out = []
    for i in range(n):
        r = httpx.post(f"{router.base_url}/v1/completions", json={"prompt": f"p{i}", "max_tokens": 1}, timeout=10)
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["text"])
    return out


@pytest.mark.parametrize("failure", ["hang", "error"])
def test_a_replica_that_stops_answering_health_leaves_rotation_and_returns(fakes, failure, tmp_path):
    router = start_router([w.base_url for w in fakes], tmp_path / "router.log", "--policy", "round_robin",
                          *FAST_HEALTH)
    try:
        assert set(_send(router, 4)) == {"w0", "w1"}
        fakes[1].health = failure
        wait_until(lambda: not router.workers()[1]["healthy"], 10, "the silent replica is out of rotation")
        before = fakes[1].num_completions
        assert set(_send(router, 6)) == {"w0"}
        assert fakes[1].num_completions == before  # it still serves completions: health alone took it out
        fakes[1].health = "ok"
        wait_until(lambda: router.workers()[1]["healthy"], 10, "the replica is back in rotation")
        assert set(_send(router, 4)) == {"w0", "w1"}
        assert all(w["load"] == 0 for w in router.workers())
    finally:
        assert router.stop() == 0, router.log()


def test_with_every_replica_silent_the_router_answers_503_then_recovers(fakes, tmp_path):
    router = start_router([w.base_url for w in fakes], tmp_path / "router.log", "--policy", "cache_aware",
                          *FAST_HEALTH)
    try:
        for w in fakes:
            w.health = "hang"
        wait_until(lambda: httpx.get(f"{router.base_url}/health", timeout=5).status_code == 503, 10,
                   "the router reports no healthy replica")
        r = httpx.post(f"{router.base_url}/v1/completions", json={"prompt": "x"}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_worker"
        fakes[0].health = "ok"
        wait_until(lambda: httpx.get(f"{router.base_url}/health", timeout=5).status_code == 200, 10,
                   "the router is healthy again")
        assert set(_send(router, 3)) == {"w0"}
    finally:
        for w in fakes:
            w.health = "ok"
        assert router.stop() == 0, router.log()


def _loads_sampler(router, stop: threading.Event, seen: list[list[int]]) -> None:
    with httpx.Client(timeout=5) as http:
        while not stop.is_set():
            seen.append([w["load"] for w in http.get(f"{router.base_url}/workers").json()["workers"]])


@pytest.fixture(scope="module")
def replicas(tiny_llama, tmp_path_factory):
    servers = start_workers(tiny_llama[0], tmp_path_factory.mktemp("replicas"), 2, *EVENTS)
    yield servers
    for srv in servers:
        assert stop_server(srv) == 0, srv.log()


@pytest.mark.parametrize("policy", ["cache_aware", "precise"])
def test_a_hot_prefix_burst_stays_inside_the_balance_window_and_frees_every_block(policy, replicas, tmp_path):
    abs_threshold, rel_threshold = 1, 1.5
    router = start_router([r.base_url for r in replicas], tmp_path / "router.log", "--policy", policy,
                          "--balance-abs-threshold", str(abs_threshold),
                          "--balance-rel-threshold", str(rel_threshold), "--cache-threshold", "0.2")
    prefix = " ".join(f"{policy} hot shared prefix word {i}" for i in range(30))
    before = [w["num_requests_total"] for w in router.workers()]
    seen: list[list[int]] = []
    stop = threading.Event()
    sampler = threading.Thread(target=_loads_sampler, args=(router, stop, seen))
    sampler.start()
    try:
        def one(i: int) -> int:
            body = {"prompt": f"{prefix} question {i}", "max_tokens": 8, "ignore_eos": True, "temperature": 0}
            return httpx.post(f"{router.base_url}/v1/completions", json=body, timeout=120).status_code

        # NOTE: every request is sent at once, so all are in flight together: the split is the router's choice,
        # not an effect of which replica happened to finish first
        with ThreadPoolExecutor(24) as pool:
            assert set(pool.map(one, range(24))) == {200}
    finally:
        stop.set()
        sampler.join()
    try:
        counts = [w["num_requests_total"] - b for w, b in zip(router.workers(), before)]
        assert sum(counts) == 24 and min(counts) > 0, counts  # a herd would put every request on one replica
        assert max(sum(s) for s in seen) >= 8, "the burst never overlapped: nothing was tested"
        assert max(counts) <= rel_threshold * min(counts), counts  # the load skew
        assert all(w["load"] == 0 for w in router.workers())
        for r in replicas:
            with httpx.Client(base_url=r.base_url, timeout=10) as http:
                wait_idle(http)
                assert metric(http, "kvserve:kv_cache_request_blocks") == 0
                assert metric(http, "kvserve:prefix_cache_hits_total") > 0  # the prefix was shared
    finally:
        assert router.stop() == 0, router.log()
