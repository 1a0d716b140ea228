"""Processor: the front end's input side. Prompt -> token ids, a request checked against the engine
(admission, once: past it every token id is trusted), and fanned out into one EngineCoreRequest per sample.
"""
from __future__ import annotations

import time
from collections import OrderedDict

from kvserve.core_types import EngineCoreRequest
from kvserve.engine.core import EngineInfo
from kvserve.engine.lora_checker import AdapterChecker
from kvserve.kv_cache.manager import PrefixExplanation
from kvserve.lora.request import LoRARequest
from kvserve.sampling_params import SamplingParams, StructuredOutputsParams
from kvserve.structured_output.grammar import build_grammar


_MAX_CHECKED_GRAMMARS = 256


def check_token_ids(token_ids, vocab_size: int, what: str) -> None:
    """Raises ValueError naming up to five ids that are not integers in [0, vocab_size).

    NOTE: the one place token ids from outside are checked; past admission every id is trusted."""
    bad = [t for t in token_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{what} token ids must be integers in [0, {vocab_size}), got {bad[:5]}")


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{request_id}#{index}"


def _wrap_int64(value: int) -> int:
    return (value + 2**63) % 2**64 - 2**63


def eos_token_ids(config_eos, tokenizer) -> tuple[int, ...]:
    """config_eos: the model config's eos_token_id (an id, several, or None); the tokenizer's is added."""
    ids = [config_eos] if isinstance(config_eos, int) else list(config_eos or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return tuple(ids)


class Processor:
    def __init__(self, tokenizer, info: EngineInfo, eos_ids: tuple[int, ...],
                 adapters: AdapterChecker | None = None):
        self.tokenizer = tokenizer
        self.info = info
        self.eos_token_ids = eos_ids
        self.adapters = adapters
        """Checks LoRA requests (None: the engine serves no adapters)."""
        self._checked_grammars: OrderedDict[tuple, None] = OrderedDict()
        """Structured-output specs that passed the check, most recent last."""

    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        """Text -> token ids (with the tokenizer's BOS rules); token ids are checked against the vocabulary."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        if not isinstance(prompt, (list, tuple)):
            raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        check_token_ids(prompt, self.info.vocab_size, "prompt")
        return list(prompt)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Checks a request fits this engine; returns its resolved max_tokens. Raises ValueError."""
        info = self.info
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt must not be empty")
        check_token_ids(prompt_token_ids, info.vocab_size, "prompt")
        if n >= info.max_model_len:
            raise ValueError(f"prompt has {n} tokens, but max_model_len is {info.max_model_len} "
                             "(the prompt plus at least one generated token must fit)")
        max_tokens = params.max_tokens if params.max_tokens is not None else info.max_model_len - n
        if n + max_tokens > info.max_model_len:
            raise ValueError(f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} tokens "
                             f"exceeds max_model_len ({info.max_model_len})")
        blocks = -(-(n + max_tokens) // info.block_size)
        if info.max_blocks_per_request is not None:  # windowed: blocks before the window go back while it runs
            blocks = min(blocks, info.max_blocks_per_request)
        if blocks > info.num_kv_blocks:
            raise ValueError(f"prompt ({n} tokens) + max_tokens ({max_tokens}) needs {blocks} KV blocks, but the "
                             f"whole pool has {info.num_kv_blocks} (raise --kv-cache-memory)")
        if params.logprobs is not None and params.logprobs > info.max_logprobs:
            raise ValueError(f"logprobs {params.logprobs} exceeds max_logprobs ({info.max_logprobs})")
        if params.prompt_logprobs is not None and params.prompt_logprobs > info.max_logprobs:
            raise ValueError(f"prompt_logprobs {params.prompt_logprobs} exceeds max_logprobs "
                             f"({info.max_logprobs})")
        check_token_ids(params.logit_bias or {}, info.vocab_size, "logit_bias")
        check_token_ids(params.stop_token_ids, info.vocab_size, "stop_token_ids")
        if params.structured_outputs is not None:
            self.check_structured_outputs(params.structured_outputs)
        return max_tokens

    def check_structured_outputs(self, spec: StructuredOutputsParams) -> None:
        """Raises ValueError naming what is wrong with an invalid or unsupported spec (parsed once per spec)."""
        # NOTE: the server checks on its tokenizer thread, then again on the event loop at admission: only
        # single dict operations here, so the two never trip over each other.
        key = spec.key()
        if self._checked_grammars.pop(key, False) is None:
            self._checked_grammars[key] = None
            return
        build_grammar(spec)
        self._checked_grammars[key] = None
        while len(self._checked_grammars) > _MAX_CHECKED_GRAMMARS:
            self._checked_grammars.pop(next(iter(self._checked_grammars)), None)

    def make_requests(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      arrival_time: float | None = None,
                      cache_pin: tuple[int, float] | None = None,
                      lora_request: LoRARequest | None = None) -> list[EngineCoreRequest]:
        """Validate, then one EngineCoreRequest per sample (the samples share the prompt's KV: later ones
        wait for the first to compute it). Raises ValueError."""
        max_tokens = self.validate(prompt_token_ids, params)
        if lora_request is not None:
            self.check_lora(lora_request)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        first = child_request_id(request_id, 0, params.n)
        children = []
        for i in range(params.n):
            # NOTE: prompt logprobs are the group's: the first sample computes them, the others reuse its KV.
            child_params = params if params.n == 1 else params.clone(
                n=1, seed=None if params.seed is None else _wrap_int64(params.seed + i),
                prompt_logprobs=params.prompt_logprobs if i == 0 else None)
            salt = None
            if params.n > 1 and not self.info.enable_prefix_caching:
                salt = f"n-group:{request_id}"  # share the prompt among the samples only
            children.append(EngineCoreRequest(
                request_id=child_request_id(request_id, i, params.n), prompt_token_ids=list(prompt_token_ids),
                sampling_params=child_params, eos_token_ids=self.eos_token_ids, max_tokens=max_tokens,
                arrival_time=arrival, cache_salt=salt,
                cache_pin=cache_pin if i == 0 else None, wait_for=first if i else None,
                lora_request=lora_request))
        return children

    def check_lora(self, lora_request: LoRARequest) -> None:
        """Raises ValueError if the engine cannot run this adapter."""
        if self.adapters is None:
            raise ValueError("a LoRA adapter was requested, but this engine serves none (enable_lora=True)")
        self.adapters.check(lora_request)

    def explain(self, ex: PrefixExplanation, token_ids: list[int], snippet_tokens: int = 8) -> dict:
        """A prefix explanation with text snippets on each side of where the prompt and the closest cached
        sequence diverge (a date in a system prompt shows up at once)."""
        pos = ex.num_matched_tokens
        block_start = pos - pos % self.info.block_size
        decode = self.tokenizer.decode
        out = {"num_prompt_tokens": ex.num_prompt_tokens, "num_cached_tokens": ex.num_hit_tokens,
               "num_matched_tokens": pos,
               # None: the prompt is wholly cached, or the cached sequence simply ends at num_matched_tokens
               "diverges_at": pos if pos < len(token_ids) and ex.cached_continuation is not None else None,
               "common_text": decode(token_ids[max(0, pos - snippet_tokens):pos]),
               "prompt_text_after": decode(token_ids[pos:pos + snippet_tokens]), "cached_text_after": None}
        if ex.cached_continuation is not None:
            cached_after = ex.cached_continuation[pos - block_start:]
            out["cached_text_after"] = decode(cached_after[:snippet_tokens])
        return out

    def check_explain_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt must not be empty")
        check_token_ids(token_ids, self.info.vocab_size, "prompt")
        if len(token_ids) > self.info.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens, more than max_model_len "
                             f"({self.info.max_model_len})")
