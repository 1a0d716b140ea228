"""The pull connector under tensor parallelism (TP=2 on both sides; one TP engine per process, so the decode side
is a `kvserve serve` process): each decode rank pulls its own KV heads from the same prefill rank, and the text
equals a TP=1 engine's without a connector. With only the prefill driver's side channel gone, rank 0's pull fails
and rank 1's succeeds: the ranks agree, the decode side recomputes, and the prefill side frees its blocks once
both ranks' leases expire. Every block free on both sides."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

from kvserve.config import EngineArgs
from kvserve.engine.engine import Engine
from tests.helpers.kv_pull import assert_all_blocks_free, greedy, pull_config, step_all
from tests.helpers.router import wait_until
from tests.helpers.server import metric, start_server, stop_server, wait_idle
from tests.helpers.tensor_parallel import TP_ARGS

REQS = [(list(range(100, 126)), 6), (list(range(900, 913)), 5), (list(range(200, 237)), 4)]
FAULT_REQS = [(list(range(300, 330)), 5), (list(range(50, 71)), 4)]  # in neither side's prefix cache
_SERVE_TP = ("--tensor-parallel-size", "2", "--block-size", "4", "--max-num-batched-tokens", "24")


def _reference(path: str, reqs) -> list[str]:
    one = Engine(EngineArgs(model=path, **TP_ARGS))
    for i, (prompt, max_tokens) in enumerate(reqs):
        one.add_request(str(i), prompt, greedy(max_tokens))
    done = step_all([one], None)
    return [done[str(i)].outputs[0].text for i in range(len(reqs))]


def _decode_over_http(prefill: Engine, decode, reqs) -> list[tuple[str, int]]:
    """Prefill in process, then each request to the decode server while the prefill engine keeps stepping (it
    serves the blocks and hears the decode side's notifications from its engine loop)."""
    for i, (prompt, _) in enumerate(reqs):
        prefill.add_request(f"p{i}", prompt, greedy(1, {"do_remote_decode": True}))
    answers = step_all([prefill], lambda d: len(d) == len(reqs))

    def ask(i):
        prompt, max_tokens = reqs[i]
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "kv_transfer_params": answers[f"p{i}"].kv_transfer_params}
        with decode.http(timeout=120) as http:
            r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"], r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    with ThreadPoolExecutor(len(reqs)) as pool:
        futures = [pool.submit(ask, i) for i in range(len(reqs))]
        step_all([prefill], lambda _: all(f.done() for f in futures))
        texts = [f.result() for f in futures]
    step_all([prefill], None)
    return texts


def test_tp2_pull_matches_tp1_and_a_failure_on_one_rank_fails_on_both(tiny_llama, tmp_path):
    path = tiny_llama[0]
    want = _reference(path, REQS + FAULT_REQS)
    decode = start_server(path, tmp_path / "decode.log", *_SERVE_TP, "--kv-transfer-config",
                          json.dumps(pull_config("kv_consumer", lease_s=2.0)), timeout=240)
    prefill = Engine(EngineArgs(model=path, tensor_parallel_size=2, **TP_ARGS,
                                kv_transfer_config=pull_config("kv_producer", lease_s=2.0)))
    try:
        pulled = [len(p) - 1 for p, _ in REQS]
        assert _decode_over_http(prefill, decode, REQS) == list(zip(want, pulled))
        assert_all_blocks_free(prefill)
        prefill.core.executor.worker.shutdown_kv_connector()  # the driver's side channel only
        recomputed = [0] * len(FAULT_REQS)
        assert _decode_over_http(prefill, decode, FAULT_REQS) == list(zip(want[len(REQS):], recomputed))
        assert_all_blocks_free(prefill)  # rank 1's were read, rank 0's lease expired
        with decode.http() as http:
            wait_idle(http)
            wait_until(lambda: metric(http, "kvserve:kv_cache_usage_perc") == 0, 10, "the decode side frees")
        assert "KV pull" in decode.log() and "failed" in decode.log()
    finally:
        prefill.shutdown()
        stop_server(decode)
