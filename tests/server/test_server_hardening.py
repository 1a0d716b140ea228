"""Issue 9: no request can take the server down.

Each test sends exactly what a hostile probe sent (or what a limit bounds) to the server (its app in
process, the engine loop on a thread), checks the precise 4xx, and then checks that an ordinary request
still works: the engine is alive and unharmed. Shutdown on SIGTERM, engine death and the CLI's own
failures need a real process: tests/e2e/test_server_process.py.
"""
from __future__ import annotations

import json
import math
import threading
import time

import httpx
import pytest
from tests.helpers.server import API_KEY, AppServer, in_process, metric, sse_events, wait_idle

LIMIT_FLAGS = ("--max-n", "4", "--max-queue-len", "8", "--max-num-seqs", "8", "--max-stop-strings", "2",
               "--max-stop-string-length", "8", "--max-messages", "3", "--max-logit-bias", "2",
               "--max-tokens-limit", "200", "--enable-debug-endpoints", "--stats-interval", "0")


@pytest.fixture(scope="module")
def server(tiny_llama):
    yield from in_process(tiny_llama[0], *LIMIT_FLAGS)


@pytest.fixture(scope="module")
def http(server):
    with server.http() as client:
        yield client


def still_serves(http: httpx.Client) -> None:
    """An ordinary request works and /health is 200: the engine survived."""
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), body
    return body["error"]


def raw_post(http: httpx.Client, path: str, text: str) -> httpx.Response:
    """A body as written (JSON's NaN and huge integers go through unchanged)."""
    return http.post(path, content=text.encode(), headers={"content-type": "application/json"})


# ---- the probe's inputs ----------------------------------------------------------------------
def test_negative_stop_token_id_is_a_400_not_a_dead_engine(http):
    body = {"prompt": "hi", "max_tokens": 4, "min_tokens": 2, "stop_token_ids": [-1000000]}
    err = error_of(http.post("/v1/completions", json=body), 400)
    assert "stop_token_ids" in err["message"] and err["param"] == "stop_token_ids"
    err = error_of(http.post("/v1/completions", json={**body, "stop_token_ids": [10**9]}), 400)
    assert "stop_token_ids" in err["message"]
    still_serves(http)


def test_explain_with_out_of_vocabulary_ids_is_a_400(http):
    for prompt in ([-1], [49152], [10**12]):
        err = error_of(http.post("/debug/prefix-cache/explain", json={"prompt": prompt}), 400)
        assert "token ids" in err["message"], err
    still_serves(http)


@pytest.mark.parametrize("field,value", [("temperature", "NaN"), ("repetition_penalty", "NaN"),
                                         ("top_p", "NaN"), ("temperature", "Infinity"),
                                         ("presence_penalty", "-Infinity")])
def test_nan_and_infinite_floats_are_400(http, field, value):
    err = error_of(raw_post(http, "/v1/completions", f'{{"prompt": "hi", "max_tokens": 2, "{field}": {value}}}'),
                   400)
    assert field in err["message"]
    err = error_of(raw_post(http, "/v1/chat/completions",
                            f'{{"messages": [{{"role": "user", "content": "hi"}}], "{field}": {value}}}'), 400)
    assert field in err["message"]
    still_serves(http)


def test_nan_logit_bias_and_sampling_params_offline():
    from kvserve import SamplingParams

    for kwargs in (dict(temperature=math.nan), dict(repetition_penalty=math.nan), dict(min_p=math.inf),
                   dict(logit_bias={3: math.nan}), dict(seed=2**64), dict(stop_token_ids=[-1]),
                   dict(temperature="1"), dict(n=True), dict(stop=5)):
        with pytest.raises(ValueError):
            SamplingParams(**kwargs)


def test_n_that_can_never_run_is_a_400_not_a_429(http):
    err = error_of(http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "n": 600}), 400)
    assert err["param"] == "n" and "--max-n" in err["message"]
    # within --max-n, but n x prompts over what the engine can ever hold (8 + 8)
    err = error_of(http.post("/v1/completions", json={"prompt": [[1, 2]] * 5, "max_tokens": 2, "n": 4}), 400)
    assert err["param"] == "n" and "can ever hold" in err["message"]
    still_serves(http)


def test_huge_seed_is_a_400_naming_seed(http):
    err = error_of(raw_post(http, "/v1/completions", f'{{"prompt": "hi", "max_tokens": 2, "seed": {2**64}}}'), 400)
    assert err["param"] == "seed"
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "seed": 2**63 - 1, "n": 2})
    assert r.status_code == 200, r.text  # the largest seed, with n > 1 (child seeds wrap, never overflow)
    still_serves(http)


def test_client_chat_template_refused_unless_trusted(http):
    slow = "{% for i in range(2000) %}{% for j in range(2000) %}{% endfor %}{% endfor %}"
    for body in ({"chat_template_kwargs": {"chat_template": slow}}, {"chat_template": slow}):
        err = error_of(http.post("/v1/chat/completions",
                                 json={"messages": [{"role": "user", "content": "hi"}], **body}), 400)
        assert "--trust-request-chat-template" in err["message"]
    err = error_of(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                           "chat_template_kwargs": {"tokenize": True}}), 400)
    assert "tokenize" in err["message"]
    still_serves(http)


def test_trusted_template_renders_off_the_event_loop(tiny_llama):
    srv = AppServer(tiny_llama[0], "--trust-request-chat-template").start()
    try:
        template = ("{% for i in range(1500) %}{% for j in range(1000) %}{% endfor %}{% endfor %}"
                    "{{ messages[0]['content'] }}")
        done = {}

        def render() -> None:
            done["r"] = srv.request("POST", "/v1/chat/completions", timeout=120, json={
                "messages": [{"role": "user", "content": "hi"}], "chat_template": template, "max_tokens": 2})

        worker = threading.Thread(target=render)
        worker.start()
        time.sleep(0.3)
        slowest = 0.0
        while worker.is_alive():
            start = time.monotonic()
            assert srv.request("GET", "/health", timeout=10).status_code == 200
            slowest = max(slowest, time.monotonic() - start)
            time.sleep(0.05)
        worker.join()
        assert done["r"].status_code == 200, done["r"].text
        assert slowest < 2.0, f"/health took {slowest:.1f} s while a template rendered"
    finally:
        srv.stop()


def test_huge_text_prompt_is_refused_fast(http):
    start = time.monotonic()
    err = error_of(http.post("/v1/completions", json={"prompt": "x" * 13_000_000}), 413)
    assert "--max-body-size" in err["message"]
    # under the body limit but more characters than max_model_len tokens can spell: 400 without tokenizing
    err = error_of(http.post("/v1/completions", json={"prompt": "ab " * 300_000, "max_tokens": 1}), 400)
    assert err["code"] == "context_length_exceeded"
    err = error_of(http.post("/tokenize", json={"prompt": "ab " * 300_000}), 400)
    assert time.monotonic() - start < 5.0
    still_serves(http)


def test_body_without_json_content_type_is_415(server, http):
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    for headers in ({}, {"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"}):
        error_of(http.post("/v1/completions", content=body, headers=headers), 415)
    r = http.post("/v1/completions", content=body, headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200
    r = http.post("/v1/messages", content=body, headers={"x-api-key": API_KEY})
    assert r.status_code == 415 and r.json()["type"] == "error"
    still_serves(http)


def test_anthropic_ranges_and_thinking(http):
    model = http.get("/v1/models").json()["data"][0]["id"]
    base = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    for extra, needle in (({"temperature": 1.5}, "temperature"), ({"top_k": -1}, "top_k"),
                          ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking")):
        r = http.post("/v1/messages", json={**base, **extra})
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        assert needle in r.json()["error"]["message"]
    r = raw_post(http, "/v1/messages", json.dumps(base)[:-1] + ', "temperature": NaN}')
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert http.post("/v1/messages", json={**base, "thinking": {"type": "disabled"}}).status_code == 200
    still_serves(http)


# ---- limits ----------------------------------------------------------------------------------
@pytest.mark.parametrize("path,body,param,flag", [
    ("/v1/completions", {"prompt": "hi", "n": 5}, "n", "--max-n"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 201}, "max_tokens", "--max-tokens-limit"),
    ("/v1/completions", {"prompt": "hi", "stop": ["a", "b", "c"]}, "stop", "--max-stop-strings"),
    ("/v1/completions", {"prompt": "hi", "stop": ["a"], "stop_token_ids": [5, 6]}, "stop", "--max-stop-strings"),
    ("/v1/completions", {"prompt": "hi", "stop": ["123456789"]}, "stop", "--max-stop-string-length"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"1": 1, "2": 1, "3": 1}}, "logit_bias", "--max-logit-bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}] * 4}, "messages", "--max-messages"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs", "max_logprobs"),
])
def test_each_limit_is_a_400_naming_its_flag(http, path, body, param, flag):
    err = error_of(http.post(path, json=body), 400)
    assert err["param"] == param and flag in err["message"], err
    still_serves(http)


def test_anthropic_limits_answer_in_anthropic_shape(http):
    model = http.get("/v1/models").json()["data"][0]["id"]
    body = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}] * 4}
    r = http.post("/v1/messages", json=body)
    assert r.status_code == 400 and r.json()["type"] == "error" and "--max-messages" in r.json()["error"]["message"]


def test_request_timeout_aborts_and_frees_blocks(tiny_llama):
    srv = AppServer(tiny_llama[0], "--request-timeout", "0.5", "--stats-interval", "0").start()
    try:
        with srv.http(headers={}, timeout=60) as http:
            long = {"prompt": [5, 6, 7], "max_tokens": 1000, "ignore_eos": True}
            err = error_of(http.post("/v1/completions", json=long), 408)
            assert "--request-timeout" in err["message"] and err["code"] == "request_timeout"
            events = sse_events(http.post("/v1/completions", json={**long, "stream": True}))
            assert events[-1]["error"]["code"] == "request_timeout"
            wait_idle(http)
            assert metric(http, "kvserve:kv_cache_request_blocks") == 0
            r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200
    finally:
        srv.stop()


# ---- auth, debug endpoints, logging -----------------------------------------------------------
def test_several_api_keys_env_key_and_protected_metrics(tiny_llama):
    env_key = "sk-from-env"
    srv = AppServer(tiny_llama[0], "--require-api-key-for-metrics", env={"KVSERVE_API_KEY": env_key}).start()
    try:
        assert srv.request("GET", "/v1/models", headers={"x-api-key": env_key}).status_code == 200
        assert srv.request("GET", "/v1/models").status_code == 401
        assert srv.request("GET", "/metrics").status_code == 401
        assert srv.request("GET", "/metrics", headers={"x-api-key": env_key}).status_code == 200
        assert srv.request("GET", "/health").status_code == 200
    finally:
        srv.stop()
    a_log = srv.log()
    srv = AppServer(tiny_llama[0], "--api-key", "k1", "k2", "--log-requests").start()
    try:
        for key in ("k1", "k2"):
            r = srv.request("POST", "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                            json={"prompt": "a secret prompt", "max_tokens": 2})
            assert r.status_code == 200
        assert srv.request("GET", "/v1/models", headers={"Authorization": "Bearer k3"}).status_code == 401
        assert srv.request("GET", "/metrics").status_code == 200  # open unless asked otherwise
        assert srv.request("GET", "/debug/prefix-cache", headers={"x-api-key": "k1"}).status_code == 404
        time.sleep(0.2)
        assert "a secret prompt" in srv.log()  # --log-requests
    finally:
        srv.stop()
    assert "a secret prompt" not in a_log


# ---- disconnects ------------------------------------------------------------------------------
def test_non_streaming_disconnect_logs_no_traceback(server, http):
    before = server.log()
    body = {"prompt": list(range(500, 600)), "max_tokens": 150, "ignore_eos": True}
    for _ in range(3):
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.2))
    wait_idle(http)
    new = server.log()[len(before):]
    assert "Traceback" not in new and "InvalidStateError" not in new and " ERROR " not in new, new
    assert metric(http, "kvserve:kv_cache_request_blocks") == 0
    still_serves(http)
