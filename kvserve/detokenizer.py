"""Incremental detokenization with stop strings, for one generated sequence.

Decoding token by token breaks multi-byte characters and word-piece spacing, so each step decodes a small
window (from `prefix_offset`) twice, with and without the newest tokens, and emits the difference only
once it no longer ends in an incomplete character (U+FFFD). The window starts with a few prompt tokens so
the first output token gets the spacing it would have in context.

A fast (Rust-backed) tokenizer does this with `tokenizers.decoders.DecodeStream`, which keeps the same
window in Rust. The Python window below serves tokenizers without a Rust backend (a slow tokenizer, the
dummy model's `IdTokenizer`) and the last step of a sequence that ends inside a character, which is
emitted as it decodes (with U+FFFD) rather than held back forever.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# Prompt tokens kept as left context for the first output tokens.
_CONTEXT_TOKENS = 5


def rust_backend(tokenizer) -> Tokenizer | None:
    """The `tokenizers.Tokenizer` whose decode is exactly `tokenizer.decode`, or None.

    NOTE: a tokenizer that cleans up tokenization spaces after decoding is left to the Python window,
    which decodes through `tokenizer.decode` and so keeps that clean-up."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer) or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return backend


@dataclass
class IncrementalDetokenizer:
    tokenizer: object
    prompt_token_ids: list[int]
    stop_strings: list[str]
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    text: str = ""
    stop_reason: str | None = None
    # The window: _tokens[_prefix_offset:_read_offset] is already in `text`, _tokens[_read_offset:] is not yet.
    # DecodeStream keeps the same window; these mirror it for the Python path.
    _tokens: list[int] = field(default_factory=list)
    _prefix_offset: int = 0
    _read_offset: int = 0
    _emitted: int = 0
    _backend: Tokenizer | None = None
    _stream: DecodeStream | None = None

    def __post_init__(self) -> None:
        self._tokens = list(self.prompt_token_ids[-_CONTEXT_TOKENS:])
        self._read_offset = len(self._tokens)
        self._backend = rust_backend(self.tokenizer)
        # NOTE: DecodeStream takes no prefix from context that ends inside a character (it would emit the
        # context itself); the Python window diffs against it as it decodes.
        if self._backend is not None and not self._backend.decode(
                self._tokens, skip_special_tokens=self.skip_special_tokens).endswith("\ufffd"):
            self._stream = DecodeStream(self._tokens, skip_special_tokens=self.skip_special_tokens)

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
        new_text = self._step_stream(token_ids)
        if new_text is None:
            new_text = self._step_window(finished)
        if new_text is None:
            return False
        before = len(self.text)
        self.text += new_text
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        return self._find_stop(before)

    def _step_stream(self, token_ids: list[int]) -> str | None:
        if self._stream is None:
            return None
        try:
            return self._stream.step(self._backend, token_ids)
        except Exception:
            # NOTE: DecodeStream refuses a window whose text does not extend its prefix's text; the Python
            # window takes the difference anyway, as it always did, from here on.
            self._stream = None
            return None

    def _step_window(self, finished: bool) -> str | None:
        """The window's new text, or None while it ends inside a character (unless finished) or adds none."""
        if self._stream is not None and not finished:
            return None
        prefix = self._decode(self._tokens[self._prefix_offset:self._read_offset])
        full = self._decode(self._tokens[self._prefix_offset:])
        if len(full) > len(prefix) and (finished or not full.endswith("\ufffd")):
            return full[len(prefix):]
        return None

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
