"""What a tool parser returns, whole or streamed, and the two protocols parsers implement.

A parser reads tool calls out of the model's output text: `extract` from the whole text (a whole
response), `streamer()` a per-choice object fed the text as it is generated (a stream). These are plain
dataclasses; the server turns them into OpenAI's JSON (protocol.py).
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Protocol


def new_call_id() -> str:
    """OpenAI's shape of a tool-call id ("call_" and 24 characters)."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    """One function call: `arguments` is JSON text (OpenAI sends it as a string)."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)


@dataclass(frozen=True)
class ParsedMessage:
    """The whole output split into the text outside the calls and the calls."""

    content: str | None
    """None when the output held calls and nothing else but whitespace."""
    tool_calls: list[ToolCall]


@dataclass
class ToolCallDelta:
    """A piece of the call at `index`: its first delta carries id and name, later ones only arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class StreamDelta:
    """What one piece of output text adds to the message: content, and/or pieces of calls."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def add_content(self, text: str) -> None:
        self.content += text

    def add_call(self, delta: ToolCallDelta) -> None:
        last = self.calls[-1] if self.calls else None
        if last is not None and last.index == delta.index and delta.id is None:
            last.arguments += delta.arguments  # NOTE: one entry per call per chunk, as OpenAI streams them
        else:
            self.calls.append(delta)

    def extend(self, other: "StreamDelta") -> None:
        self.add_content(other.content)
        for call in other.calls:
            self.add_call(call)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)


class ToolStreamer(Protocol):
    """One choice's incremental parser: feed text pieces in order, then finish once."""

    def feed(self, text: str) -> StreamDelta: ...

    def finish(self) -> StreamDelta:
        """Flush what was held back (a possible start tag, an unfinished call) at the end of the output."""
        ...


class ToolParser(Protocol):
    name: str
    """The registry name (--tool-call-parser)."""

    def extract(self, text: str) -> ParsedMessage: ...

    def streamer(self) -> ToolStreamer: ...
