"""Prompt logprobs through the server (its app in process): `echo` with `logprobs` on /v1/completions
(OpenAI's legacy shape, whole and streamed) and vLLM's `prompt_logprobs` field on completions and chat,
equal to the offline engine's, in bodies that validate against OpenAI's OpenAPI description."""
from __future__ import annotations

import re

import pytest
from tests.helpers.openai_schemas import OpenAISchemas
from tests.helpers.server import in_process, sse_events

from kvserve.config import EngineArgs
from kvserve.engine.engine import Engine
from kvserve.sampling_params import SamplingParams

TOL = 1e-4
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(tiny_llama):
    yield from in_process(tiny_llama[0], "--stats-interval", "0")


@pytest.fixture(scope="module")
def http(server):
    with server.http() as c:
        yield c


@pytest.fixture(scope="module")
def model(http):
    return http.get("/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def offline(tiny_llama):
    return Engine(EngineArgs(model=tiny_llama[0], num_gpu_blocks_override=64, max_model_len=1024))


def _offline_run(engine: Engine, prompt, k: int, max_tokens: int):
    engine.add_request("ref", prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                                     logprobs=k, prompt_logprobs=k))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return out
    raise AssertionError("no output")


def _first_logprob_may_be_null(schemas: dict) -> None:
    """In a completion's logprobs the first of token_logprobs and of top_logprobs may be null: OpenAI's API
    (and vLLM) send null for the echoed prompt's first token, which nothing precedes, where the OpenAPI
    description says a number and an object. Everything else is as specified (streamed chunks included)."""
    for name in ("CreateCompletionResponse", "CreateCompletionStreamChunk"):
        choice = schemas[name]["properties"]["choices"]["items"]
        logprobs = next(s for s in choice["properties"]["logprobs"]["anyOf"] if s.get("type") == "object")
        for field_name in ("token_logprobs", "top_logprobs"):
            field = logprobs["properties"][field_name]
            field["prefixItems"] = [{"anyOf": [field["items"], {"type": "null"}]}]


@pytest.fixture(scope="module")
def echo_schemas():
    return OpenAISchemas(patch=_first_logprob_may_be_null)


@pytest.fixture
def check_echo_schema(echo_schemas, request):
    """check_schema, except that the first of a completion's token_logprobs and top_logprobs may be null."""
    return echo_schemas.checker(request.node)


def _concat(chunks: list[dict], index: int) -> tuple[str, dict]:
    text, lp = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        for c in chunk["choices"]:
            if c["index"] != index:
                continue
            text += c["text"]
            for key in lp:
                lp[key] += (c["logprobs"] or {}).get(key, [])
    return text, lp


def test_echo_with_logprobs_whole_and_streamed(http, model, offline, check_echo_schema, check_schema):
    ids = offline.tokenize_prompt(PROMPT)
    p, max_tokens = len(ids), 5
    ref = _offline_run(offline, PROMPT, 2, max_tokens)
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "echo": True,
            "logprobs": 2, "ignore_eos": True}
    whole = http.post("/v1/completions", json=body).json()
    check_echo_schema("CreateCompletionResponse", whole)
    check_schema.rejects("CreateCompletionResponse", whole)  # only because of that first null
    choice = whole["choices"][0]
    text, lp = choice["text"], choice["logprobs"]
    assert text == PROMPT + ref.outputs[0].text
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == p + max_tokens
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    entries = ref.prompt_logprobs + ref.outputs[0].logprobs
    for i, token_id in enumerate(ids + ref.outputs[0].token_ids):
        assert lp["tokens"][i] == offline.tokenizer.decode([token_id])
        if i == 0:
            continue
        assert abs(lp["token_logprobs"][i] - entries[i][token_id].logprob) < TOL, i
        top = {e.decoded_token: e.logprob for e in entries[i].values() if e.rank <= 2}
        assert set(lp["top_logprobs"][i]) == set(top) | {lp["tokens"][i]}, i
        assert all(abs(lp["top_logprobs"][i][t] - v) < TOL for t, v in top.items())
    # text_offset: where each token starts in the choice's text (the echoed prompt, then the generated text)
    assert lp["text_offset"][:p] == [len(offline.tokenizer.decode(ids[:i])) for i in range(p)]
    assert lp["text_offset"][p] == len(PROMPT)
    assert all(text.startswith(t, o) for t, o in zip(lp["tokens"], lp["text_offset"]) if "\ufffd" not in t)

    events = sse_events(http.post("/v1/completions", json={**body, "stream": True}))
    for event in events:
        check_echo_schema("CreateCompletionStreamChunk", event)
    assert _concat(events, 0) == (text, lp)

    # n choices of one prompt each start with the prompt's part (a stream brings the prompt logprobs once)
    events = sse_events(http.post("/v1/completions", json={**body, "stream": True, "n": 2, "max_tokens": 2}))
    for index in (0, 1):
        streamed_text, streamed = _concat(events, index)
        assert streamed_text.startswith(PROMPT)
        assert {k: v[:p] for k, v in streamed.items()} == {k: v[:p] for k, v in lp.items()}


def test_echo_with_logprobs_through_the_openai_client(server, model):
    client = server.openai()
    out = client.completions.create(model=model, prompt=[5, 6, 7, 8], max_tokens=3, echo=True, logprobs=0,
                                    temperature=0, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == 7 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(v, float) for v in lp.token_logprobs[1:])
    assert all(len(top) == 1 for top in lp.top_logprobs[1:])  # logprobs 0: only the token itself


def _check_field(field, ids: list[int], ref, k: int) -> None:
    assert len(field) == len(ids) and field[0] is None
    for i in range(1, len(ids)):
        want = ref.prompt_logprobs[i]
        assert str(ids[i]) in field[i] and len(field[i]) <= k + 1
        for key, got in field[i].items():
            assert set(got) == {"logprob", "rank", "decoded_token"}
            expected = want[int(key)]
            assert abs(got["logprob"] - expected.logprob) < TOL and got["rank"] == expected.rank
            assert got["decoded_token"] == expected.decoded_token


def test_prompt_logprobs_field_on_completions_and_chat(http, model, offline, check_schema):
    ids = [300 + i for i in range(40)]
    ref = _offline_run(offline, ids, 3, 2)
    body = http.post("/v1/completions", json={"model": model, "prompt": ids, "max_tokens": 2, "temperature": 0,
                                              "prompt_logprobs": 3}).json()
    check_schema("CreateCompletionResponse", body)
    assert body["choices"][0]["logprobs"] is None
    _check_field(body["choices"][0]["prompt_logprobs"], ids, ref, 3)
    plain = http.post("/v1/completions", json={"model": model, "prompt": ids, "max_tokens": 2}).json()
    assert "prompt_logprobs" not in plain["choices"][0]

    messages = [{"role": "user", "content": "Name a colour."}]
    chat_ids = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    ref = _offline_run(offline, chat_ids, 0, 2)
    body = http.post("/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": 2,
                                                   "prompt_logprobs": 0}).json()
    check_schema("CreateChatCompletionResponse", body)
    assert body["usage"]["prompt_tokens"] == len(chat_ids)
    _check_field(body["prompt_logprobs"], chat_ids, ref, 0)
    assert all(len(entry) == 1 for entry in body["prompt_logprobs"][1:])


@pytest.mark.parametrize("path,extra,message", [
    ("/v1/completions", {"prompt_logprobs": 2, "stream": True}, "not available with stream"),
    ("/v1/chat/completions", {"prompt_logprobs": 2, "stream": True}, "not available with stream"),
    ("/v1/completions", {"prompt_logprobs": 21}, r"prompt_logprobs 21 exceeds max_logprobs \(20\)"),
    ("/v1/completions", {"prompt_logprobs": -1}, "prompt_logprobs must be an integer >= 0"),
])
def test_bad_prompt_logprobs_are_a_400_naming_the_field(http, model, path, extra, message):
    body = {"model": model, "max_tokens": 2, **extra}
    body.update({"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt_logprobs"
    assert re.search(message, err["message"]), err
