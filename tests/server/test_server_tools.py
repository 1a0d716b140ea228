"""Tool calling through the server (its app in process). With the tiny random model, named and "required" calls are
constrained, so their arguments validate against the parameters schema whatever the model, greedy and
sampled, streamed and whole, through the `openai` client. With the built-in SmolLM2 and a weather tool,
what a 135M model does with tools is reported, not judged."""
from __future__ import annotations

import json

import jsonschema
import pytest

from tests.helpers.server import in_process
from tests.helpers.tool_calling import WEATHER_TOOL, accumulate, tool


# ---- the server, tiny random model ---------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_llama):
    yield from in_process(tiny_llama[0], "--max-num-seqs", "8", "--stats-interval", "0")


@pytest.fixture(scope="module")
def client(server):
    return server.openai(timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


# Schemas whose every value is bounded (enums, ranges, short strings, short arrays), so even a random
# model's constrained output ends well within max_tokens.
TOOLS = [
    WEATHER_TOOL,
    tool("set_alarm", {"type": "object", "properties": {
        "hour": {"type": "integer", "minimum": 0, "maximum": 23},
        "minute": {"type": "integer", "minimum": 0, "maximum": 59},
        "repeat": {"type": "boolean"}}, "required": ["hour", "minute", "repeat"], "additionalProperties": False}),
    tool("tag_items", {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]},
                 "minItems": 1, "maxItems": 3},
        "owner": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999}},
                  "required": ["id"], "additionalProperties": False}},
        "required": ["tags", "owner"], "additionalProperties": False}),
    tool("no_arguments"),
]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object", "properties": {}})
           for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris? Then set an alarm at 7:30."}]


def _check_calls(calls, names=None) -> None:
    assert calls, "no tool calls"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _streamed_calls(client, **params):
    with client.chat.completions.stream(**params) as s:
        for event in s:
            if event.type == "chunk":
                pass
        return s.get_final_completion().choices[0]


@pytest.mark.parametrize("name", list(SCHEMAS))
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 11}], ids=["greedy", "sampled"])
def test_named_function_arguments_always_validate(client, model, check_schema, name, sampling):
    params = dict(model=model, messages=MESSAGES, tools=TOOLS, max_completion_tokens=200,
                  tool_choice={"type": "function", "function": {"name": name}}, **sampling)
    raw = client.chat.completions.with_raw_response.create(**params)
    check_schema("CreateChatCompletionResponse", raw.http_response.json())
    choice = raw.parse().choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1 and choice.message.tool_calls[0].function.name == name
    _check_calls(choice.message.tool_calls)
    rebuilt = _streamed_calls(client, **params)
    assert rebuilt.finish_reason == "tool_calls"
    _check_calls(rebuilt.message.tool_calls, [name])
    # greedy, or sampled with a seed: the stream writes the same arguments as the whole response
    assert rebuilt.message.tool_calls[0].function.arguments == choice.message.tool_calls[0].function.arguments


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 5, "n": 3}],
                         ids=["greedy", "sampled-n3"])
def test_required_calls_always_validate(client, model, check_schema, sampling):
    params = dict(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_completion_tokens=300,
                  **sampling)
    raw = client.chat.completions.with_raw_response.create(**params)
    check_schema("CreateChatCompletionResponse", raw.http_response.json())
    for choice in raw.parse().choices:
        assert choice.finish_reason == "tool_calls", choice
        _check_calls(choice.message.tool_calls, SCHEMAS)
    chunks = list(client.chat.completions.create(**params, stream=True))
    for chunk in chunks:
        check_schema("CreateChatCompletionStreamResponse", chunk.to_dict())
    for i in range(sampling.get("n", 1)):
        rebuilt = accumulate([c.to_dict() for c in chunks], i)
        assert rebuilt.finish_reason == "tool_calls"
        _check_calls(rebuilt.message.tool_calls, SCHEMAS)
    one = client.chat.completions.create(**{**params, "n": 1}, parallel_tool_calls=False)
    assert len(one.choices[0].message.tool_calls) == 1


def test_auto_and_none_on_the_random_model_validate(client, model, check_schema):
    """Random weights do not call tools; whatever they write is answered in OpenAI's shape."""
    for choice in ("auto", "none"):
        params = dict(model=model, messages=MESSAGES, tools=TOOLS, tool_choice=choice, max_completion_tokens=24,
                      temperature=0)
        raw = client.chat.completions.with_raw_response.create(**params)
        check_schema("CreateChatCompletionResponse", raw.http_response.json())
        for chunk in client.chat.completions.create(**params, stream=True):
            check_schema("CreateChatCompletionStreamResponse", chunk.to_dict())


def test_a_conversation_with_earlier_calls_and_results_renders(client, model):
    messages = [*MESSAGES,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "22 C, sunny"}]
    out = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_completion_tokens=4,
                                         temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("body,needle", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch"}}}, "'launch'"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [tool("f", {"type": "object", "properties": {"a": {"type": 3}}})]}, "not a valid JSON Schema"),
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
])
def test_bad_tool_requests_get_400(server, check_schema, body, needle):
    with server.http(timeout=60) as http:
        r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    check_schema("ErrorResponse", r.json())
    assert needle in r.json()["error"]["message"]


def test_named_calls_over_the_structured_output_schemas(client, model):
    """Every object schema of the structured-output tests as a function's parameters: the call validates.
    Two have unbounded values (a free string, free integers) that random weights may run on past
    max_tokens; a cut call is reported as finish_reason "length", never passed off as complete."""
    from tests.helpers.structured_schemas import SCHEMAS as STRUCTURED

    cases = [(name, prompt, schema) for name, prompt, schema in STRUCTURED if schema.get("type") == "object"]
    assert len(cases) >= 20
    validated = 0
    for i, (name, prompt, schema) in enumerate(cases):
        out = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], tools=[tool(name, schema), TOOLS[3]],
            max_completion_tokens=400, tool_choice={"type": "function", "function": {"name": name}},
            **({"temperature": 0} if i % 2 else {"temperature": 1.0, "seed": i}))
        choice = out.choices[0]
        assert choice.message.tool_calls[0].function.name == name
        if choice.finish_reason == "length" and name in ("person", "ref_defs"):
            continue
        assert choice.finish_reason == "tool_calls", (name, choice)
        jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), schema)
        validated += 1
    assert validated >= len(cases) - 2


SMOL_SCRIPT = ('<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
               '{"name": "set_alarm", "arguments": {"hour": 7, "minute": 30, "repeat": false}}]</tool_call>')


def test_auto_parses_what_the_model_writes_through_the_server(client, model, check_schema):
    """The model's output forced to a SmolLM2-format call list (a `choice` constraint): the server parses
    it, whole and streamed, and the openai client's stream helper rebuilds the same calls."""
    params = dict(model=model, messages=MESSAGES, tools=TOOLS, max_completion_tokens=200, temperature=0,
                  extra_body={"structured_outputs": {"choice": [SMOL_SCRIPT]}})
    raw = client.chat.completions.with_raw_response.create(**params)
    check_schema("CreateChatCompletionResponse", raw.http_response.json())
    choice = raw.parse().choices[0]
    expected = [("get_weather", {"city": "Paris", "unit": "celsius"}),
                ("set_alarm", {"hour": 7, "minute": 30, "repeat": False})]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == expected
    _check_calls(choice.message.tool_calls, SCHEMAS)
    chunks = list(client.chat.completions.create(**params, stream=True))
    for chunk in chunks:
        check_schema("CreateChatCompletionStreamResponse", chunk.to_dict())
    assert sum(bool(c.choices and c.choices[0].delta.tool_calls) for c in chunks) > 4  # arguments come piecewise
    rebuilt = _streamed_calls(client, **params)
    assert rebuilt.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in rebuilt.message.tool_calls] == expected
    none = client.chat.completions.create(**params, tool_choice="none")
    assert none.choices[0].message.content == SMOL_SCRIPT and not none.choices[0].message.tool_calls


# ---- the built-in SmolLM2-135M-Instruct --------------------------------------------------------
GET_WEATHER = tool("get_weather", {"type": "object", "properties": {
    "location": {"type": "string", "description": "City name, e.g. Paris", "maxLength": 40},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["location"]},
    description="Get the current weather in a given location")


@pytest.fixture(scope="module")
def smollm2_client(smollm2_path):
    for srv in in_process(smollm2_path, "--stats-interval", "0"):
        yield srv.openai(timeout=300)


@pytest.mark.slow  # NOTE: the real SmolLM2 behind the server, ~15 s: in `make test`, not `make test-fast`
def test_smollm2_weather_question_with_a_weather_tool(smollm2_client, check_schema):
    messages = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    params = dict(model=smollm2_client.models.list().data[0].id, messages=messages, tools=[GET_WEATHER],
                  max_completion_tokens=80, temperature=0)
    raw = smollm2_client.chat.completions.with_raw_response.create(**params)  # tool_choice auto (the default)
    check_schema("CreateChatCompletionResponse", raw.http_response.json())
    auto = raw.parse().choices[0]
    print(f"\nSmolLM2, tool_choice auto (greedy): finish_reason={auto.finish_reason} "
          f"content={auto.message.content!r} tool_calls={[(c.function.name, c.function.arguments) for c in auto.message.tool_calls or []]}")
    for call in auto.message.tool_calls or []:
        assert call.function.name == "get_weather"  # the only tool it was shown
    named = smollm2_client.chat.completions.create(
        **params, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = named.choices[0].message.tool_calls[0]
    print(f"SmolLM2, named get_weather: {call.function.arguments}")
    assert named.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), GET_WEATHER["function"]["parameters"])


# OpenAI's own weather example: unbounded strings (with it SmolLM2 repeats its call in a "required" list)
OPENAI_WEATHER = tool("get_weather", {"type": "object", "properties": {
    "location": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["location"]}, description="Get the current weather in a given location")


@pytest.mark.slow  # NOTE: the real SmolLM2 behind the server
@pytest.mark.parametrize("sampling", [{"seed": 0}, {"temperature": 0}], ids=["served-defaults", "greedy"])
def test_smollm2_required_always_answers_tool_calls(smollm2_client, check_schema, sampling):
    """Issue 34: with this tool SmolLM2 repeats its call until max_tokens (the built-in default, 50) cuts the
    list; that was answered as content. Now: the complete calls, finish_reason "length"; parallel_tool_calls
    false: one call that closes the list."""
    messages = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    params = dict(model=smollm2_client.models.list().data[0].id, messages=messages, tools=[OPENAI_WEATHER],
                  tool_choice="required", **sampling)
    raw = smollm2_client.chat.completions.with_raw_response.create(**params)
    check_schema("CreateChatCompletionResponse", raw.http_response.json())
    choice = raw.parse().choices[0]
    print(f"\nSmolLM2, required ({sampling}): finish_reason={choice.finish_reason} "
          f"tool_calls={[(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]}")
    assert choice.message.content is None and choice.message.tool_calls
    assert choice.finish_reason in ("tool_calls", "length")
    for call in choice.message.tool_calls:
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), OPENAI_WEATHER["function"]["parameters"])
    chunks = [c.to_dict() for c in smollm2_client.chat.completions.create(**params, stream=True)]
    for chunk in chunks:
        check_schema("CreateChatCompletionStreamResponse", chunk)
    rebuilt = accumulate(chunks, cut=choice.finish_reason == "length")
    assert rebuilt.finish_reason == choice.finish_reason and not rebuilt.message.content
    whole = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert [(c.function.name, c.function.arguments) for c in rebuilt.message.tool_calls][:len(whole)] == whole
    one = smollm2_client.chat.completions.create(**params, parallel_tool_calls=False).choices[0]
    assert one.finish_reason == "tool_calls" and one.message.content is None and len(one.message.tool_calls) == 1
    jsonschema.validate(json.loads(one.message.tool_calls[0].function.arguments),
                        OPENAI_WEATHER["function"]["parameters"])
