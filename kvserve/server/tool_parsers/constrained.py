"""Parsers for outputs that constrained decoding shaped (tool_choice "required" or a named function).

Named function: the whole output is the function's arguments (a JSON object of its parameters schema).
"required": the output is a JSON list of `{"name": ..., "parameters": {...}}` (vLLM's shape). Neither
looks at tags: the grammar leaves the model no room for them.
"""
from __future__ import annotations

from kvserve.server.tool_parsers.base import ParsedMessage, StreamDelta, ToolCall, ToolCallDelta, new_call_id
from kvserve.server.tool_parsers.json_calls import CallsValue, parse_calls


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
    """The output is a JSON list of calls. Output that is not one (a truncated list) is content."""

    name = "required"

    def extract(self, text: str) -> ParsedMessage:
        calls = parse_calls(text)
        if not calls:
            return ParsedMessage(text, [])
        return ParsedMessage(None, calls)

    def streamer(self) -> "_RequiredStreamer":
        return _RequiredStreamer()


class _RequiredStreamer:
    def __init__(self) -> None:
        self.num_calls = 0
        self.value = CallsValue(self._next_index)
        self.raw = ""  # everything so far, sent as content if no call ever came of it
        self.as_content = False

    def _next_index(self) -> int:
        self.num_calls += 1
        return self.num_calls - 1

    def feed(self, text: str) -> StreamDelta:
        if self.as_content:
            return StreamDelta(content=text)
        self.raw += text
        if self.value.done or self.value.failed:
            return StreamDelta()  # NOTE: after the list: nothing the grammar allows
        delta, _ = self.value.feed(text)
        if self.value.failed and not self.num_calls:
            self.as_content = True
            return StreamDelta(content=self.raw)
        return delta

    def finish(self) -> StreamDelta:
        if self.as_content:
            return StreamDelta()
        delta = StreamDelta() if self.value.done else self.value.finish()
        if not self.num_calls:
            return StreamDelta(content=self.raw)
        return delta
