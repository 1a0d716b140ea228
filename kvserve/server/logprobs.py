"""The engine's per-token logprobs (dict token id -> Logprob) in OpenAI's two response formats, and prompt
logprobs in vLLM's `prompt_logprobs` field and in `echo` (OpenAI's legacy completions)."""
from __future__ import annotations

from kvserve.detokenizer import IncrementalDetokenizer
from kvserve.outputs import Logprob, PromptLogprobs
from kvserve.server.protocol import (ChatTokenLogprob, CompletionLogprobs, PromptLogprob, PromptLogprobsField,
                                     TopLogprob)

# OpenAI's stand-in for "very unlikely"; JSON has no -inf (a logit_bias of -100 can produce one).
_MIN_LOGPROB = -9999.0


def _finite(value: float) -> float:
    return value if value > _MIN_LOGPROB else _MIN_LOGPROB


def _text(lp: Logprob) -> str:
    return lp.decoded_token or ""


def _top(entry: dict[int, Logprob], k: int) -> list[Logprob]:
    """The k most likely tokens at this position, most likely first."""
    ranked = [lp for lp in entry.values() if lp.rank is not None and lp.rank <= k]
    return sorted(ranked, key=lambda lp: lp.rank)[:k]


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], k: int) -> list[ChatTokenLogprob]:
    out = []
    for token_id, entry in zip(token_ids, entries):
        chosen = entry[token_id]
        out.append(ChatTokenLogprob(
            token=_text(chosen), logprob=_finite(chosen.logprob), bytes=list(_text(chosen).encode()),
            top_logprobs=[TopLogprob(token=_text(lp), logprob=_finite(lp.logprob), bytes=list(_text(lp).encode()))
                          for lp in _top(entry, k)]))
    return out


def _completion_entry(token_id: int, entry: dict[int, Logprob], k: int) -> tuple[str, float, dict[str, float]]:
    chosen = entry[token_id]
    # NOTE: like vLLM, the chosen token is listed with the top k even when it ranks lower.
    top = {_text(lp): _finite(lp.logprob) for lp in _top(entry, k)}
    top.setdefault(_text(chosen), _finite(chosen.logprob))
    return _text(chosen), _finite(chosen.logprob), top


def completion_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], k: int,
                        text_offset: int) -> CompletionLogprobs:
    """`text_offset` is where the first of these tokens starts in the choice's text."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        text, logprob, top = _completion_entry(token_id, entry, k)
        tokens.append(text)
        token_logprobs.append(logprob)
        top_logprobs.append(top)
        offsets.append(text_offset)
        text_offset += len(text)
    return CompletionLogprobs(tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top_logprobs,
                              text_offset=offsets)


def echo_logprobs(tokenizer, token_ids: list[int], entries: PromptLogprobs, k: int) -> CompletionLogprobs:
    """`echo` with `logprobs`: the prompt's tokens, null for the first one's logprob and alternatives (as
    OpenAI and vLLM send it: nothing precedes it), each text_offset where that token starts in the echoed
    text, the prompt decoded (a character spelled over several tokens starts at the first of them)."""
    tokens, token_logprobs, top_logprobs = [], [], []
    for token_id, entry in zip(token_ids, entries):
        if entry is None:
            tokens.append(tokenizer.decode([token_id]))
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        text, logprob, top = _completion_entry(token_id, entry, k)
        tokens.append(text)
        token_logprobs.append(logprob)
        top_logprobs.append(top)
    return CompletionLogprobs(tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top_logprobs,
                              text_offset=token_offsets(tokenizer, token_ids[:len(tokens)]))


def token_offsets(tokenizer, token_ids: list[int]) -> list[int]:
    """Where each token starts in tokenizer.decode(token_ids), by incremental decoding (linear in the tokens,
    where decoding every prefix would be quadratic)."""
    detok = IncrementalDetokenizer(tokenizer, [], [], skip_special_tokens=False)
    offsets = []
    for token_id in token_ids:
        offsets.append(len(detok.text))
        detok.add_tokens([token_id])
    return offsets


def concat_logprobs(a: CompletionLogprobs | None, b: CompletionLogprobs | None) -> CompletionLogprobs | None:
    if a is None or b is None:
        return a if b is None else b
    return CompletionLogprobs(tokens=a.tokens + b.tokens, token_logprobs=a.token_logprobs + b.token_logprobs,
                              top_logprobs=a.top_logprobs + b.top_logprobs, text_offset=a.text_offset + b.text_offset)


def prompt_logprobs_field(token_ids: list[int], entries: PromptLogprobs, k: int) -> PromptLogprobsField:
    """vLLM's `prompt_logprobs` response field, each entry cut to the prompt token and the top k."""
    out: PromptLogprobsField = []
    for token_id, entry in zip(token_ids, entries):
        if entry is None:
            out.append(None)
            continue
        out.append({str(t): PromptLogprob(logprob=_finite(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token)
                    for t, lp in entry.items() if t == token_id or (lp.rank is not None and lp.rank <= k)})
    return out
