"""Parsers for outputs that constrained decoding shaped (tool_choice "required" or a named function).

Named function: the whole output is the function's arguments (a JSON object of its parameters schema).
"required": the output is a JSON list of `{"name": ..., "parameters": {...}}` (vLLM's shape). Neither
looks at tags, and neither ever answers content: the grammar leaves the model no room for anything else.
"""
from __future__ import annotations

from kvserve.server.tool_parsers.base import ParsedMessage, StreamDelta, ToolCall, ToolCallDelta, new_call_id
from kvserve.server.tool_parsers.json_calls import CallsValue, parse_calls, parse_complete_calls


class NamedCallParser:
    """The output is the arguments of `function`: one call, whatever the text (it is sent as generated)."""

    def __init__(self, function: str):
        self.name = "named"
        self.function = function

    def extract(self, text: str) -> ParsedMessage:
        return ParsedMessage(None, [ToolCall(self.function, text)])

    def streamer(self) -> "_NamedStreamer":
        return _NamedStreamer(self.function)


class _NamedStreamer:
    def __init__(self, function: str):
        self.function = function
        self.started = False

    def feed(self, text: str) -> StreamDelta:
        delta = StreamDelta()
        if not self.started:
            self.started = True
            delta.add_call(ToolCallDelta(0, id=new_call_id(), name=self.function))
        if text:
            delta.add_call(ToolCallDelta(0, arguments=text))
        return delta

    def finish(self) -> StreamDelta:
        return self.feed("") if not self.started else StreamDelta()


class RequiredCallsParser:
    """The output is a JSON list of calls, never content: the grammar allows nothing else. A list cut short
    (max_tokens) gives its complete calls, possibly none (vLLM then answers no calls and no content too)."""

    name = "required"

    def extract(self, text: str) -> ParsedMessage:
        calls = parse_calls(text)
        return ParsedMessage(None, parse_complete_calls(text) if calls is None else calls)

    def streamer(self) -> "_RequiredStreamer":
        return _RequiredStreamer()


class _RequiredStreamer:
    """Calls as they are generated; a cut list ends with the calls announced so far (the last one's arguments
    as far as they came: a stream cannot take them back)."""

    def __init__(self) -> None:
        self.num_calls = 0
        self.value = CallsValue(self._next_index)

    def _next_index(self) -> int:
        self.num_calls += 1
        return self.num_calls - 1

    def feed(self, text: str) -> StreamDelta:
        if self.value.done or self.value.failed:
            return StreamDelta()  # NOTE: after the list: nothing the grammar allows
        delta, _ = self.value.feed(text)
        return delta

    def finish(self) -> StreamDelta:
        if self.value.done or self.value.failed:
            return StreamDelta()
        return self.value.finish()
