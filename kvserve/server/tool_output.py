"""A chat choice's output text through the request's tool parser -> OpenAI's message with `tool_calls`
(whole responses) or its deltas (streams: a call's id, type and name first, then argument pieces)."""
from __future__ import annotations

from kvserve.server.protocol import (ChatResponseMessage, FunctionCallChunk, ResponseFunctionCall, ResponseToolCall,
                                     ToolCallChunk)
from kvserve.server.tool_choice import ToolPlan
from kvserve.server.tool_parsers import StreamDelta


def tool_finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's "tool_calls" for an output that ended on its own with calls; a cut one stays "length"."""
    return "tool_calls" if called and reason == "stop" else reason


def tool_message(plan: ToolPlan, text: str) -> ChatResponseMessage:
    if plan.parser is None:
        return ChatResponseMessage(content=text)
    parsed = plan.parser.extract(text)
    calls = [ResponseToolCall(id=c.id, function=ResponseFunctionCall(name=c.name, arguments=c.arguments))
             for c in parsed.tool_calls[:plan.max_calls]]
    # NOTE: "required" answers a list even when max_tokens cut its first call: [] and no content, as vLLM.
    return ChatResponseMessage(content=parsed.content, tool_calls=calls or ([] if plan.mode == "required" else None))


class ToolDeltas:
    """One choice's stream through the parser: each text piece -> (content, tool-call chunks)."""

    def __init__(self, plan: ToolPlan):
        self.streamer = plan.parser.streamer()
        self.max_calls = plan.max_calls
        self.called = False

    def feed(self, text: str, finished: bool) -> tuple[str | None, list[ToolCallChunk] | None]:
        delta = self.streamer.feed(text) if text else StreamDelta()
        if finished:
            delta.extend(self.streamer.finish())
        chunks = [_chunk(c) for c in delta.calls if self.max_calls is None or c.index < self.max_calls]
        self.called = self.called or bool(chunks)
        return delta.content or None, chunks or None


def _chunk(c) -> ToolCallChunk:
    if c.id is None:
        return ToolCallChunk(index=c.index, function=FunctionCallChunk(arguments=c.arguments))
    return ToolCallChunk(index=c.index, id=c.id, type="function",
                         function=FunctionCallChunk(name=c.name, arguments=c.arguments))
