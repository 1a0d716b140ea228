"""Disaggregated prefill over HTTP: two `kvserve serve` processes with vLLM's NixlConnector config (kvserve's
TCP pull connector). A completion and a chat prefilled on one (max_tokens 1, do_remote_decode) and decoded on the
other with the answer's kv_transfer_params give one engine's text, with the prompt's KV pulled (cached_tokens);
with the prefill instance killed after answering, the decode instance recomputes. Every block free on both."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers.router import wait_until
from tests.helpers.server import metric, start_server, stop_server, wait_idle

PROMPT = " ".join(["alpha bravo charlie delta echo foxtrot"] * 12)
CHAT = [{"role": "system", "content": "golf hotel india juliet " * 10}, {"role": "user", "content": "kilo lima"}]


def _pull(role: str) -> tuple[str, str]:
    return "--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector", "kv_role": role, "kv_port": 0,
                                               "kv_connector_extra_config": {"lease_s": 5}})


@pytest.fixture(scope="module")
def pair(tiny_llama, tmp_path_factory):
    """One prefill and one decode instance for the module (the last test kills the prefill one)."""
    logs = tmp_path_factory.mktemp("kv_pull")
    with ThreadPoolExecutor(2) as pool:
        servers = list(pool.map(lambda role: start_server(tiny_llama[0], logs / f"{role}.log", *_pull(role),
                                                          timeout=180), ("kv_producer", "kv_consumer")))
    yield servers
    for srv in servers:
        stop_server(srv)


def _ask(srv, path: str, body: dict) -> dict:
    with srv.http() as http:
        r = http.post(path, json=body | {"temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def _text(answer: dict) -> str:
    choice = answer["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def _assert_all_blocks_free(*servers) -> None:
    for srv in servers:
        with srv.http() as http:
            wait_idle(http)
            wait_until(lambda: metric(http, "kvserve:kv_cache_usage_perc") == 0, 10, f"{srv.base_url} frees its blocks")


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": PROMPT}),
                                        ("/v1/chat/completions", {"messages": CHAT})], ids=["completion", "chat"])
def test_prefill_then_decode_over_http(pair, path, body):
    prefill, decode = pair
    want = _text(_ask(prefill, path, body | {"max_tokens": 8}))
    first = _ask(prefill, path, body | {"max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    params = first["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_block_ids"] and params["remote_port"] > 0
    answer = _ask(decode, path, body | {"max_tokens": 8, "kv_transfer_params": params})
    assert _text(answer) == want
    usage = answer["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1  # all but the last: pulled
    _assert_all_blocks_free(prefill, decode)


def test_prefill_instance_killed_after_answering(pair):
    prefill, decode = pair
    body = {"prompt": " ".join(["mike november oscar papa quebec romeo"] * 12)}  # not in either prefix cache
    want = _text(_ask(prefill, "/v1/completions", body | {"max_tokens": 8}))
    params = _ask(prefill, "/v1/completions", body | {"max_tokens": 1, "kv_transfer_params": {
        "do_remote_decode": True}})["kv_transfer_params"]
    prefill.proc.kill()
    prefill.proc.wait(30)
    answer = _ask(decode, "/v1/completions", body | {"max_tokens": 8, "kv_transfer_params": params})
    assert _text(answer) == want  # recomputed (kv_load_failure_policy recompute)
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert "KV pull" in decode.log()
    _assert_all_blocks_free(decode)
