"""What the tool-calling tests share: the parsers, tool definitions, a chat request body, and the `openai`
client's own accumulation of a stream."""
from __future__ import annotations

import json

from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from kvserve.server.protocol import ChatCompletionRequest
from kvserve.server.tool_parsers import get_tool_parser

SMOLLM2 = get_tool_parser("smollm2")
HERMES = get_tool_parser("hermes")


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


def accumulate(chunks: list[dict], index: int = 0, cut: bool = False):
    """The openai client's own accumulation of a stream (what `client.chat.completions.stream` does)."""
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    # NOTE: get_final_completion refuses a cut ("length") response; the snapshot is the same accumulation
    completion = state.current_completion_snapshot if cut else state.get_final_completion()
    return next(c for c in completion.choices if c.index == index)
