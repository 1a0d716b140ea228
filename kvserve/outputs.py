"""What the engine yields: RequestOutput / CompletionOutput, shaped like vLLM's."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One candidate token at one position: its log-probability (or logit: `--logprobs-mode`) and its rank
    (1 = top)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the sampled token plus the top-k alternatives).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token (vLLM's): None for the first (nothing precedes it), then token id -> Logprob
# (the prompt token first, then the top-k alternatives).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    """"stop", "length", "abort" or "error"; None while still running."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended the request, if any."""
    error: str | None = None
    """With finish_reason "error": what failed (this sequence alone failed; the engine ran on)."""

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_draft_tokens: int = 0
    """Speculative decoding: draft tokens the target scored for this request (all its samples)."""
    num_accepted_tokens: int = 0
    """Of those, how many it accepted (each one a token gained without a step of its own)."""

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    new_token_ids: list[list[int]] = field(default_factory=list)
    """Per output index, the token ids added since the previous RequestOutput of this request (streaming)."""
    new_texts: list[str] = field(default_factory=list)
    """Per output index, the text added since the previous RequestOutput (never splits a character)."""
    prompt_logprobs: PromptLogprobs | None = None
    """With SamplingParams.prompt_logprobs: one entry per prompt token, from the first output on (the
    prompt is computed by then); with RequestOutputKind.DELTA only in that first output. None otherwise."""
    kv_transfer_params: dict | None = None
    """With --kv-transfer-config, once finished: what the KV connector returned for this request (vLLM's field)."""
