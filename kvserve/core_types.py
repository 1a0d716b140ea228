"""The types that cross a boundary between the engine's parts: one neutral module, so that no part imports
another for them (scheduler and worker never import each other).

- Front end <-> engine core: `EngineCoreRequest` in, `EngineCoreOutput` out. What crosses between the front
  end (tokenizing, detokenizing: the server process or `LLM`) and the engine core (scheduler + worker: the
  engine process): requests in, per-step deltas out. Both are small and picklable: a step's outputs carry
  only what is new (token ids, their logprobs, a finish), never text or whole sequences, so the bytes per
  step do not grow with the length of the outputs.
- Scheduler -> worker: `SchedulerOutput`, the scheduler's decision for one step as a diff (vLLM v1's shape).
  A request's prompt, sampling parameters and blocks cross once, when it is first scheduled
  (`NewRequestData`); after that each step sends only ids, token counts and newly added block ids
  (`CachedRequestData`). The worker keeps everything else in its persistent input batch. No `Request`
  object crosses, so the diff is cheap to send to another process.
- Worker -> scheduler: `ModelRunnerOutput`, what one step of the worker hands back.

Every field is keyword-only: a call site names what it sets.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvserve.lora.request import LoRARequest
from kvserve.sample.prompt_logprobs import PromptLogprobsChunk
from kvserve.sample.sampler import RowLogprobs
from kvserve.sampling_params import SamplingParams


@dataclass(kw_only=True, frozen=True, slots=True)
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


@dataclass(kw_only=True, slots=True)
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
    kv_transfer_params: dict | None = None
    """With a finish: what the KV connector's request_finished returned (e.g. where a peer reads its KV)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(kw_only=True, slots=True)
class NewRequestData:
    """A request scheduled for the first time."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    block_ids: list[int]
    num_computed_tokens: int
    """Tokens whose KV is already in the cache (prefix-cache hits)."""
    lora_request: LoRARequest | None = None
    """The adapter the worker runs this request with (it loads it into a slot when needed)."""


@dataclass(kw_only=True, slots=True)
class CachedRequestData:
    """Requests the worker already knows, one entry per list index."""

    req_ids: list[str] = field(default_factory=list)
    resumed_from_preemption: list[bool] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    """Blocks appended this step; for a resumed request, its whole new table."""
    num_computed_tokens: list[int] = field(default_factory=list)
    num_kept_blocks: dict[str, int] = field(default_factory=dict)
    """Only for requests whose table shrank (rejected drafts gave whole blocks back): the leading blocks of
    the worker's table that stay; new_block_ids are appended after them."""


@dataclass(kw_only=True, slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    """Tokens computed this step per request (the order of this dict is the order of the batch)."""
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    """Draft tokens to verify this step per request: the runner scores 1 + len(drafts) positions for it."""
    num_draft_tokens_to_propose: dict[str, int] = field(default_factory=dict)
    """Per request sampling this step: how many drafts the proposer should make for its next step."""
    finished_req_ids: set[str] = field(default_factory=set)
    """Requests finished or aborted since the previous step: the worker forgets them."""
    preempted_req_ids: set[str] = field(default_factory=set)
    """Requests preempted this step: the worker drops their rows but keeps their state (tokens, seed)."""
    grammar_bitmask: torch.Tensor | None = None  # [rows, ceil(vocab / 32)] int32; bit set = token allowed
    """Structured outputs: the allowed tokens of each constrained request sampling this step, one row per
    scored position (1 + its drafts); None when no such request samples."""
    structured_output_request_ids: dict[str, int] = field(default_factory=dict)
    """Constrained request -> its first row in grammar_bitmask."""
    kv_connector_metadata: object | None = None
    """--kv-transfer-config: what the scheduler-side connector tells the worker-side one this step (which blocks
    to load before the forward pass and to save after it); None: no connector."""

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(kw_only=True, slots=True)
class ModelRunnerOutput:
    req_ids: list[str] = field(default_factory=list)
    """Requests that sampled this step, in batch order."""
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    """Per request in req_ids: the tokens it gets (one; several once drafts are verified)."""
    logprobs: list[list[RowLogprobs] | None] | None = None
    """Per request in req_ids, per token, for the requests that asked; None when none did."""
    errors: dict[str, str] = field(default_factory=dict)
    """Request id -> why sampling failed for that request alone (it gets no token)."""
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    """Draft tokens proposed for each request's next step (as many as the scheduler asked, or fewer)."""
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)
    """Per request that asked for prompt logprobs and computed prompt positions this step: what they say
    (whether or not it sampled); empty in a step with no such request."""
    execute_s: float = 0.0
    """Wall seconds of the worker's step (inputs, forward, sampling, proposing): the draft policy's cost data."""
    kv_connector_output: KVConnectorOutput | None = None
    """--kv-transfer-config: what the worker-side connector reports this step; None: no connector."""


@dataclass(kw_only=True, slots=True)
class KVConnectorOutput:
    """The worker-side KV connector's report for one step (vLLM's shape)."""

    finished_sending: set[str] = field(default_factory=set)
    """Requests whose blocks the connector no longer reads (a delayed free may now happen)."""
    finished_recving: set[str] = field(default_factory=set)
    """Requests whose asynchronous loads completed."""
    invalid_block_ids: set[int] = field(default_factory=set)
    """Blocks whose load failed (missing or corrupt KV): the requests owning them got no token this step."""
