"""`kvserve serve --data-parallel-size 2` (two engine processes behind one API server, a tiny checkpoint):
greedy answers to 52 concurrent requests (completions and multi-turn chats in groups sharing long prefixes, in
chunked prefill) identical, token for token, to one engine's; both engines get work, a shared-prefix group sent
one at a time sticks to one engine, a burst of one prefix is spread within the balance window; an engine
killed: its requests fail naming it, the other engine serves on, /health says which died, and the live
engine's blocks are all free at the end. Also -dp 2 -tp 2 (four processes) against one engine."""
from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from tests.helpers.prefix_workload import WORDS, greedy_answers, prefix_group_requests
from tests.helpers.router import wait_until
from tests.helpers.server import metric, start_server, stop_server

# NOTE: a small step budget, so every long prompt is prefilled in chunks on both servers
FLAGS = ("--max-num-batched-tokens", "32", "--max-num-seqs", "16")


def _requests() -> list[tuple[str, dict]]:
    return prefix_group_requests(prefix_words=70, system_words=50, system_stride=5)


def _post(base_url: str, item: tuple[str, dict]) -> httpx.Response:
    path, body = item
    return httpx.post(f"{base_url}{path}", json=body, timeout=120)


def _engines(base_url: str) -> list[dict]:
    r = httpx.get(f"{base_url}/health", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["engines"]


def _dispatched(base_url: str) -> list[int]:
    return [e["num_requests_dispatched"] for e in _engines(base_url)]


def _assert_blocks_free(base_url: str, engines: list[int]) -> None:
    with httpx.Client(base_url=base_url, timeout=10) as http:
        for i in engines:
            wait_until(lambda i=i: metric(http, "kvserve:engine_kv_cache_request_blocks", engine=str(i)) == 0
                       and metric(http, "kvserve:engine_num_requests_running", engine=str(i)) == 0, 10,
                       f"engine {i} idle with every block free")
        assert metric(http, "kvserve:kv_cache_request_blocks") == 0


@pytest.fixture(scope="module")
def servers(tiny_llama, tmp_path_factory):
    logs = tmp_path_factory.mktemp("dp")
    flags = [FLAGS, (*FLAGS, "--data-parallel-size", "2", "--data-parallel-balance-abs-threshold", "2")]
    with ThreadPoolExecutor(2) as pool:
        one, two = pool.map(lambda i: start_server(tiny_llama[0], logs / f"dp{i}.log", *flags[i], timeout=180),
                            range(2))
    yield one, two
    for srv in (one, two):
        assert stop_server(srv) == 0, srv.log()


def test_two_engines_answer_as_one_and_both_get_work(servers):
    one, two = servers
    requests = _requests()
    reference = greedy_answers(one.base_url, requests)
    before = _dispatched(two.base_url)
    assert greedy_answers(two.base_url, requests) == reference
    counts = [a - b for a, b in zip(_dispatched(two.base_url), before)]
    assert sum(counts) == len(requests) and min(counts) > 0, counts
    assert "data parallel: 2 engines" in two.log()
    _assert_blocks_free(two.base_url, [0, 1])
    with httpx.Client(base_url=two.base_url) as http:  # both engines' prefix caches served the groups' prefixes
        assert metric(http, "kvserve:prefix_cache_hits_total") > 0


def test_a_prefix_group_sent_one_at_a_time_sticks_to_one_engine(servers):
    _, two = servers
    prefix = " ".join(reversed(WORDS * 4))
    before = _dispatched(two.base_url)
    for r in range(6):
        greedy_answers(two.base_url, [("/v1/completions", {"prompt": f"{prefix} {r}", "max_tokens": 2,
                                                      "temperature": 0})], threads=1)
    counts = [a - b for a, b in zip(_dispatched(two.base_url), before)]
    assert sorted(counts) == [0, 6], counts


def test_a_burst_of_one_prefix_is_spread_within_the_window(servers):
    """Affinity would send all 16 to the engine holding the prefix; counted from dispatch, the load passes the
    window (2 requests and 1.5x) after a few, and the other engine takes its share."""
    _, two = servers
    prefix = " ".join(WORDS[::-1] * 3)
    burst = [("/v1/completions", {"prompt": f"{prefix} {r}", "max_tokens": 96, "ignore_eos": True,
                                  "temperature": 0}) for r in range(16)]
    before = _dispatched(two.base_url)
    greedy_answers(two.base_url, burst, threads=16)
    counts = [a - b for a, b in zip(_dispatched(two.base_url), before)]
    assert sum(counts) == 16 and min(counts) >= 5, counts
    _assert_blocks_free(two.base_url, [0, 1])


@pytest.mark.slow  # four processes to start; data parallelism and tensor parallelism each have their fast tests
def test_data_parallel_over_tensor_parallel_engines(servers, tiny_llama, tmp_path):
    """-dp 2 -tp 2: two engines of two ranks each (four processes), the same answers as one engine."""
    one, _ = servers
    requests = _requests()[::4]
    srv = start_server(tiny_llama[0], tmp_path / "dp_tp.log", *FLAGS, "-dp", "2", "-tp", "2", timeout=240)
    try:
        assert greedy_answers(srv.base_url, requests) == greedy_answers(one.base_url, requests)
        assert srv.log().count("tensor parallel: 2 ranks") == 2
        assert min(_dispatched(srv.base_url)) > 0
    finally:
        assert stop_server(srv) == 0, srv.log()


def test_a_killed_engine_fails_its_requests_and_the_other_serves_on(servers):
    """Last in the module: it kills the data-parallel server's engine 1 (the server then still exits 0)."""
    base = servers[1].base_url
    long = [("/v1/completions", {"prompt": f"{WORDS[r]} {WORDS[r + 1]} story {r}", "max_tokens": 300,
                                 "ignore_eos": True, "temperature": 0}) for r in range(8)]
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(_post, base, item) for item in long]
        wait_until(lambda: all(e["num_requests_in_flight"] > 0 for e in _engines(base)), 30,
                   "both engines running requests")
        os.kill(_engines(base)[1]["pid"], signal.SIGKILL)
        results = [f.result() for f in futures]
    failed = [r for r in results if r.status_code != 200]
    assert failed and len(failed) < len(results), [r.status_code for r in results]
    for r in failed:
        assert r.status_code == 503, r.text
        assert "data-parallel engine 1 of 2" in r.json()["error"]["message"], r.text
    health = httpx.get(f"{base}/health", timeout=10).json()
    assert health["status"] == "degraded"
    assert [e["running"] for e in health["engines"]] == [True, False]
    assert "data-parallel engine 1 of 2" in health["engines"][1]["error"]
    more = [("/v1/completions", {"prompt": f"after the fault {r}", "max_tokens": 4, "temperature": 0})
            for r in range(6)]
    assert len(greedy_answers(base, more)) == 6  # every one on the live engine
    _assert_blocks_free(base, [0])
    with httpx.Client(base_url=base) as http:
        assert metric(http, "kvserve:engine_healthy", engine="0") == 1
        assert metric(http, "kvserve:engine_healthy", engine="1") == 0
