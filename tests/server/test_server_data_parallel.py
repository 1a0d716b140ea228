"""`--data-parallel-size 2` through the server (its app in process, both engine loops on threads): /health lists
each engine, /metrics has each engine's gauges, requests reach both engines, the debug endpoints cover both;
an engine that stops (its loop reports an internal error) fails its requests with a message naming it while
the other serves on, and the server is told only when the last engine is gone. The same with real processes
and a SIGKILL: tests/e2e/test_data_parallel.py."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from kvserve.engine.engine_loop import Stopped
from tests.helpers.server import in_process, metric, wait_idle

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


@pytest.fixture(scope="module")
def server(tiny_llama):
    yield from in_process(tiny_llama[0], "--data-parallel-size", "2", "--stats-interval", "0",
                          "--enable-debug-endpoints")


@pytest.fixture(scope="module")
def http(server):
    with server.http() as c:
        yield c


def _complete(http, prompt: str, max_tokens: int = 4):
    return http.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})


def test_health_metrics_and_debug_cover_every_engine(server, http):
    health = http.get("/health")
    assert health.status_code == 200
    assert [(e["engine"], e["running"]) for e in health.json()["engines"]] == [(0, True), (1, True)]
    prompts = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        assert all(r.status_code == 200 for r in pool.map(lambda p: _complete(http, p, 16), prompts))
    engines = http.get("/health").json()["engines"]
    assert all(e["num_requests_dispatched"] > 0 for e in engines), engines
    wait_idle(http)
    for i in ("0", "1"):
        assert metric(http, "kvserve:engine_healthy", engine=i) == 1
        assert metric(http, "kvserve:engine_kv_cache_request_blocks", engine=i) == 0
    stats = http.get("/debug/prefix-cache").json()
    assert [e["engine"] for e in stats["engines"]] == [0, 1]
    assert stats["total_blocks"] == sum(e["total_blocks"] for e in stats["engines"])
    explained = http.post("/debug/prefix-cache/explain", json={"prompt": prompts[0]}).json()
    assert explained["data_parallel_rank"] in (0, 1)


def test_a_stopped_engine_fails_its_requests_and_the_other_serves_on(server, http):
    dp = server.app.state.kvserve.engine
    victim = dp.engines[1]
    server.call(_stop(victim))
    engines = http.get("/health").json()
    assert engines["status"] == "degraded" and [e["running"] for e in engines["engines"]] == [True, False]
    assert "data-parallel engine 1 of 2" in engines["engines"][1]["error"]
    assert "RuntimeError: injected" in engines["engines"][1]["error"]
    assert "shutting down" not in server.log()  # the server goes on: one engine serves
    for i in range(6):
        assert _complete(http, f"after the fault {i}").status_code == 200
    assert metric(http, "kvserve:engine_healthy", engine="1") == 0
    assert all(e["num_requests_in_flight"] == 0 for e in http.get("/health").json()["engines"])


async def _stop(engine) -> None:
    """What the engine's transport reports when its loop raised; the loop itself then ends (SHUTDOWN)."""
    engine._on_message(Stopped("Traceback (most recent call last):\nRuntimeError: injected"))
    engine._transport.send("shutdown")
