"""What crosses between the front end (tokenizing, detokenizing: the server process or `LLM`) and the
engine core (scheduler + worker: the engine process): requests in, per-step deltas out. Both are small and
picklable: a step's outputs carry only what is new (token ids, their logprobs, a finish), never text or
whole sequences, so the bytes per step do not grow with the length of the outputs.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.lora.request import LoRARequest
from kvserve.sample.prompt_logprobs import PromptLogprobsChunk
from kvserve.sample.sampler import RowLogprobs
from kvserve.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class EngineCoreRequest:
    """One sequence to generate (the front end fans a request with n samples out into n of these)."""

    request_id: str
    prompt_token_ids: list[int]
    """Validated: integers in the vocabulary, shorter than max_model_len."""
    sampling_params: SamplingParams
    """n == 1; a sample's own seed."""
    eos_token_ids: tuple[int, ...]
    max_tokens: int
    """sampling_params.max_tokens resolved against max_model_len."""
    arrival_time: float
    """time.monotonic() when the request arrived (comparable across processes on one machine)."""
    cache_salt: str | None = None
    """Part of the prefix-cache key: only requests with the same salt share KV blocks."""
    cache_pin: tuple[int, float] | None = None
    """(prefix tokens, TTL seconds) to pin in the prefix cache once computed (prompt caching)."""
    wait_for: str | None = None
    """A sibling whose prompt KV this one reuses: not admitted before that prompt is computed."""
    lora_request: LoRARequest | None = None
    """The adapter to run with (checked at admission); None: the base model."""


@dataclass(slots=True)
class EngineCoreOutput:
    """What one step changed for one request."""

    request_id: str
    new_token_ids: list[int]
    """Tokens appended this step (empty for a request that finished without one, e.g. aborted)."""
    new_logprobs: list[RowLogprobs] | None
    """Per new token, when the request asked for logprobs."""
    timestamp: float
    """time.monotonic() at the end of the step that produced this."""
    first_scheduled_time: float | None = None
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache at admission."""
    finish_reason: str | None = None
    """"stop", "length", "abort" or "error"; None while running."""
    stop_reason: int | None = None
    """The stop token id that ended the request (stop strings are the front end's)."""
    error: str | None = None
    """With finish_reason "error": what failed."""
    num_draft_tokens: int = 0
    """Speculative decoding, so far for this request: draft tokens scored, and accepted."""
    num_accepted_tokens: int = 0
    new_prompt_logprobs: PromptLogprobsChunk | None = None
    """prompt_logprobs: what this step's prompt chunk said about its prompt tokens (only the new ones; such an
    output may carry no token: a chunk short of the prompt's end)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
