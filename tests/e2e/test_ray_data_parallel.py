"""`kvserve serve --data-parallel-size 2 --distributed-executor-backend ray` (skipped without Ray): the two engines
run in Ray actors on a local Ray instance the server starts; greedy answers identical to one engine's, both
engines get work; an actor killed: its requests fail naming the engine and the other serves on; SIGTERM exits 0
(Ray's own signal handlers do not replace the server's)."""
from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("ray")

from tests.helpers.prefix_workload import prefix_group_requests  # noqa: E402
from tests.helpers.router import wait_until  # noqa: E402
from tests.helpers.server import in_process, start_server, stop_server  # noqa: E402

pytestmark = pytest.mark.ray


def _engines(base_url: str) -> list[dict]:
    return httpx.get(f"{base_url}/health", timeout=10).json()["engines"]


def test_engines_on_ray_actors(tiny_llama, tmp_path):
    model = tiny_llama[0]
    requests = prefix_group_requests()[::3]
    env_ray = {k: v for k, v in os.environ.items() if k == "RAY_ADDRESS"}
    assert not env_ray, "the test starts its own local Ray"
    srv = start_server(model, tmp_path / "dp_ray.log", "-dp", "2", "--distributed-executor-backend", "ray",
                       timeout=300)
    try:
        gen = in_process(model)
        reference_server = next(gen)
        try:
            with reference_server.http() as http:
                reference = [_answer(http, item) for item in requests]
        finally:
            gen.close()
        with httpx.Client(base_url=srv.base_url, timeout=120) as http:
            with ThreadPoolExecutor(6) as pool:
                assert list(pool.map(lambda item: _answer(http, item), requests)) == reference
        engines = _engines(srv.base_url)
        assert all(e["num_requests_dispatched"] > 0 for e in engines), engines
        assert "2 engines of 1 threads each (Ray actors)" in srv.log()
        long = [{"prompt": f"story number {r}", "max_tokens": 300, "ignore_eos": True} for r in range(6)]
        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(httpx.post, f"{srv.base_url}/v1/completions", json=b, timeout=120) for b in long]
            wait_until(lambda: all(e["num_requests_in_flight"] > 0 for e in _engines(srv.base_url)), 30,
                       "both engines running requests")
            os.kill(_engines(srv.base_url)[1]["pid"], signal.SIGKILL)
            results = [f.result() for f in futures]
        failed = [r for r in results if r.status_code != 200]
        assert failed and len(failed) < len(results)
        assert all("data-parallel engine 1 of 2" in r.json()["error"]["message"] for r in failed)
        assert [e["running"] for e in _engines(srv.base_url)] == [True, False]
        after = httpx.post(f"{srv.base_url}/v1/completions", json={"prompt": "after", "max_tokens": 2}, timeout=60)
        assert after.status_code == 200, after.text
    finally:
        assert stop_server(srv) == 0, srv.log()


def _answer(http: httpx.Client, item: tuple[str, dict]) -> str:
    path, body = item
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]
