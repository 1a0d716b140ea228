"""Pydantic models of the Anthropic Messages API (POST /v1/messages, /v1/messages/count_tokens).

Parsed strictly like the OpenAI bodies (protocol.py): wrong JSON types are 400s, unknown fields are
ignored. Only text content is supported; other block types (images, tools) get a 400 that says so.
The request models hand the rest of the server plain data: the conversation as text parts, the
`cache_control` breakpoints, and SamplingParams.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvserve.sampling_params import SamplingParams
from kvserve.server.cache_control import MAX_BREAKPOINTS, Breakpoint, MessageParts
from kvserve.server.errors import APIError


# ---- requests ---------------------------------------------------------------------------------
class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class CacheControl(_Request):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class ContentBlock(_Request):
    # NOTE: `type` is a plain string so that an image or tool block gets our "not supported" message
    # rather than pydantic's error for every member of a union.
    type: str
    text: str | None = None
    cache_control: CacheControl | None = None


class Message(_Request):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


def _texts(content: str | list[ContentBlock], param: str) -> list[str]:
    if isinstance(content, str):
        return [content]
    texts = []
    for block in content:
        if block.type != "text" or block.text is None:
            raise APIError(400, f"{param}: content blocks of type {block.type!r} are not supported (text only)",
                           param=param)
        texts.append(block.text)
    return texts


class CountTokensRequest(_Request):
    """POST /v1/messages/count_tokens: the prompt part of a Messages request."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[ContentBlock] | None = None
    cache_control: CacheControl | None = None
    """Top level: marks the last block of the conversation (Anthropic's automatic caching)."""
    tools: list[Any] | None = None
    thinking: dict[str, Any] | None = None

    def check_supported(self) -> None:
        if self.tools:
            raise APIError(400, "tools are not supported", param="tools")
        if self.thinking is not None and self.thinking.get("type") != "disabled":
            raise APIError(400, "thinking: extended thinking is not supported by this server (send "
                                "{\"type\": \"disabled\"} or leave it out)", param="thinking")

    def conversation_parts(self) -> list[MessageParts]:
        """(role, text parts) per message; a non-empty system prompt becomes message 0."""
        parts: list[MessageParts] = []
        if self.system:
            parts.append(("system", _texts(self.system, "system")))
        for i, m in enumerate(self.messages):
            parts.append((m.role, _texts(m.content, f"messages.{i}.content")))
        return parts

    def cache_breakpoints(self) -> list[Breakpoint]:
        """Every block marked with cache_control, in prompt order. Raises APIError past Anthropic's limit."""
        blocks: list[list[ContentBlock]] = []
        if self.system:
            blocks.append(self.system if isinstance(self.system, list) else [])
        blocks += [m.content if isinstance(m.content, list) else [] for m in self.messages]
        found = [Breakpoint(i, j + 1, b.cache_control.ttl or "5m")
                 for i, message_blocks in enumerate(blocks)
                 for j, b in enumerate(message_blocks) if b.cache_control is not None]
        if self.cache_control is not None:
            last = self.messages[-1].content
            num_parts = len(last) if isinstance(last, list) else 1
            found.append(Breakpoint(len(blocks) - 1, num_parts, self.cache_control.ttl or "5m"))
        if len(found) > MAX_BREAKPOINTS:
            raise APIError(400, f"a maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided, "
                                f"got {len(found)}", param="cache_control")
        return found

    @property
    def continues_assistant(self) -> bool:
        """A final assistant message is a prefill: the reply continues it (Anthropic's behaviour)."""
        return self.messages[-1].role == "assistant"


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = False
    metadata: dict[str, Any] | None = None

    def to_sampling_params(self, defaults: dict | None = None) -> SamplingParams:
        """defaults (--generation-config): for the sampling fields the request leaves unset (temperature, top_p,
        top_k, and those the Messages API has no field for: min_p, repetition_penalty); set fields win."""
        # NOTE: Anthropic's ranges, narrower than OpenAI's: temperature 0-1, top_k >= 0 (0: off). They bound
        # what a client sends; the operator's defaults are the server's own (vLLM's ranges).
        if self.temperature is not None and not 0.0 <= self.temperature <= 1.0:
            raise APIError(400, f"temperature: must be between 0 and 1, got {self.temperature}")
        if self.top_k is not None and self.top_k < 0:
            raise APIError(400, f"top_k: must be >= 0, got {self.top_k}")
        values = dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, stop=self.stop_sequences)
        kwargs = {k: v for k, v in values.items() if v is not None}
        # max_tokens is required by the Messages API, so a max_new_tokens default never applies here.
        kwargs = {k: v for k, v in (defaults or {}).items() if k != "max_tokens"} | kwargs
        try:
            return SamplingParams(max_tokens=self.max_tokens, **kwargs)
        except ValueError as e:  # NOTE: Anthropic's error body has no `param`; the message names the field
            raise APIError(400, str(e)) from None


# ---- responses --------------------------------------------------------------------------------
class CacheCreation(BaseModel):
    ephemeral_5m_input_tokens: int
    ephemeral_1h_input_tokens: int


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int
    cache_creation: CacheCreation


class TextContent(BaseModel):
    type: Literal["text"] = "text"
    text: str


class MessageResponse(BaseModel):
    """A whole /v1/messages answer; also the `message` of the stream's message_start event."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[TextContent]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence"] | None
    stop_sequence: str | None
    usage: Usage


class CountTokensResponse(BaseModel):
    input_tokens: int
