"""Issue 13 (part 3): tool calling in /v1/chat/completions.

- The parsers (hermes, smollm2, and the two for constrained outputs), whole and streamed, with the text
  split at every character: a stream must add up to what the whole parse returns. Malformed calls are
  content, never a crash.
- tool_choice validation and the constraint schemas (server/tool_choice.py), without a server.
- The serving layer on scripted engine outputs (the random test model never calls a tool by itself):
  whole responses and SSE chunks validate against OpenAI's schemas, and the `openai` client's own
  stream accumulation rebuilds the calls.
- The real server with the tiny random model: named and "required" calls are constrained, so their
  arguments validate against the parameters schema whatever the model, greedy and sampled, streamed
  and whole, through the `openai` client.
- The built-in SmolLM2 with a weather tool (what a 135M model does with tools is reported, not judged).
"""
from __future__ import annotations

import asyncio
import json
import random
import re

import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server.config import ServerConfig
from kvserve.server.errors import APIError
from kvserve.server.protocol import ChatCompletionRequest
from kvserve.server.serving_chat import _ChatRun
from kvserve.server.tool_choice import plan_tools, required_schema
from kvserve.server.tool_parsers import (NamedCallParser, RequiredCallsParser, StreamDelta, get_tool_parser,
                                         infer_tool_parser, resolve_tool_parser)
from test_server import API_KEY, check_schema, served  # noqa: F401  (check_schema is a fixture)

SMOLLM2 = get_tool_parser("smollm2")
HERMES = get_tool_parser("hermes")


# ---- helpers ----------------------------------------------------------------------------------
def _check_call_delta(d, seen: set) -> None:
    if d.id is not None:  # a call's first delta: id and name, once, at the next index
        assert d.index == len(seen) and d.index not in seen and d.name and d.id.startswith("call_")
        seen.add(d.index)
    else:
        assert d.index in seen and d.name is None


def streamed(parser, pieces: list[str]) -> tuple[str, list[tuple[str, object]]]:
    """(content, [(name, parsed arguments)]) of a stream of `pieces`."""
    s = parser.streamer()
    merged, seen = StreamDelta(), set()
    deltas = [s.feed(p) for p in pieces] + [s.finish()]
    for d in deltas:
        for c in d.calls:
            _check_call_delta(c, seen)
        merged.extend(d)
    calls: dict[int, list] = {}
    for c in merged.calls:
        entry = calls.setdefault(c.index, [c.name, ""])
        entry[1] += c.arguments
    return merged.content, [(name, json.loads(args)) for name, args in calls.values()]


def whole(parser, text: str) -> tuple[str, list[tuple[str, object]]]:
    parsed = parser.extract(text)
    return parsed.content or "", [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


def splits(text: str, seed: int = 0) -> list[list[str]]:
    """Two pieces cut at every character, one character at a time, and a few random chunkings."""
    out = [[text[:k], text[k:]] for k in range(len(text) + 1)] + [list(text)]
    rng = random.Random(seed)
    for _ in range(5):
        cuts = sorted(rng.sample(range(len(text) + 1), min(4, len(text) + 1)))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return out


# ---- parsers: whole and streamed ----------------------------------------------------------------
WEATHER = {"city": "Paris", "unit": "celsius"}
VALID = [
    (SMOLLM2, 'Sure.\n<tool_call>[\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n]'
              '</tool_call>', "Sure.", [("get_weather", WEATHER)]),
    (SMOLLM2, '<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"n": [1, 2]}}]</tool_call>',
     "", [("a", {}), ("b", {"n": [1, 2]})]),
    (HERMES, '<tool_call>\n{"name": "a", "arguments": {"q": "x \\"}\\" y", "n": [1, {"k": null}], "é": "ü"}}\n'
             '</tool_call>\n<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>',
     "", [("a", {"q": 'x "}" y', "n": [1, {"k": None}], "é": "ü"}), ("b", {})]),
    (HERMES, '<tool_call>{"arguments": {"x": 1}, "name": "later"}</tool_call>', "", [("later", {"x": 1})]),
    (HERMES, '<tool_call>{"name": "s", "arguments": "{\\"x\\": 1}"}</tool_call>', "", [("s", {"x": 1})]),
    (HERMES, '<tool_call>{"name": "p", "parameters": {"x": true}}</tool_call>', "", [("p", {"x": True})]),
    (HERMES, '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>\nDone.', "\nDone.", [("f", {"x": 1})]),
    (SMOLLM2, '<tool_call>[{"name": "open", "arguments": {"x": 1}}]', "", [("open", {"x": 1})]),
    (SMOLLM2, '<tool_call>[{"name": "cut", "arguments": {}}]</tool_', "", [("cut", {})]),
    (SMOLLM2, "No tool needed: the answer is 4.  \n", "No tool needed: the answer is 4.  \n", []),
    (SMOLLM2, "<tool_call>[]</tool_call>", "", []),
    (SMOLLM2, "a < b and <tool but not a call", "a < b and <tool but not a call", []),
]


@pytest.mark.parametrize("parser,text,content,calls", VALID, ids=range(len(VALID)))
def test_whole_parse(parser, text, content, calls):
    assert whole(parser, text) == (content, calls)
    parsed = parser.extract(text)
    assert parsed.content is None if calls and not content else parsed.content == content
    assert len({c.id for c in parsed.tool_calls}) == len(calls)


@pytest.mark.parametrize("parser,text,content,calls", VALID, ids=range(len(VALID)))
def test_stream_split_anywhere_adds_up_to_the_whole_parse(parser, text, content, calls):
    for pieces in splits(text):
        assert streamed(parser, pieces) == (content, calls), pieces


def test_stream_sends_the_call_head_before_its_arguments_and_arguments_as_they_come():
    text = '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>'
    s = SMOLLM2.streamer()
    deltas = [s.feed(ch) for ch in text] + [s.finish()]
    calls = [c for d in deltas for c in d.calls]
    assert calls[0].name == "get_weather" and calls[0].arguments == ""
    head_at = next(i for i, d in enumerate(deltas) if d.calls)
    assert text[:head_at + 1].endswith('"arguments":')  # announced as soon as the arguments' key arrived
    assert len(calls) > 10 and "".join(c.arguments for c in calls) == '{"city": "Paris"}'
    assert not any(d.content for d in deltas)


MALFORMED = [
    '<tool_call>{"name": broken}</tool_call> tail',
    "<tool_call>not json at all</tool_call>",
    "<tool_call>[1, 2]</tool_call>",
    '<tool_call>{"name": "", "arguments": {}}</tool_call>',
    '<tool_call>{"name": 5}</tool_call>',
    "<tool_call></tool_call>",
    "<tool_call>",
    "text <tool_c",
    '<tool_call>{"arguments": {"x": 1}}</tool_call>',
    '<tool_call>[{"name": "f", "arguments": {"x": 1}]</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"x": 1',
    '<tool_call>[{"name": "f", "arguments": {}}, 7]</tool_call>',
]
# Malformed before any call was announced: a stream can still give the text back as content.
UNANNOUNCED = MALFORMED[:9]


@pytest.mark.parametrize("text", MALFORMED)
def test_malformed_calls_are_content_and_never_crash(text):
    for parser in (SMOLLM2, HERMES):
        parsed = parser.extract(text)
        assert parsed.content == text and parsed.tool_calls == []
        for pieces in splits(text):
            s = parser.streamer()
            deltas = [s.feed(p) for p in pieces] + [s.finish()]
            if text in UNANNOUNCED:
                assert "".join(d.content for d in deltas) == text and not any(d.calls for d in deltas)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.sampled_from(['<tool_call>', '</tool_call>', '[', ']', '{', '}', '"name"', '"arguments"', ':',
                                 ',', '"f"', '"x\\"', ' ', '\n', '1', 'hi', '<tool', '"']), max_size=30),
       st.integers(0, 10))
def test_any_text_parses_without_crashing(words, cut):
    text = "".join(words)
    for parser in (SMOLLM2, HERMES):
        parsed = parser.extract(text)
        if not parsed.tool_calls and not re.search(r"\[\s*\]", text):  # [] is "no call", not content
            assert parsed.content == text
        s = parser.streamer()
        delta = StreamDelta()
        for piece in (text[:cut], text[cut:]):
            delta.extend(s.feed(piece))
        delta.extend(s.finish())
        if not delta.calls and not parsed.tool_calls:
            assert delta.content == parsed.content


def test_required_and_named_parsers():
    text = '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]'
    required = RequiredCallsParser()
    assert whole(required, text) == ("", [("f", {"a": 1}), ("g", {})])
    for pieces in splits(text):
        assert streamed(required, pieces) == ("", [("f", {"a": 1}), ("g", {})])
    for bad in ('[{"name": "f", "parameters": {"a"', "not json", "[]", '[{"parameters": {}}]'):
        assert required.extract(bad).content == bad and not required.extract(bad).tool_calls
        s = required.streamer()
        deltas = [s.feed(ch) for ch in bad] + [s.finish()]
        if '"name"' in bad:  # announced before it broke: the stream keeps the call (it cannot take it back)
            assert [c.name for d in deltas for c in d.calls if c.name] == ["f"]
        else:
            assert "".join(d.content for d in deltas) == bad and not any(d.calls for d in deltas)
    named = NamedCallParser("get_weather")
    args = '{"city":"Paris"}'
    assert whole(named, args) == ("", [("get_weather", {"city": "Paris"})])
    assert named.extract(args).tool_calls[0].arguments == args
    for pieces in splits(args):
        assert streamed(named, pieces) == ("", [("get_weather", {"city": "Paris"})])


# ---- registry, inference, flags -----------------------------------------------------------------
def test_parser_registry_and_inference(smollm2_path):
    from kvserve.models.gguf_loader import load_gguf_tokenizer

    builtin = load_gguf_tokenizer(smollm2_path).chat_template
    assert "tools" not in builtin  # NOTE: the built-in template ignores tools, hence the fallback template
    assert infer_tool_parser(builtin) is SMOLLM2
    assert infer_tool_parser("{{ '<tool_call>\\n' }}{{ tools }}") is HERMES
    assert infer_tool_parser("{{ messages }}") is None and infer_tool_parser(None) is None
    assert resolve_tool_parser("hermes", builtin) is HERMES
    with pytest.raises(ValueError, match="hermes, smollm2"):
        get_tool_parser("nope")
    with pytest.raises(ValueError, match="unknown tool call parser 'nope'"):
        ServerConfig(tool_call_parser="nope")
    assert SMOLLM2.chat_template and "<tool_call>[" in SMOLLM2.chat_template
    assert HERMES.chat_template and "<tool_call>" in HERMES.chat_template


def test_unknown_tool_call_parser_exits_2_at_start_up(capsys):
    from kvserve.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--tool-call-parser", "nope"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--tool-call-parser" in err and "nope" in err and "hermes" in err


# ---- tool_choice: validation and constraints -----------------------------------------------------
def tool(name: str, parameters: dict | None = None, **extra) -> dict:
    function = {"name": name, **extra}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


WEATHER_TOOL = tool("get_weather", {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}, description="Current weather in a city")


def chat_request(**fields) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], **fields}
    return ChatCompletionRequest.model_validate_json(json.dumps(body))


def plan(parser=SMOLLM2, auto=True, template="{{ messages }}", **fields):
    return plan_tools(chat_request(**fields), parser, auto, template)


@pytest.mark.parametrize("fields,needle", [
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "'get_time'"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "needs tools"),
    ({"tools": [tool("f", {"type": "string"})]}, "type object"),
    ({"tools": [tool("f", {"type": "object", "properties": {"a": {"type": "strin"}}})]}, "properties.a.type"),
    ({"tools": [tool("f", {"type": "object", "properties": []})]}, "properties must be an object"),
    ({"tools": [tool("f", {"type": "object", "required": "a"})]}, "required"),
    ({"tools": [tool("bad name!")]}, "bad name!"),
    ({"tools": [tool("f"), tool("f")]}, "twice"),
])
def test_tool_choice_errors_are_400_naming_the_problem(fields, needle):
    with pytest.raises(APIError) as e:
        plan(**fields)
    assert e.value.status_code == 400 and needle in e.value.message


def test_auto_needs_the_flag_and_a_parser():
    with pytest.raises(APIError, match="--enable-auto-tool-choice"):
        plan(auto=False, tools=[WEATHER_TOOL])
    with pytest.raises(APIError, match="--tool-call-parser"):
        plan(parser=None, tools=[WEATHER_TOOL])
    assert plan(parser=None, tools=[WEATHER_TOOL], tool_choice="required").mode == "required"


def test_plans_per_tool_choice():
    none = plan(tools=[WEATHER_TOOL], tool_choice="none")
    assert none.mode == "none" and none.parser is None and none.constraint is None and none.tools
    assert plan(tool_choice="none").tools is None  # "none" without tools is allowed (as vLLM allows it)
    auto = plan(tools=[WEATHER_TOOL])
    assert auto.mode == "auto" and auto.parser is SMOLLM2 and auto.constraint is None
    assert auto.chat_template == SMOLLM2.chat_template  # the model's template ignores tools
    assert plan(tools=[WEATHER_TOOL], template="{{ tools }}").chat_template is None
    named = plan(tools=[WEATHER_TOOL, tool("noop")], tool_choice={"type": "function",
                                                                  "function": {"name": "get_weather"}})
    assert named.constraint.json == WEATHER_TOOL["function"]["parameters"]
    assert named.constraint.disable_any_whitespace
    assert plan(tools=[tool("noop")], tool_choice={"type": "function", "function": {"name": "noop"}}
                ).constraint.json == {"type": "object", "properties": {}}
    required = plan(tools=[WEATHER_TOOL, tool("noop")], tool_choice="required", parallel_tool_calls=False)
    assert required.constraint.json["maxItems"] == 1 and required.max_calls == 1
    params = required.constrain(SamplingParams())
    assert params.structured_outputs is required.constraint
    with pytest.raises(APIError, match="response_format"):
        required.constrain(params)


def test_required_schema_accepts_calls_of_the_tools_only():
    defs_tool = tool("place", {"type": "object", "properties": {"at": {"$ref": "#/$defs/point"}},
                               "required": ["at"], "$defs": {"point": {"type": "object", "properties": {
                                   "x": {"type": "integer"}}, "required": ["x"]}}})
    schemas = {t["function"]["name"]: t["function"].get("parameters", {"type": "object", "properties": {}})
               for t in (WEATHER_TOOL, tool("noop"), defs_tool)}
    schema = required_schema(schemas)
    jsonschema.Draft202012Validator.check_schema(schema)
    ok = [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}},
          {"name": "noop", "parameters": {}}, {"name": "place", "parameters": {"at": {"x": 3}}}]
    jsonschema.validate(ok, schema)
    for bad in ([], [{"name": "other", "parameters": {}}], [{"name": "get_weather", "parameters": {"city": 1}}],
                [{"name": "noop"}], [{"name": "place", "parameters": {"at": {"x": "3"}}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


# ---- the serving layer on scripted outputs -------------------------------------------------------
class ScriptedStream:
    """A RequestStream stand-in: DELTA (streams) or FINAL_ONLY (whole) outputs of fixed texts."""

    def __init__(self, texts: list[str], pieces: int, finish: str = "stop", delta: bool = True):
        self.texts, self.pieces, self.finish, self.delta = texts, pieces, finish, delta
        self.num_output_tokens = [len(t) for t in texts]

    async def __aiter__(self):
        cuts = [[t[i * len(t) // self.pieces:(i + 1) * len(t) // self.pieces] for i in range(self.pieces)]
                for t in self.texts]
        for step in range(self.pieces if self.delta else 0):
            last = step == self.pieces - 1
            yield RequestOutput("r", None, [1, 2, 3], [
                CompletionOutput(i, cut[step], [0], finish_reason=self.finish if last else None)
                for i, cut in enumerate(cuts)], finished=last,
                new_token_ids=[[0]] * len(cuts), new_texts=[cut[step] for cut in cuts])
        if not self.delta:
            yield RequestOutput("r", None, [1, 2, 3], [CompletionOutput(i, t, [0] * len(t), finish_reason=self.finish)
                                                      for i, t in enumerate(self.texts)], finished=True)


def run_scripted(texts: list[str], pieces: int = 7, finish: str = "stop", **fields):
    """(whole response body, SSE chunk dicts) for a chat request whose model 'writes' `texts`."""
    request = chat_request(**fields, n=len(texts))
    tools = plan_tools(request, SMOLLM2, True, "{{ messages }}")
    run = _ChatRun(request, "m", SamplingParams(n=len(texts)), tools)

    async def go():
        body = json.loads((await run.respond(ScriptedStream(texts, pieces, finish, delta=False))).body)
        events = [e async for e in run.events(ScriptedStream(texts, pieces, finish))]
        return body, events

    body, events = asyncio.run(go())
    assert events[-1] == "data: [DONE]\n\n"
    return body, [json.loads(e[len("data: "):]) for e in events[:-1]]


def accumulate(chunks: list[dict], index: int = 0, cut: bool = False):
    """The openai client's own accumulation of a stream (what `client.chat.completions.stream` does)."""
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    # NOTE: get_final_completion refuses a cut ("length") response; the snapshot is the same accumulation
    completion = state.current_completion_snapshot if cut else state.get_final_completion()
    return next(c for c in completion.choices if c.index == index)


SCRIPT = ('Let me check.\n<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
          '{"name": "get_weather", "arguments": {"city": "Lyon", "unit": "celsius"}}]</tool_call>')


def test_auto_tool_calls_whole_and_streamed_validate_and_rebuild_with_the_openai_client(check_schema):
    body, chunks = run_scripted([SCRIPT], tools=[WEATHER_TOOL])
    check_schema("CreateChatCompletionResponse", body)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me check."
    calls = choice["message"]["tool_calls"]
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("function", "get_weather", {"city": "Paris", "unit": "celsius"}),
        ("function", "get_weather", {"city": "Lyon", "unit": "celsius"})]
    assert all(c["id"].startswith("call_") for c in calls) and calls[0]["id"] != calls[1]["id"]

    for chunk in chunks:
        check_schema("CreateChatCompletionStreamResponse", chunk)
    heads = [tc for c in chunks for ch in c["choices"] for tc in ch["delta"].get("tool_calls", []) if "id" in tc]
    assert [h["index"] for h in heads] == [0, 1]
    assert all(h["type"] == "function" and h["function"]["name"] == "get_weather" for h in heads)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    rebuilt = accumulate(chunks)
    assert rebuilt.finish_reason == "tool_calls" and rebuilt.message.content == "Let me check."
    assert [(t.function.name, json.loads(t.function.arguments)) for t in rebuilt.message.tool_calls] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_n_choices_parse_separately_and_plain_answers_stay_content(check_schema):
    body, chunks = run_scripted([SCRIPT, "It is sunny."], pieces=5, tools=[WEATHER_TOOL])
    check_schema("CreateChatCompletionResponse", body)
    plain = body["choices"][1]
    assert plain["finish_reason"] == "stop" and plain["message"]["content"] == "It is sunny."
    assert "tool_calls" not in plain["message"]
    assert len(accumulate(chunks, 0).message.tool_calls) == 2
    assert accumulate(chunks, 1).message.content == "It is sunny." and not accumulate(chunks, 1).message.tool_calls


def test_parallel_tool_calls_false_keeps_the_first_call(check_schema):
    body, chunks = run_scripted([SCRIPT], tools=[WEATHER_TOOL], parallel_tool_calls=False)
    assert len(body["choices"][0]["message"]["tool_calls"]) == 1
    assert len(accumulate(chunks).message.tool_calls) == 1


def test_tool_choice_none_never_parses_and_a_cut_call_keeps_finish_reason_length(check_schema):
    body, chunks = run_scripted([SCRIPT], tools=[WEATHER_TOOL], tool_choice="none")
    assert body["choices"][0]["message"]["content"] == SCRIPT and body["choices"][0]["finish_reason"] == "stop"
    assert accumulate(chunks).message.content == SCRIPT
    cut = SCRIPT[:SCRIPT.index("Lyon")]
    body, chunks = run_scripted([cut], finish="length", tools=[WEATHER_TOOL])
    check_schema("CreateChatCompletionResponse", body)
    assert body["choices"][0]["finish_reason"] == "length"
    assert accumulate(chunks, cut=True).finish_reason == "length"


# ---- the real server, tiny random model ----------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    yield from served(tiny_llama[0], tmp_path_factory, "--max-num-seqs", "8", "--stats-interval", "0")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


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
    import httpx

    r = httpx.post(f"{server.base_url}/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"messages": MESSAGES, "max_tokens": 2, **body}, timeout=60)
    assert r.status_code == 400, r.text
    check_schema("ErrorResponse", r.json())
    assert needle in r.json()["error"]["message"]


def test_named_calls_over_the_structured_output_schemas(client, model):
    """Every object schema of the structured-output tests as a function's parameters: the call validates.
    Two have unbounded values (a free string, free integers) that random weights may run on past
    max_tokens; a cut call is reported as finish_reason "length", never passed off as complete."""
    from structured_schemas import SCHEMAS as STRUCTURED

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
    """The model's output forced to a SmolLM2-format call list (a `choice` constraint): the real server
    parses it, whole and streamed, and the openai client's stream helper rebuilds the same calls."""
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
def smollm2_client(smollm2_path, tmp_path_factory):
    for srv in served(smollm2_path, tmp_path_factory, "--stats-interval", "0"):
        yield openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


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
