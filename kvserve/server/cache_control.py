"""Anthropic's `cache_control` on the server side: a breakpoint -> how many prompt tokens to pin, and the
cache fields of `usage`.

Token count of a breakpoint. The engine pins a number of leading prompt *tokens*, but the client marks a
content *block*; the chat template puts role headers and end-of-turn markers around each message, so
the block's end cannot be read off its text. We render the template again on the conversation truncated
right after the marked block (no generation prompt), tokenize that, and take the length of the common
prefix with the full prompt's tokens. Cutting at the first disagreement covers both the template's
closing markers (kept only when the full prompt has them too) and a BPE merge across the cut (the
merged token belongs to the full prompt, not to the prefix, so it is left out).

Usage (Anthropic's meaning, with the engine's numbers):
    cache_read     = prompt tokens served from the prefix cache (RequestOutput.num_cached_tokens)
    cache_creation = tokens of the pinned prefix not read from the cache; only full KV blocks are
                     cached, so the pinned prefix is the breakpoint's tokens rounded down to a block
    input          = the rest: prompt - cache_read - cache_creation
"""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.server.prompts import render_chat

TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}
MAX_BREAKPOINTS = 4  # Anthropic's limit per request

# One message of a conversation as text parts (content blocks), e.g. ("user", ["part 1", "part 2"]).
MessageParts = tuple[str, list[str]]


@dataclass(frozen=True)
class Breakpoint:
    """A `cache_control` mark: the prompt prefix up to and including one content block."""

    message_index: int
    """Index into the conversation (the system prompt, when there is one, is message 0)."""
    num_parts: int
    """Content blocks of that message up to and including the marked one."""
    ttl: str
    """"5m" or "1h" (a key of TTL_SECONDS)."""


def join_parts(parts: list[str]) -> str:
    # NOTE: text blocks of one message are joined with newlines, as the OpenAI endpoint joins content parts.
    return "\n".join(parts)


def conversation(messages: list[MessageParts]) -> list[dict[str, str]]:
    """The chat-template input for a conversation of text parts."""
    return [{"role": role, "content": join_parts(parts)} for role, parts in messages]


def breakpoint_num_tokens(tokenizer, messages: list[MessageParts], bp: Breakpoint, prompt_ids: list[int]) -> int:
    """Prompt tokens up to and including the breakpoint's block (see the module docstring)."""
    role, parts = messages[bp.message_index]
    truncated = conversation(messages[:bp.message_index] + [(role, parts[:bp.num_parts])])
    text = render_chat(tokenizer, truncated, add_generation_prompt=False)
    prefix_ids = tokenizer.encode(text, add_special_tokens=False)  # as chat_prompt encodes the full prompt
    return common_prefix_len(prefix_ids, prompt_ids)


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


@dataclass(frozen=True)
class CacheUsage:
    """The input side of Anthropic's usage: input + cache_creation + cache_read = prompt tokens."""

    input_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int


def cache_usage(num_prompt_tokens: int, num_cached_tokens: int, num_pin_tokens: int, block_size: int) -> CacheUsage:
    """Split a prompt's tokens into read / created / plain input (num_pin_tokens: 0 without cache_control).

    NOTE: cache_creation reports what the request asked to pin; past --max-pinned-fraction the engine pins
    fewer blocks (the request still runs), which /debug/prefix-cache shows, not usage."""
    pinned = num_pin_tokens // block_size * block_size
    creation = max(0, pinned - num_cached_tokens)
    return CacheUsage(num_prompt_tokens - num_cached_tokens - creation, creation, num_cached_tokens)
