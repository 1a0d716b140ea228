"""Calls written as JSON: one `{"name": ..., "arguments": {...}}` object, or a list of them.

Hermes/Qwen wrap one object per `<tool_call>` block, SmolLM2 a list per block, and the constrained
output of tool_choice "required" is a bare list of `{"name", "parameters"}` (vLLM's key). Both argument
keys are accepted everywhere.

Whole text: `parse_calls` (json.loads; None when it is not such a value). Streamed text: `CallsValue`
scans the value a piece at a time and announces a call (id, name) as soon as `{"name": "...",
"arguments":` has arrived, then passes the arguments' own text through as it comes, so a client sees
the arguments grow token by token. Objects whose keys come in another order are parsed once they close.

NOTE: a scanner, not `partial-json-parser`: that library turns the text so far into a value, so streamed
arguments would be re-serialized and diffed (no longer the model's own text), the arguments' key would
show only once its value starts, and it cannot say where a value ends (text after it is an error); it
also parses the whole text again for every piece.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable

from kvserve.server.tool_parsers.base import StreamDelta, ToolCall, ToolCallDelta, new_call_id

ARGUMENT_KEYS = ("arguments", "parameters")
_BLANK = re.compile(r"\s*")
# The head of a call object in the usual key order: the name, then the arguments' key.
_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:')


def _call_of(obj) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a parsed call object, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in ARGUMENT_KEYS if k in obj), {})
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def parse_calls(text: str) -> list[ToolCall] | None:
    """The calls in `text` (a call object or a list of them; [] is no call), or None if it is neither.

    Text after the value is ignored, as the streaming scanner ignores it."""
    try:
        value, _ = json.JSONDecoder().raw_decode(text.lstrip())
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = [_call_of(item) for item in items]
    if any(c is None for c in calls):
        return None
    return [ToolCall(name, args) for name, args in calls]


def parse_complete_calls(text: str) -> list[ToolCall]:
    """The calls that closed in `text`, a list of calls cut short (by max_tokens): `[{...}, {...}, {"na` ->
    the first two. Parsing stops at the first item that is not a whole call."""
    decoder = json.JSONDecoder()
    text = text.lstrip()
    if not text.startswith("["):
        return []
    calls: list[ToolCall] = []
    pos = _BLANK.match(text, 1).end()
    while True:
        try:
            item, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return calls
        call = _call_of(item)
        if call is None:
            return calls
        calls.append(ToolCall(*call))
        pos = _BLANK.match(text, pos).end()
        if not text.startswith(",", pos):
            return calls
        pos = _BLANK.match(text, pos + 1).end()


class _ValueEnd:
    """Finds the bracket that closes a JSON object or array, skipping brackets inside strings."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def feed(self, text: str) -> int | None:
        """The index in `text` just past the closing bracket, or None if the value is still open."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


class _CallObject:
    """One call object, streamed. The text fed starts at its `{`.

    NOTE: once a call is announced it stays announced: if the object later turns out malformed, the
    call ends with the arguments already sent (a stream cannot take text back)."""

    def __init__(self, next_index: Callable[[], int]):
        self.next_index = next_index
        self.text = ""
        self.end = _ValueEnd()
        self.done = self.failed = False
        self.index: int | None = None  # set when the call is announced
        self.args_pos: int | None = None  # where the arguments' unsent text starts in self.text
        self.args_end: _ValueEnd | None = None  # None until the arguments are known to be an object/array
        self.args_closed = False
        self.buffer_args = False  # arguments that are not an object or array are sent once the call closes

    @property
    def num_calls(self) -> int:
        return int(self.index is not None)

    def feed(self, text: str) -> tuple[StreamDelta, str]:
        """(what the text adds, the text after the object's end)."""
        close = self.end.feed(text)
        self.text += text if close is None else text[:close]
        rest = "" if close is None else text[close:]
        delta = StreamDelta()
        if self.index is None:
            self._announce(delta)
        if self.index is not None and not self.buffer_args and not self.args_closed:
            self._stream_args(delta)
        if close is not None:
            self.done = True
            self._close(delta)
        return delta, rest

    def finish(self) -> StreamDelta:
        """The output ended inside the object: an announced call keeps what it has; otherwise it failed."""
        delta = StreamDelta()
        if self.done:
            return delta
        if self.index is None:
            self.failed = True
        elif self.buffer_args and self.args_pos is not None:
            delta.add_call(ToolCallDelta(self.index, arguments=self.text[self.args_pos:]))
        return delta

    def _announce(self, delta: StreamDelta) -> None:
        head = _HEAD.match(self.text)
        if head is None:
            return
        try:
            name = json.loads(head.group(1))
        except ValueError:
            return  # NOTE: a bad escape in the name: parsed whole when the object closes, or fails then
        if not name:
            return
        self.index = self.next_index()
        self.args_pos = head.end()
        delta.add_call(ToolCallDelta(self.index, id=new_call_id(), name=name))

    def _stream_args(self, delta: StreamDelta) -> None:
        if self.args_end is None:
            while self.args_pos < len(self.text) and self.text[self.args_pos].isspace():
                self.args_pos += 1
            if self.args_pos == len(self.text):
                return
            if self.text[self.args_pos] not in "{[":
                self.buffer_args = True
                return
            self.args_end = _ValueEnd()
        new = self.text[self.args_pos:]
        close = self.args_end.feed(new)
        sent = new if close is None else new[:close]
        self.args_pos += len(sent)
        self.args_closed = close is not None
        if sent:
            delta.add_call(ToolCallDelta(self.index, arguments=sent))

    def _close(self, delta: StreamDelta) -> None:
        if self.index is not None and not self.buffer_args:
            return
        try:
            call = _call_of(json.loads(self.text))
        except ValueError:
            call = None
        if self.index is None:  # never announced: keys in another order, or not a call at all
            if call is None:
                self.failed = True
                return
            self.index = self.next_index()
            delta.add_call(ToolCallDelta(self.index, id=new_call_id(), name=call[0], arguments=call[1]))
            return
        # announced, with arguments that are a string or a number: sent whole
        args = call[1] if call is not None else self.text[self.args_pos:].rstrip().removesuffix("}").rstrip()
        delta.add_call(ToolCallDelta(self.index, arguments=args))


class _CallList:
    """A list of call objects, streamed. The text fed starts at its `[`."""

    def __init__(self, next_index: Callable[[], int]):
        self.next_index = next_index
        self.state = "open"  # open -> item (or end) -> object -> after -> item ... -> done | failed
        self.item: _CallObject | None = None
        self.num_calls = 0
        self.done = self.failed = False

    def feed(self, text: str) -> tuple[StreamDelta, str]:
        delta = StreamDelta()
        i = 0
        while i < len(text) and not (self.done or self.failed):
            if self.state == "object":
                part, rest = self.item.feed(text[i:])
                delta.extend(part)
                i = len(text) - len(rest)
                if self.item.failed:
                    self.failed = True
                elif self.item.done:
                    self.num_calls += self.item.num_calls
                    self.item, self.state = None, "after"
                continue
            ch = text[i]
            if ch.isspace():
                i += 1
            elif self.state == "open" and ch == "[":
                self.state, i = "item", i + 1
            elif self.state == "item" and ch == "{":
                self.item, self.state = _CallObject(self.next_index), "object"
            elif self.state in ("item", "after") and ch == "]":
                self.done, i = True, i + 1
            elif self.state == "after" and ch == ",":
                self.state, i = "item", i + 1
            else:
                self.failed = True
        return delta, text[i:]

    def finish(self) -> StreamDelta:
        delta = StreamDelta()
        if self.done:
            return delta
        if self.item is not None:
            delta = self.item.finish()
            self.num_calls += self.item.num_calls
        self.failed = self.failed or not self.done and self.num_calls == 0
        return delta


class CallsValue:
    """A call object or a list of them, whichever the first non-blank character says, streamed."""

    def __init__(self, next_index: Callable[[], int]):
        self.next_index = next_index
        self.value: _CallObject | _CallList | None = None
        self.failed = False

    @property
    def done(self) -> bool:
        return self.value is not None and self.value.done

    @property
    def num_calls(self) -> int:
        return 0 if self.value is None else self.value.num_calls

    def feed(self, text: str) -> tuple[StreamDelta, str]:
        if self.value is None:
            stripped = text.lstrip()
            if not stripped:
                return StreamDelta(), ""
            if stripped[0] not in "{[":
                self.failed = True
                return StreamDelta(), stripped
            self.value = (_CallObject if stripped[0] == "{" else _CallList)(self.next_index)
            text = stripped
        delta, rest = self.value.feed(text)
        self.failed = self.value.failed
        return delta, rest

    def finish(self) -> StreamDelta:
        if self.value is None:
            self.failed = True
            return StreamDelta()
        delta = self.value.finish()
        self.failed = self.value.failed
        return delta
