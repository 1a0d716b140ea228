"""Incremental detokenization with stop strings, for one generated sequence.

Decoding token by token breaks multi-byte characters and word-piece spacing, so each step decodes a small
window (from `prefix_offset`) twice, with and without the newest tokens, and emits the difference only
once it no longer ends in an incomplete character (U+FFFD). The window starts with a few prompt tokens so
the first output token gets the spacing it would have in context.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# Prompt tokens kept as left context for the first output tokens.
_CONTEXT_TOKENS = 5


@dataclass
class IncrementalDetokenizer:
    tokenizer: object
    prompt_token_ids: list[int]
    stop_strings: list[str]
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    text: str = ""
    stop_reason: str | None = None
    _tokens: list[int] = field(default_factory=list)
    _prefix_offset: int = 0
    _read_offset: int = 0
    _emitted: int = 0

    def __post_init__(self) -> None:
        self._tokens = list(self.prompt_token_ids[-_CONTEXT_TOKENS:])
        self._read_offset = len(self._tokens)

    @property
    def _holdback(self) -> int:
        # A stop string may begin in the text seen so far and end in a later token: hold back that much.
        return max((len(s) for s in self.stop_strings), default=1) - 1

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=self.skip_special_tokens)

    def add_tokens(self, token_ids: list[int], finished: bool = False) -> bool:
        """Append tokens; returns True if a stop string was found (text is then cut at it)."""
        if self.stop_reason is not None:
            return True
        self._tokens.extend(token_ids)
        prefix = self._decode(self._tokens[self._prefix_offset:self._read_offset])
        full = self._decode(self._tokens[self._prefix_offset:])
        if len(full) > len(prefix) and (finished or not full.endswith("\ufffd")):
            before = len(self.text)
            self.text += full[len(prefix):]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._tokens)
            return self._find_stop(before)
        return False

    def _find_stop(self, new_from: int) -> bool:
        for stop in self.stop_strings:
            i = self.text.find(stop, max(0, new_from - len(stop) + 1))
            if i != -1:
                self.text = self.text[:i + len(stop)] if self.include_stop_str_in_output else self.text[:i]
                self.stop_reason = stop
                return True
        return False

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out; while running, holds back what could still become a stop string."""
        end = len(self.text) if finished or not self.stop_strings else max(self._emitted,
                                                                             len(self.text) - self._holdback)
        delta = self.text[self._emitted:end]
        self._emitted = end
        return delta
