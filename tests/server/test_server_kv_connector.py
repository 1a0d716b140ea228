"""kv_transfer_params through the OpenAI API (vLLM's extra field both ways): the request's reaches the KV
connector, the connector's comes back on the response."""
from __future__ import annotations

import json

import pytest

from tests.helpers.server import in_process

CONNECTOR = {"kv_connector": "DelayingConnector", "kv_role": "kv_producer", "engine_id": "prefill-7",
             "kv_connector_module_path": "tests.helpers.kv_connectors"}


@pytest.fixture(scope="module")
def server(tiny_llama):
    yield from in_process(tiny_llama[0], "--kv-transfer-config", json.dumps(CONNECTOR))


def test_completion_carries_kv_transfer_params_both_ways(server):
    with server.http() as http:
        body = {"model": http.get("/v1/models").json()["data"][0]["id"], "prompt": "hello there " * 8,
                "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        params = r.json()["kv_transfer_params"]
        assert params["remote_engine_id"] == "prefill-7" and params["remote_block_ids"]
        assert params["asked"] == {"do_remote_decode": True}
        chat = dict(body, messages=[{"role": "user", "content": "hi"}])
        del chat["prompt"]
        r = http.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200, r.text
        assert r.json()["kv_transfer_params"]["asked"] == {"do_remote_decode": True}


def test_a_request_without_them_tells_the_connector_none(server):
    with server.http() as http:
        body = {"model": http.get("/v1/models").json()["data"][0]["id"], "prompt": "hi", "max_tokens": 1}
        r = http.post("/v1/completions", json=body)
        assert r.json()["kv_transfer_params"]["asked"] is None
