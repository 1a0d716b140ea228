"""End-to-end tests of `kvserve serve`: the real server in a subprocess on a free port, driven with the
official `openai` client (and raw HTTP where the test is about the wire), with bodies and stream chunks
checked against the component schemas of OpenAI's OpenAPI description.

The model is the tiny random Llama (real SmolLM2 tokenizer): its tokens are arbitrary, so the tests
fix lengths with max_tokens / ignore_eos and compare streamed against whole outputs, never text.
"""
from __future__ import annotations

import asyncio
import copy
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import referencing
import referencing.jsonschema
import yaml
from prometheus_client.parser import text_string_to_metric_families

SPEC = Path(__file__).resolve().parents[2].parent / "shared" / "specs" / "openai-openapi.yml"
API_KEY = "sk-test-key"
MAX_NUM_SEQS, MAX_QUEUE_LEN = 16, 16


# ---- the server -------------------------------------------------------------------------------
@dataclass
class Server:
    proc: subprocess.Popen
    base_url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_server(model: str | None, log_path: Path, *flags: str, timeout: float = 60.0) -> Server:
    """`kvserve serve --port 0 ...` in a subprocess; returns once /health answers 200. model None: no --model
    (the built-in model, under its own name)."""
    cmd = [sys.executable, "-m", "kvserve.server.cli", *(["--model", model] if model else []), "--port", "0",
           "--num-threads", "1", "--kv-cache-memory", "32MiB", "--no-access-log", *flags]
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + timeout
    base_url = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log_path.read_text()}")
        text = log_path.read_text(errors="replace")
        if base_url is None and "serving on " in text:
            base_url = text.split("serving on ", 1)[1].split()[0]
        if base_url is not None:
            try:
                if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                    return Server(proc, base_url, log_path)
            except httpx.TransportError:
                pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server not ready after {timeout}s:\n{log_path.read_text()}")


def stop_server(server: Server) -> int:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(30)
        except subprocess.TimeoutExpired:
            server.proc.kill()
    return server.proc.wait()


def served(model: str, tmp_path_factory, *flags: str):
    """Module-fixture body: a server with API_KEY for the module's tests; it must then exit 0 on SIGTERM."""
    srv = start_server(model, tmp_path_factory.mktemp("server") / "server.log", "--api-key", API_KEY, *flags)
    yield srv
    assert stop_server(srv) == 0, srv.log()


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    yield from served(tiny_llama[0], tmp_path_factory, "--max-num-seqs", str(MAX_NUM_SEQS),
                      "--max-queue-len", str(MAX_QUEUE_LEN), "--max-body-size", "64KiB", "--stats-interval", "1")


def http_client(server: Server, timeout: float = 60) -> httpx.Client:
    """An httpx client of `server` with the test API key (use as a context manager)."""
    return httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=timeout)


def openai_client(server: Server, timeout: float = 60) -> openai.OpenAI:
    """The `openai` client of `server` with the test API key, no retries."""
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=timeout)


@pytest.fixture(scope="module")
def http(server):
    with http_client(server) as client:
        yield client


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def metric(http: httpx.Client, name: str, **labels) -> float:
    """The value of one sample of /metrics (0 if absent)."""
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


_IDLE_GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_request_blocks")


def wait_idle(http: httpx.Client, timeout: float = 10.0) -> None:
    """No request running or waiting and no KV block held by one. Blocks pinned by prompt caching
    (cache_control) stay held for their TTL by design, so the pool's usage need not return to 0: a fuzzed
    Anthropic body with a cache_control block long enough to pin kept kv_cache_usage_perc above 0 for minutes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(metric(http, f"kvserve:{name}") == 0 for name in _IDLE_GAUGES):
            return
        time.sleep(0.05)
    gauges = {name: metric(http, f"kvserve:{name}") for name in (*_IDLE_GAUGES, "kv_cache_usage_perc",
                                                                 "prefix_cache_pinned_blocks")}
    raise AssertionError(f"server not idle after {timeout}s: {gauges}")


# ---- OpenAI's schemas -------------------------------------------------------------------------
def _openapi_to_jsonschema(node) -> None:
    """OpenAPI 3.0's `nullable: true` (still used in places of this 3.1 document) -> JSON Schema."""
    if isinstance(node, list):
        for item in node:
            _openapi_to_jsonschema(item)
        return
    if not isinstance(node, dict):
        return
    for value in node.values():
        _openapi_to_jsonschema(value)
    if node.pop("nullable", False):
        if isinstance(node.get("type"), str):
            node["type"] = [node["type"], "null"]
            if "enum" in node:
                node["enum"] = [*node["enum"], None]
        else:
            inner = dict(node)
            node.clear()
            node["anyOf"] = [inner, {"type": "null"}]


@pytest.fixture(scope="session")
def check_schema():
    """check_schema(component_name, instance) raises jsonschema.ValidationError on a mismatch."""
    spec = yaml.load(SPEC.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    _openapi_to_jsonschema(spec)
    schemas = spec["components"]["schemas"]
    # NOTE: the spec uses one schema for completion bodies and stream chunks, but a chunk of a choice that
    # is still running carries finish_reason null (as OpenAI's API sends it); allow that for chunks only.
    chunk = copy.deepcopy(schemas["CreateCompletionResponse"])
    chunk["properties"]["choices"]["items"]["properties"]["finish_reason"] = {
        "anyOf": [chunk["properties"]["choices"]["items"]["properties"]["finish_reason"], {"type": "null"}]}
    schemas["CreateCompletionStreamChunk"] = chunk
    resource = referencing.Resource.from_contents(spec, default_specification=referencing.jsonschema.DRAFT202012)
    registry = referencing.Registry().with_resource("openai.yml", resource)
    validators = {}

    def check(name: str, instance) -> None:
        if name not in validators:
            validators[name] = jsonschema.Draft202012Validator(
                {"$ref": f"openai.yml#/components/schemas/{name}"}, registry=registry)
        validators[name].validate(instance)

    return check


def sse_events(response: httpx.Response) -> list:
    """The JSON payloads of an SSE body; asserts it ends with `data: [DONE]`."""
    payloads = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert payloads and payloads[-1] == "[DONE]", payloads[-3:]
    return [json.loads(p) for p in payloads[:-1]]


# ---- endpoints --------------------------------------------------------------------------------
def test_models_health_version_metrics(server, http, client, check_schema):
    body = http.get("/v1/models").json()
    check_schema("ListModelsResponse", body)
    assert [m.id for m in client.models.list().data] == [body["data"][0]["id"]]
    assert body["data"][0]["max_model_len"] == 1024
    assert httpx.get(f"{server.base_url}/health").status_code == 200  # no key needed
    assert httpx.get(f"{server.base_url}/version").json()["version"]
    text = httpx.get(f"{server.base_url}/metrics").text
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
        async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0,
                                      timeout=60) as c:
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
    with httpx.Client(base_url=server.base_url, headers=http.headers, timeout=30) as c:
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
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/v1/completions", headers=http.headers, timeout=httpx.Timeout(30, read=0.5),
                   json={**body, "stream": False})
    wait_idle(http, timeout=5)
    assert metric(http, "kvserve:request_success_total", finished_reason="abort") == aborted_before + 2


def test_burst_over_capacity_gets_only_200_and_429(server, http, model, check_schema):
    body = {"model": model, "prompt": [5, 6, 7], "max_tokens": 64, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(base_url=server.base_url, headers=http.headers, timeout=60,
                                     limits=httpx.Limits(max_connections=100)) as c:
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


def test_malformed_chunked_body_is_a_400_not_a_traceback(server, http, model):
    """A chunked body that is not chunked encoding: the HTTP parser answers 400 and closes mid-body, and
    the body reader takes that as an incomplete body (before: an unhandled ClientDisconnect, logged as an
    exception in the ASGI application)."""
    host, port = server.base_url.removeprefix("http://").rsplit(":", 1)
    seen = len(server.log())
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + API_KEY.encode()
                     + b"\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")
        assert sock.recv(64).startswith(b"HTTP/1.1 400 ")
    assert http.post("/v1/completions", json={"model": model, "prompt": "ok", "max_tokens": 1}).status_code == 200
    new_log = server.log()[seen:]
    assert "Traceback" not in new_log and "Exception in ASGI application" not in new_log, new_log


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}])
def test_api_key_required(server, check_schema, headers):
    r = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers=headers)
    assert r.status_code == 401
    check_schema("ErrorResponse", r.json())
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0).models.list()


def test_tokenize_detokenize(http, model):
    r = http.post("/tokenize", json={"model": model, "prompt": "hello world"}).json()
    assert r["count"] == len(r["tokens"]) > 0 and r["max_model_len"] == 1024
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == "hello world"
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > r["count"]


# ---- shutdown (its own server, with the engine loop on a thread: the other placement) ----------
def test_sigterm_finishes_in_flight_requests_then_exits_0(tiny_llama, tmp_path):
    srv = start_server(tiny_llama[0], tmp_path / "server.log", "--engine-loop", "thread", "--shutdown-timeout", "20")
    try:
        body = {"prompt": [7, 8, 9], "max_tokens": 300, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=srv.base_url, timeout=30) as c, c.stream("POST", "/v1/completions",
                                                                             json=body) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            srv.proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            with pytest.raises(httpx.TransportError):  # no longer accepting connections
                httpx.get(f"{srv.base_url}/health", timeout=2)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][len("data: "):])["choices"][0]["finish_reason"] == "length"
        assert srv.proc.wait(30) == 0, srv.log()
    finally:
        stop_server(srv)


def test_speculative_decoding_streams_the_same_text_and_is_counted(server, http, client, model):
    """Speculation is on by default (ngram): a step may bring several tokens; the stream still carries
    exactly the whole response's text, and the drafts show in the metrics."""
    import re

    prompt = "one two three four five six seven " * 12
    params = dict(model=model, prompt=prompt, max_tokens=64, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**params)
    chunks = list(client.completions.create(**params, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    text = httpx.get(f"{server.base_url}/metrics").text
    drafted = re.search(r'^kvserve:spec_decode_num_draft_tokens_total\{[^}]*\} (\S+)$', text, re.M)
    accepted = re.search(r'^kvserve:spec_decode_num_accepted_tokens_total\{[^}]*\} (\S+)$', text, re.M)
    assert drafted and accepted and float(drafted.group(1)) > 0
    assert 0 <= float(accepted.group(1)) <= float(drafted.group(1))
    assert "kvserve:spec_decode_mean_acceptance_length" in text
