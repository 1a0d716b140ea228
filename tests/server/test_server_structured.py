"""Structured outputs through the OpenAI server (its app in process) with the `openai` client:
response_format json_schema / json_object and vLLM's structured_outputs (choice, regex, grammar) on chat and
completions, with the built-in SmolLM2 (its answers have to be JSON that validates, whatever it would have
said) and the tiny model (errors)."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from tests.helpers.server import in_process
from tests.helpers.structured_schemas import SCHEMAS

pytest.importorskip("xgrammar")


@pytest.fixture(scope="module")
def smol(smollm2_path):
    yield from in_process(smollm2_path, "--stats-interval", "0", "--max-num-seqs", "32", "--kv-cache-memory", "256MiB")


@pytest.fixture(scope="module")
def smol_client(smol):
    client = smol.openai(timeout=300)
    client.model = client.models.list().data[0].id
    return client


def _chat_schema(client, prompt: str, schema: dict, temperature: float, seed: int, stream: bool):
    kwargs = dict(model=client.model, temperature=temperature, seed=seed, max_tokens=256,
                  messages=[{"role": "user", "content": prompt + " Answer in JSON."}],
                  response_format={"type": "json_schema",
                                   "json_schema": {"name": "answer", "schema": schema, "strict": True}})
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        return choice.message.content, choice.finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return text, finish


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_schema_outputs_parse_and_validate(smol_client, temperature):
    """22 schemas (nested objects, enums, arrays, required fields, string patterns, ranges, anyOf, $ref),
    sent at once; every answer parses and validates (half of them streamed)."""
    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        futures = [pool.submit(_chat_schema, smol_client, prompt, schema, temperature, i, i % 2 == 1)
                   for i, (_, prompt, schema) in enumerate(SCHEMAS)]
        results = [f.result() for f in futures]
    failures = []
    for (name, _, schema), (text, finish) in zip(SCHEMAS, results):
        try:
            jsonschema.validate(json.loads(text), schema)
            assert finish == "stop"
        except (ValueError, AssertionError, jsonschema.ValidationError) as e:
            failures.append((name, finish, text[:120], str(e)[:120]))
    assert not failures, failures


@pytest.mark.slow
def test_json_object_choice_regex_grammar_on_chat_and_completions(smol_client):
    client = smol_client
    messages = [{"role": "user", "content": "Describe the Eiffel tower."}]
    for seed in range(3):
        r = client.chat.completions.create(model=client.model, messages=messages, seed=seed,
                                           temperature=0.7, max_tokens=200,
                                           response_format={"type": "json_object"})
        assert isinstance(json.loads(r.choices[0].message.content), dict)
        r = client.chat.completions.create(model=client.model, messages=messages, seed=seed,
                                           temperature=1.0, max_tokens=20,
                                           extra_body={"structured_outputs": {"choice": ["tall", "short"]}})
        assert r.choices[0].message.content in ("tall", "short")
        r = client.completions.create(model=client.model, prompt="My phone number is", seed=seed,
                                      temperature=1.0, max_tokens=30,
                                      extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}})
        assert re.fullmatch(r"\d{3}-\d{4}", r.choices[0].text), r.choices[0].text
        r = client.completions.create(model=client.model, prompt="Is the sky blue?", seed=seed,
                                      temperature=1.0, max_tokens=10,
                                      extra_body={"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}})
        assert r.choices[0].text in ("yes", "no")
        r = client.completions.create(model=client.model, prompt="A person as JSON:", seed=seed,
                                      temperature=0.7, max_tokens=200,
                                      extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                          "name": "p", "schema": SCHEMAS[0][2]}}})
        jsonschema.validate(json.loads(r.choices[0].text), SCHEMAS[0][2])


# ---- errors, on the tiny model ----------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tiny_llama):
    yield from in_process(tiny_llama[0], "--stats-interval", "0")


@pytest.mark.parametrize("body, param, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
     "response_format", 'Unsupported type "frob"'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "schema must be a JSON schema object"),
    ({"response_format": {"type": "xml"}}, "response_format", "response_format type must be"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs", "Regex parsing error"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs", "unknown fields"),
    ({"structured_outputs": {"grammar": "root ::= nope"}}, "structured_outputs", "nope"),
    ({"structured_outputs": {"choice": "yes"}, "response_format": {"type": "json_object"}}, "response_format",
     "not both"),
])
def test_invalid_specs_get_400_naming_the_problem(tiny, check_schema, body, param, message):
    with tiny.http() as http:
        for path, base in [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                           ("/v1/completions", {"prompt": "hi"})]:
            r = http.post(path, json={**base, **body, "max_tokens": 5})
            assert r.status_code == 400, (path, r.text)
            error = r.json()["error"]
            check_schema("ErrorResponse", r.json())
            assert error["param"] == param and message in error["message"], (path, error)
        assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3}).status_code == 200
