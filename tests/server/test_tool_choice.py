"""tool_choice validation and constraint schemas (server/tool_choice.py), without a server; then the chat
serving layer on scripted engine outputs (the random test model never calls a tool by itself): whole
responses and SSE chunks validate against OpenAI's schemas, and the `openai` client's own stream
accumulation rebuilds the calls."""
from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server.errors import APIError
from kvserve.server.serving_chat import _ChatRun
from kvserve.server.tool_choice import plan_tools, required_schema
from tests.helpers.tool_calling import SMOLLM2, WEATHER_TOOL, accumulate, chat_request, tool


# ---- tool_choice: validation and constraints -----------------------------------------------------
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


REQUIRED = ('[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, '
            '{"name": "get_weather", "parameters": {"city": "Lyon", "unit": "celsius"}}]')


def _required_cut(text: str, check_schema):
    """(whole choice, the openai client's rebuilt stream) of a "required" output cut by max_tokens at `text`:
    finish_reason length, never content."""
    body, chunks = run_scripted([text], finish="length", tools=[WEATHER_TOOL], tool_choice="required")
    check_schema("CreateChatCompletionResponse", body)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    for chunk in chunks:
        check_schema("CreateChatCompletionStreamResponse", chunk)
        assert not any(ch["delta"].get("content") for ch in chunk["choices"])
    rebuilt = accumulate(chunks, cut=True)
    assert rebuilt.finish_reason == "length" and not rebuilt.message.content
    return choice, rebuilt


def test_required_list_cut_by_max_tokens_answers_its_complete_calls_with_finish_reason_length(check_schema):
    """Issue 34: a small model repeats calls until max_tokens cuts the list; that was answered as content."""
    choice, rebuilt = _required_cut(REQUIRED[:REQUIRED.index("Lyon")], check_schema)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in choice["message"]["tool_calls"]
            ] == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    # the stream announced the cut call too (its arguments as far as they came); the first one is whole
    assert [t.function.name for t in rebuilt.message.tool_calls] == ["get_weather", "get_weather"]
    assert json.loads(rebuilt.message.tool_calls[0].function.arguments) == {"city": "Paris", "unit": "celsius"}
    whole, _ = run_scripted([REQUIRED], tools=[WEATHER_TOOL], tool_choice="required")
    assert whole["choices"][0]["finish_reason"] == "tool_calls"
    assert len(whole["choices"][0]["message"]["tool_calls"]) == 2


def test_required_list_cut_inside_its_first_call_answers_no_calls_and_no_content(check_schema):
    """vLLM's answer when not one call is complete: an empty call list, no content, finish_reason length."""
    choice, _ = _required_cut(REQUIRED[:REQUIRED.index("Paris")], check_schema)
    assert choice["message"]["tool_calls"] == []
    body, chunks = run_scripted(["[{"], finish="length", tools=[WEATHER_TOOL], tool_choice="required")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": None, "refusal": None, "tool_calls": []}
    rebuilt = accumulate(chunks, cut=True)
    assert not rebuilt.message.content and not rebuilt.message.tool_calls
