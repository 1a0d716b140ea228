"""Tool-call parsers by name (`--tool-call-parser`, vLLM's flag), and the choice of one for a model.

- `hermes`: Hermes/Qwen's `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks.
- `smollm2`: SmolLM2's `<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>` (its model card's
  function-calling format).
- `auto` (the default): inferred from the chat template (see `infer_tool_parser`).
"""
from __future__ import annotations

from kvserve.server.tool_parsers.base import (ParsedMessage, StreamDelta, ToolCall, ToolCallDelta, ToolParser,
                                              ToolStreamer)
from kvserve.server.tool_parsers.constrained import NamedCallParser, RequiredCallsParser
from kvserve.server.tool_parsers.tagged import TaggedJsonParser

_PARSERS: dict[str, TaggedJsonParser] = {
    "hermes": TaggedJsonParser("hermes", template="hermes.jinja"),
    "smollm2": TaggedJsonParser("smollm2", template="smollm2.jinja"),
}
PARSER_NAMES = tuple(_PARSERS)
AUTO = "auto"


def get_tool_parser(name: str) -> TaggedJsonParser:
    """The parser registered as `name`; ValueError naming the known ones otherwise."""
    if name not in _PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {', '.join(PARSER_NAMES)} "
                         f"(or {AUTO}: inferred from the chat template)")
    return _PARSERS[name]


def infer_tool_parser(chat_template: str | None) -> TaggedJsonParser | None:
    """The parser for a model's chat template: one that writes `<tool_call>` blocks is Hermes-style (Qwen,
    Hermes, SmolLM3), a list in them SmolLM2's; SmolLM2's own template (the built-in model) renders no
    tools but its model card teaches its list format. None: unknown, auto tool choice is unavailable."""
    template = chat_template if isinstance(chat_template, str) else ""
    if "<tool_call>[" in template:
        return _PARSERS["smollm2"]
    if "<tool_call>" in template:
        return _PARSERS["hermes"]
    if "SmolLM" in template:
        return _PARSERS["smollm2"]
    return None


def resolve_tool_parser(name: str, chat_template: str | None) -> TaggedJsonParser | None:
    """--tool-call-parser: a registered name, or auto (infer_tool_parser)."""
    return infer_tool_parser(chat_template) if name == AUTO else get_tool_parser(name)


__all__ = ["AUTO", "PARSER_NAMES", "NamedCallParser", "ParsedMessage", "RequiredCallsParser", "StreamDelta",
           "TaggedJsonParser", "ToolCall", "ToolCallDelta", "ToolParser", "ToolStreamer", "get_tool_parser",
           "infer_tool_parser", "resolve_tool_parser"]
