"""Request: the scheduler's per-request state (owned and mutated by the scheduler only)."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvserve.lora.request import LoRARequest
from kvserve.outputs import RequestMetrics
from kvserve.sampling_params import SamplingParams
from kvserve.structured_output.manager import StructuredOutputRequest


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    """Admitted with its blocks, which a KV connector fills asynchronously (a remote prefill's KV); it resumes
    once the connector reports them loaded."""
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"
    """Failed on its own (its sampling, detokenization or stop strings raised); the others ran on."""

    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)

    @property
    def finish_reason(self) -> str | None:
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                RequestStatus.FINISHED_ABORTED: "abort", RequestStatus.FINISHED_ERROR: "error"}.get(self)


@dataclass(eq=False)  # identity semantics: two requests are never "equal" by their fields
class Request:
    """One sequence being generated.

    NOTE: a request's tokens are prompt_token_ids + output_token_ids; num_computed_tokens of them have
    their KV in the cache. The scheduler schedules `num_tokens - num_computed_tokens` more (chunked), so
    prefill, decode and recompute after preemption are the same code path.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    max_tokens: int = 16
    """sampling_params.max_tokens resolved against max_model_len."""
    cache_salt: str | None = None
    """Part of the prefix-cache key: only requests with the same salt share KV blocks."""
    cache_pin: tuple[int, float] | None = None
    """(prefix tokens, TTL seconds): pin the KV of this many leading tokens once computed (prompt caching)."""
    lora_request: LoRARequest | None = None
    """The adapter it runs with; None: the base model. Part of the prefix-cache key."""
    num_pinned_tokens: int | None = None
    """Set once the pin was applied: tokens actually pinned (full blocks, within the pin bound)."""
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)
    """Draft tokens to verify in the next step (speculative decoding); not tokens of the request yet."""
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache at first admission."""
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    error: str | None = None
    """Why the request failed (status FINISHED_ERROR)."""
    finished_kv_transfer_params: dict | None = None
    """What the KV connector's request_finished returned, for the response (network connectors' seam)."""
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))
    structured_output: StructuredOutputRequest | None = None
    """Its grammar (compile, then matcher) when it asked for structured outputs."""

    @property
    def lora_int_id(self) -> int:
        """The adapter's id, 0 for the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def kv_transfer_params(self) -> dict | None:
        """What the request tells the KV connector (vLLM's sampling_params.extra_args["kv_transfer_params"])."""
        extra = self.sampling_params.extra_args
        return extra.get("kv_transfer_params") if extra else None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return self.num_tokens + len(self.spec_token_ids)

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """vLLM v1's rule: a request that still needs its prompt logprobs computes its whole prompt, since a
        cache hit would skip the positions that yield them. NOTE: prompt logprobs are recomputed, not kept
        with cached blocks; the request's blocks still enter the cache for others. Once it has an output
        token, all of them were computed, so a recompute after preemption may read the cache again."""
        return self.sampling_params.prompt_logprobs is not None and not self.output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, index: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]

    def token_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished()
