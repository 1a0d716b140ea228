"""The OpenAI-compatible server (`kvserve serve`'s app, in process with the engine loop on a thread), driven
with the official `openai` client (and raw HTTP where the test is about the wire), with bodies and stream
chunks checked against the component schemas of OpenAI's OpenAPI description. What needs a real process
(signals, uvicorn's HTTP parsing): tests/e2e/test_server_process.py.

The model is the tiny random Llama (real SmolLM2 tokenizer): its tokens are arbitrary, so the tests
fix lengths with max_tokens / ignore_eos and compare streamed against whole outputs, never text.
"""
from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from tests.helpers.server import API_KEY, in_process, metric, wait_idle

MAX_NUM_SEQS, MAX_QUEUE_LEN = 16, 16


@pytest.fixture(scope="module")
def server(tiny_llama):
    yield from in_process(tiny_llama[0], "--max-num-seqs", str(MAX_NUM_SEQS), "--max-queue-len", str(MAX_QUEUE_LEN),
                          "--max-body-size", "64KiB", "--stats-interval", "1")


@pytest.fixture(scope="module")
def http(server):
    with server.http() as client:
        yield client


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


# ---- endpoints --------------------------------------------------------------------------------
def test_models_health_version_metrics(server, http, client, check_schema):
    body = http.get("/v1/models").json()
    check_schema("ListModelsResponse", body)
    assert [m.id for m in client.models.list().data] == [body["data"][0]["id"]]
    assert body["data"][0]["max_model_len"] == 1024
    assert server.request("GET", "/health").status_code == 200  # no key needed
    assert server.request("GET", "/version").json()["version"]
    text = server.request("GET", "/metrics").text
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "num_requests_running", "num_requests_waiting",
                 "kv_cache_usage_perc", "prompt_tokens_total", "generation_tokens_total", "num_preemptions_total"):
        assert f"kvserve:{name}" in text, name


def test_completion_whole_and_streamed(http, client, model, check_schema):
    params = dict(model=model, prompt="The capital of France is", max_tokens=12, temperature=0,
                  extra_body={"ignore_eos": True})
    raw = client.completions.with_raw_response.create(**params)
    check_schema("CreateCompletionResponse", raw.http_response.json())
    whole = raw.parse()
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and whole.usage.completion_tokens == 12
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 12
    assert whole.usage.prompt_tokens_details.cached_tokens is not None

    chunks = list(client.completions.create(**params, stream=True, stream_options={"include_usage": True}))
    for chunk in chunks:
        check_schema("CreateCompletionStreamChunk", chunk.to_dict())
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12

    echoed = client.completions.create(**{**params, "max_tokens": 3}, echo=True)
    assert echoed.choices[0].text.startswith("The capital of France is")

    # token-id prompts, n samples, logprobs; choices are indexed prompt * n + sample
    multi = client.completions.create(model=model, prompt=[[1, 2, 3], [4, 5, 6, 7]], n=2, max_tokens=4, seed=7,
                                      logprobs=3, extra_body={"ignore_eos": True})
    check_schema("CreateCompletionResponse", multi.to_dict())
    assert sorted(c.index for c in multi.choices) == [0, 1, 2, 3]
    assert multi.usage.prompt_tokens == 7 and multi.usage.completion_tokens == 16
    lp = multi.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(3 <= len(top) <= 4 for top in lp.top_logprobs)


def test_chat_whole_and_streamed(client, model, check_schema):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": [{"type": "text", "text": "Name a colour."},
                                             {"type": "text", "text": "One word."}]}]
    params = dict(model=model, messages=messages, max_completion_tokens=10, temperature=0,
                  extra_body={"ignore_eos": True})
    raw = client.chat.completions.with_raw_response.create(**params, logprobs=True, top_logprobs=2)
    check_schema("CreateChatCompletionResponse", raw.http_response.json())
    whole = raw.parse()
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert len(choice.logprobs.content) == 10 and all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    assert whole.usage.completion_tokens == 10 and whole.usage.prompt_tokens > 10

    chunks = list(client.chat.completions.create(**params, stream=True, stream_options={"include_usage": True}))
    for chunk in chunks:
        check_schema("CreateChatCompletionStreamResponse", chunk.to_dict())
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert chunks[-1].usage.completion_tokens == 10

    sampled = {**params, "max_completion_tokens": 5, "n": 2, "seed": 3, "temperature": 1.0}
    streamed = {0: "", 1: ""}
    for chunk in client.chat.completions.create(**sampled, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    whole_n = client.chat.completions.create(**sampled)
    assert {c.index: c.message.content for c in whole_n.choices} == streamed


def test_sampling_fields_reach_the_engine(client, model):
    base = dict(model=model, prompt="Once upon a time", max_tokens=16, temperature=0,
                extra_body={"ignore_eos": True})
    text = client.completions.create(**base).choices[0].text
    stop = text[6:10]
    cut = client.completions.create(**base, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == text[:text.find(stop)]
    sampled = dict(model=model, prompt="Once upon a time", max_tokens=16, temperature=0.8, top_p=0.9,
                   presence_penalty=0.5, frequency_penalty=0.5, seed=1,
                   extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2, "min_tokens": 4,
                               "stop_token_ids": [2], "skip_special_tokens": True})
    everything = client.completions.create(**sampled)
    assert everything.usage.completion_tokens >= 4
    again = client.completions.create(**sampled)
    assert again.choices[0].text == everything.choices[0].text  # seeded


def test_stream_never_splits_multibyte_characters(tiny_llama, client, model):
    """Byte tokens biased up so that 2-byte characters (é = Ã + ©) are spelled one byte per token."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama[0])
    lead, conts = tok.convert_tokens_to_ids("Ã"), tok.convert_tokens_to_ids(["©", "¨", "±", "¤"])
    bias = {str(lead): 100, **{str(t): 100 for t in conts}}
    params = dict(model=model, prompt="Caf", max_tokens=40, temperature=1.0, seed=11, logit_bias=bias,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**params).choices[0].text
    pieces = [c.choices[0].text for c in client.completions.create(**params, stream=True)]
    assert any(ch in whole for ch in "éèñä"), whole
    assert "".join(pieces) == whole
    assert all("\ufffd" not in p for p in pieces) or "\ufffd" in whole


def test_cached_tokens_reported(client, model):
    prompt = list(range(1000, 1100))  # 6 full blocks of 16
    first = client.completions.create(model=model, prompt=prompt, max_tokens=1)
    second = client.completions.create(model=model, prompt=prompt, max_tokens=1)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 96


def test_32_concurrent_streams(server, http, model):
    async def one(c: openai.AsyncOpenAI, i: int) -> tuple[str, int, str]:
        text, usage, reason = "", None, None
        stream = await c.completions.create(model=model, prompt=[100 + i, 200 + i, 300 + i], max_tokens=24,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                reason = chunk.choices[0].finish_reason or reason
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return text, usage, reason

    async def main():
        async with server.async_openai() as c:
            return await asyncio.gather(*(one(c, i) for i in range(32)))

    wait_idle(http)  # 32 = max_num_seqs + max_queue_len: nothing else may be in flight
    results = asyncio.run(main())
    assert all(usage == 24 and reason == "length" and text for text, usage, reason in results)
    wait_idle(http)
    assert "generation throughput" in server.log()  # the periodic stats line ran while busy


def test_disconnect_mid_stream_frees_kv_blocks(server, http, model):
    aborted_before = metric(http, "kvserve:request_success_total", finished_reason="abort")
    generated_before = metric(http, "kvserve:generation_tokens_total")
    body = {"model": model, "prompt": list(range(500, 700)), "max_tokens": 800, "ignore_eos": True, "stream": True}
    with server.http(headers=http.headers, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            for _ in range(6):
                next(lines)
            assert metric(http, "kvserve:kv_cache_usage_perc") > 0
        # leaving both blocks closes the connection mid-stream
    deadline = time.monotonic() + 5
    while metric(http, "kvserve:kv_cache_usage_perc") > 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert metric(http, "kvserve:kv_cache_usage_perc") == 0
    assert metric(http, "kvserve:num_requests_running") == 0
    assert metric(http, "kvserve:request_success_total", finished_reason="abort") == aborted_before + 1
    assert metric(http, "kvserve:generation_tokens_total") - generated_before < 800

    # a non-streaming client that gives up is noticed too (the handler watches for http.disconnect)
    with pytest.raises(httpx.ReadTimeout), server.http(headers=http.headers,
                                                       timeout=httpx.Timeout(30, read=0.5)) as c:
        c.post("/v1/completions", json={**body, "stream": False})
    wait_idle(http, timeout=5)
    assert metric(http, "kvserve:request_success_total", finished_reason="abort") == aborted_before + 2


def test_burst_over_capacity_gets_only_200_and_429(server, http, model, check_schema):
    body = {"model": model, "prompt": [5, 6, 7], "max_tokens": 64, "ignore_eos": True}

    async def main():
        async with server.async_http(headers=http.headers, timeout=60) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(64)))

    responses = asyncio.run(main())
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(200) >= MAX_NUM_SEQS and statuses.count(429) >= 1, statuses
    for r in responses:
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1
            check_schema("ErrorResponse", r.json())
        else:
            assert r.json()["usage"]["completion_tokens"] == 64
    assert metric(http, "kvserve:request_rejected_total", reason="queue_full") >= statuses.count(429)
    wait_idle(http)
    assert http.post("/v1/completions", json={**body, "max_tokens": 2}).status_code == 200


_LONG_PROMPT = list(range(1, 1101))  # over max_model_len (1024)


@pytest.mark.parametrize("method,path,body,status,needles", [
    ("POST", "/v1/completions", b'{"prompt": "hi", "max_tokens": ', 400, ["JSON"]),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": "5"}, 400, ["max_tokens"]),
    ("POST", "/v1/completions", {"prompt": 12}, 400, ["prompt"]),
    ("POST", "/v1/completions", {"prompt": "hi", "temperature": -1}, 400, ["temperature"]),
    ("POST", "/v1/completions", {"prompt": "hi", "model": "no-such-model"}, 404, ["no-such-model"]),
    ("POST", "/v1/completions", {"prompt": _LONG_PROMPT}, 400, ["max_model_len", "1100"]),
    ("POST", "/v1/completions", {"prompt": "x" * 70_000}, 413, ["limit"]),
    ("POST", "/v1/chat/completions", {"messages": []}, 400, ["messages"]),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, ["role"]),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": "2"}, 400, ["n"]),
    ("GET", "/v1/nowhere", None, 404, []),
])
def test_bad_input_gets_openai_error_and_server_still_serves(http, model, check_schema, method, path, body,
                                                            status, needles):
    kwargs = ({"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes)
              else {"json": body})
    r = http.request(method, path, **kwargs)
    assert r.status_code == status, r.text
    check_schema("ErrorResponse", r.json())
    for needle in needles:
        assert needle in r.json()["error"]["message"], r.json()
    assert http.post("/v1/completions", json={"model": model, "prompt": "ok", "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}])
def test_api_key_required(server, check_schema, headers):
    r = server.request("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers=headers)
    assert r.status_code == 401
    check_schema("ErrorResponse", r.json())
    with pytest.raises(openai.AuthenticationError):
        server.openai(api_key="wrong").models.list()


def test_tokenize_detokenize(http, model):
    r = http.post("/tokenize", json={"model": model, "prompt": "hello world"}).json()
    assert r["count"] == len(r["tokens"]) > 0 and r["max_model_len"] == 1024
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == "hello world"
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > r["count"]


def test_speculative_decoding_streams_the_same_text_and_is_counted(server, http, client, model):
    """Speculation is on by default (ngram): a step may bring several tokens; the stream still carries
    exactly the whole response's text, and the drafts show in the metrics."""
    import re

    prompt = "one two three four five six seven " * 12
    params = dict(model=model, prompt=prompt, max_tokens=64, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**params)
    chunks = list(client.completions.create(**params, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    text = server.request("GET", "/metrics").text
    drafted = re.search(r'^kvserve:spec_decode_num_draft_tokens_total\{[^}]*\} (\S+)$', text, re.M)
    accepted = re.search(r'^kvserve:spec_decode_num_accepted_tokens_total\{[^}]*\} (\S+)$', text, re.M)
    assert drafted and accepted and float(drafted.group(1)) > 0
    assert 0 <= float(accepted.group(1)) <= float(drafted.group(1))
    assert "kvserve:spec_decode_mean_acceptance_length" in text
