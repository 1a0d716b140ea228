"""Tool calls as JSON inside tags: Hermes/Qwen's `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
(one call per block) and SmolLM2's `<tool_call>[{...}, ...]</tool_call>` (a list per block).

One parser serves both formats (each block may hold an object or a list); the registry names differ by
the chat template that teaches the model its format (templates/), used when the model's own template
ignores tools. Text outside the blocks is the message's content. A block that does not hold calls
(bad JSON, no name) stays in the content as it was written, in whole responses and streams alike.

NOTE: whitespace right before a block, and at the end of a message with calls, is not content: the
whole parse strips it, and the streamer holds back each trailing whitespace run until it knows.
"""
from __future__ import annotations

import re
from functools import cached_property
from importlib import resources

from kvserve.server.tool_parsers.base import ParsedMessage, StreamDelta, ToolCall
from kvserve.server.tool_parsers.json_calls import CallsValue, parse_calls


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could be the start of `tag` (held back in a stream)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class TaggedJsonParser:
    """`extract` / `streamer` for JSON calls between `start` and `end` tags."""

    def __init__(self, name: str, start: str = "<tool_call>", end: str = "</tool_call>",
                 template: str | None = None):
        self.name, self.start, self.end = name, start, end
        self.template_file = template
        self._block = re.compile(re.escape(start) + r"(.*?)(" + re.escape(end) + r"|\Z)", re.DOTALL)

    @cached_property
    def chat_template(self) -> str | None:
        """A chat template that renders tools in this format, for models whose own template ignores them."""
        if self.template_file is None:
            return None
        return resources.files("kvserve.server.tool_parsers").joinpath("templates", self.template_file).read_text()

    def extract(self, text: str) -> ParsedMessage:
        calls: list[ToolCall] = []
        parts, pos, blocks = [], 0, 0
        for m in self._block.finditer(text):
            body = m.group(1)
            if not m.group(2):  # unterminated: a partial end tag is not part of the JSON
                body = body[:len(body) - _partial_suffix(body, self.end)]
            found = parse_calls(body)
            if found is None:
                continue  # not calls: the block stays in the content
            parts.append(text[pos:m.start()].rstrip())
            calls += found
            pos, blocks = m.end(), blocks + 1
        if not blocks:
            return ParsedMessage(text, [])
        tail = text[pos:]
        parts.append(tail.rstrip() if calls else tail)
        content = "".join(parts)
        return ParsedMessage(content or None if calls else content, calls)

    def streamer(self) -> "_TaggedStreamer":
        return _TaggedStreamer(self.start, self.end)


class _Content:
    """Content deltas, minus a trailing whitespace run held until the next text says what it is."""

    def __init__(self) -> None:
        self.held = ""

    def emit(self, text: str, delta: StreamDelta) -> None:
        text = self.held + text
        kept = text.rstrip()
        self.held = text[len(kept):]
        delta.add_content(kept)

    def take_held(self) -> str:
        held, self.held = self.held, ""
        return held


class _Block:
    """One block after its start tag: the JSON value, then anything up to the end tag (dropped). If the
    value turns out not to hold calls, the block's text so far and up to the end tag is content."""

    def __init__(self, raw: str, end: str, value: CallsValue):
        self.raw = raw  # the block's text so far (with the whitespace before it), in case it is content
        self.end = end
        self.value = value
        self.state = "value"  # value -> after (calls sent) | raw (content)
        self.tail = ""  # a possible partial end tag

    def feed(self, text: str) -> tuple[StreamDelta, str, str, bool]:
        """(call deltas, content, the text after the block, whether the block closed)."""
        delta, content = StreamDelta(), ""
        if self.state == "value":
            delta, left = self.value.feed(text)
            self.raw += text[:len(text) - len(left)]
            if self.value.failed and not self.value.num_calls:
                self.state, content, self.raw = "raw", self.raw, ""
            elif self.value.failed or self.value.done:
                self.state = "after"
            else:
                return delta, "", "", False
            text = left
        text, self.tail = self.tail + text, ""
        i = text.find(self.end)
        if i >= 0:
            passed, rest, closed = text[:i + len(self.end)], text[i + len(self.end):], True
        else:
            keep = _partial_suffix(text, self.end)
            passed, self.tail, rest, closed = text[:len(text) - keep], text[len(text) - keep:], "", False
        return delta, content + passed if self.state == "raw" else content, rest, closed

    def finish(self) -> tuple[StreamDelta, str]:
        if self.state == "value":
            delta = self.value.finish()
            return delta, self.raw if self.value.failed and not self.value.num_calls else ""
        return StreamDelta(), self.tail if self.state == "raw" else ""


class _TaggedStreamer:
    def __init__(self, start: str, end: str):
        self.start, self.end = start, end
        self.pending = ""  # text outside blocks not yet sent: a possible partial start tag
        self.content = _Content()
        self.block: _Block | None = None
        self.num_calls = 0

    def _next_index(self) -> int:
        self.num_calls += 1
        return self.num_calls - 1

    def feed(self, text: str) -> StreamDelta:
        delta = StreamDelta()
        self.pending += text
        while self.pending:
            if self.block is None:
                i = self.pending.find(self.start)
                if i < 0:
                    cut = len(self.pending) - _partial_suffix(self.pending, self.start)
                    self.content.emit(self.pending[:cut], delta)
                    self.pending = self.pending[cut:]
                    break
                self.content.emit(self.pending[:i], delta)
                self.block = _Block(self.content.take_held() + self.start, self.end, CallsValue(self._next_index))
                self.pending = self.pending[i + len(self.start):]
                continue
            calls, content, rest, closed = self.block.feed(self.pending)
            self.content.emit(content, delta)
            delta.extend(calls)
            self.pending = rest
            if closed:
                self.block = None
        return delta

    def finish(self) -> StreamDelta:
        delta = StreamDelta()
        if self.block is not None:
            calls, content = self.block.finish()
            self.content.emit(content, delta)
            delta.extend(calls)
            self.block = None
        self.content.emit(self.pending, delta)  # NOTE: a partial start tag at the very end is just text
        self.pending = ""
        held = self.content.take_held()
        if not self.num_calls:
            delta.add_content(held)
        return delta
