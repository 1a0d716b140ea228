"""The Anthropic Messages API of `kvserve serve` (POST /v1/messages, /v1/messages/count_tokens; the app in
process), driven with
the official `anthropic` client and, where the test is about the wire, raw HTTP.

The model is the tiny random Llama (real SmolLM2 tokenizer, greedy here): its text is arbitrary, so the
tests compare whole against streamed, blocks against strings, and a stop sequence against the text it was
cut from, never against fixed text. cache_control and its usage fields: test_server_prefix_cache.py.
"""
from __future__ import annotations

import json

import anthropic
import pytest
from tests.helpers.server import API_KEY, in_process

SYSTEM = "You are a terse assistant."
# NOTE: this client version has no `temperature` argument any more; the API (and this server) still take it.
GREEDY = {"extra_body": {"temperature": 0}}
USER = [{"role": "user", "content": "Name three prime numbers."}]


@pytest.fixture(scope="module")
def server(tiny_llama):
    yield from in_process(tiny_llama[0], "--stats-interval", "0")


@pytest.fixture(scope="module")
def client(server):
    return server.anthropic()


@pytest.fixture(scope="module")
def http(server):
    with server.http(headers={"x-api-key": API_KEY}) as c:
        yield c


@pytest.fixture(scope="module")
def model(http):
    return http.get("/v1/models").json()["data"][0]["id"]


def _prompt_total(usage) -> int:
    return usage.input_tokens + usage.cache_creation_input_tokens + usage.cache_read_input_tokens


def test_message_whole_and_streamed(client, model):
    params = dict(model=model, system=SYSTEM, messages=USER, max_tokens=10, **GREEDY)
    whole = client.messages.create(**params)
    assert whole.id.startswith("msg_") and whole.type == "message" and whole.role == "assistant"
    assert whole.model == model and [b.type for b in whole.content] == ["text"] and whole.content[0].text
    assert whole.stop_reason == "max_tokens" and whole.stop_sequence is None
    assert whole.usage.output_tokens == 10
    assert _prompt_total(whole.usage) == client.messages.count_tokens(model=model, system=SYSTEM,
                                                                      messages=USER).input_tokens
    with client.messages.stream(**params) as stream:
        pieces = list(stream.text_stream)
        streamed = stream.get_final_message()
    assert "".join(pieces) == streamed.content[0].text == whole.content[0].text
    assert streamed.stop_reason == "max_tokens" and streamed.usage.output_tokens == 10
    # the second call may read part of the prompt from the prefix cache; the total is the same
    assert _prompt_total(streamed.usage) == _prompt_total(whole.usage)


def test_stream_event_sequence_on_the_wire(http, model):
    body = {"model": model, "messages": USER, "max_tokens": 6, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/messages", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    frames = [f for f in raw.split("\n\n") if f.strip()]
    events = []
    for frame in frames:
        name_line, data_line = frame.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: "), frame
        name, data = name_line[len("event: "):], json.loads(data_line[len("data: "):])
        assert data["type"] == name
        events.append((name, data))
    names = [n for n, _ in events]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["id"].startswith("msg_")
    assert {"input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens"} <= set(start["usage"])
    assert all(d["delta"]["type"] == "text_delta" and d["index"] == 0 for n, d in events if n == "content_block_delta")
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 6


def test_system_blocks_equal_system_string(client, model):
    blocks = [{"type": "text", "text": "You are terse."}, {"type": "text", "text": "Answer in English."}]
    joined = "You are terse.\nAnswer in English."
    assert (client.messages.count_tokens(model=model, system=blocks, messages=USER).input_tokens
            == client.messages.count_tokens(model=model, system=joined, messages=USER).input_tokens)
    a = client.messages.create(model=model, system=blocks, messages=USER, max_tokens=8, **GREEDY)
    b = client.messages.create(model=model, system=joined, messages=USER, max_tokens=8, **GREEDY)
    assert a.content[0].text == b.content[0].text
    content_blocks = [{"role": "user", "content": [{"type": "text", "text": "Name three prime numbers."}]}]
    c = client.messages.create(model=model, messages=content_blocks, max_tokens=8, **GREEDY)
    d = client.messages.create(model=model, messages=USER, max_tokens=8, **GREEDY)
    assert c.content[0].text == d.content[0].text


def test_stop_sequence_and_max_tokens(client, model):
    params = dict(model=model, messages=USER, max_tokens=24, **GREEDY)
    full = client.messages.create(**params).content[0].text
    start = next(i for i in range(len(full) // 3, len(full)) if full[i:i + 2].strip() and len(full[i:i + 2]) == 2)
    stop = full[start:start + 2]
    cut = client.messages.create(**params, stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == full[:full.index(stop)]
    short = client.messages.create(model=model, messages=USER, max_tokens=3, **GREEDY)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3


def test_assistant_prefill_and_multi_turn(client, model):
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
             {"role": "user", "content": "Count to three."}, {"role": "assistant", "content": "One,"}]
    out = client.messages.create(model=model, messages=turns, max_tokens=4, **GREEDY)
    assert out.usage.output_tokens == 4 and out.content[0].type == "text"


@pytest.mark.parametrize("body, status, kind, needles", [
    ({"messages": USER}, 400, "invalid_request_error", ["max_tokens"]),
    ({"messages": [{"role": "system", "content": "hi"}], "max_tokens": 4}, 400, "invalid_request_error", ["role"]),
    ({"messages": [{"role": "wizard", "content": "hi"}], "max_tokens": 4}, 400, "invalid_request_error", ["role"]),
    ({"messages": [], "max_tokens": 4}, 400, "invalid_request_error", ["messages"]),
    ({"messages": USER, "max_tokens": 0}, 400, "invalid_request_error", ["max_tokens"]),
    ({"messages": USER, "max_tokens": "4"}, 400, "invalid_request_error", ["max_tokens"]),
    ({"messages": USER, "max_tokens": 2000}, 400, "invalid_request_error", ["max_model_len"]),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 4}, 400,
     "invalid_request_error", ["image", "not supported"]),
    ({"messages": USER, "max_tokens": 4, "system": [{"type": "text", "text": "x",
                                                      "cache_control": {"type": "persistent"}}]}, 400,
     "invalid_request_error", ["cache_control"]),
    ({"messages": USER, "max_tokens": 4, "model": "no-such-model"}, 404, "not_found_error", ["no-such-model"]),
])
def test_errors_in_anthropic_shape(http, model, body, status, kind, needles):
    r = http.post("/v1/messages", json={"model": model, **body})
    assert r.status_code == status, r.text
    error = r.json()
    assert error["type"] == "error" and set(error["error"]) == {"type", "message"}
    assert error["error"]["type"] == kind, error
    for needle in needles:
        assert needle in error["error"]["message"], error


def test_errors_through_the_client_and_api_keys(server, client, model):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=model, messages=[{"role": "system", "content": "hi"}], max_tokens=4)
    assert e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.AuthenticationError):
        server.anthropic(api_key="wrong").messages.create(model=model, messages=USER, max_tokens=1)
    r = server.request("POST", "/v1/messages", json={"model": model, "messages": USER, "max_tokens": 1})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    # either header works on every endpoint; OpenAI routes keep OpenAI's error shape
    for headers in ({"x-api-key": API_KEY}, {"Authorization": f"Bearer {API_KEY}"}):
        ok = server.request("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers=headers)
        assert ok.status_code == 200, ok.text
    r = server.request("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                       headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_count_tokens_matches_the_chat_template(http, model):
    body = {"model": model, "system": SYSTEM, "messages": USER}
    counted = http.post("/v1/messages/count_tokens", json=body)
    assert counted.status_code == 200 and set(counted.json()) == {"input_tokens"}
    openai_messages = [{"role": "system", "content": SYSTEM}, *USER]
    assert counted.json()["input_tokens"] == http.post("/tokenize", json={"messages": openai_messages}).json()["count"]
    r = http.post("/v1/messages/count_tokens", json={"model": model, "messages": [{"role": "bot", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
