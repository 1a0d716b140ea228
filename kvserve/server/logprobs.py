"""The engine's per-token logprobs (dict token id -> Logprob) in OpenAI's two response formats."""
from __future__ import annotations

from kvserve.outputs import Logprob
from kvserve.server.protocol import ChatTokenLogprob, CompletionLogprobs, TopLogprob

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


def completion_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], k: int,
                        text_offset: int) -> CompletionLogprobs:
    """`text_offset` is where the first of these tokens starts in the choice's text."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        chosen = entry[token_id]
        tokens.append(_text(chosen))
        token_logprobs.append(_finite(chosen.logprob))
        # NOTE: like vLLM, the chosen token is listed with the top k even when it ranks lower.
        top = {_text(lp): _finite(lp.logprob) for lp in _top(entry, k)}
        top.setdefault(_text(chosen), _finite(chosen.logprob))
        top_logprobs.append(top)
        offsets.append(text_offset)
        text_offset += len(_text(chosen))
    return CompletionLogprobs(tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top_logprobs,
                              text_offset=offsets)
