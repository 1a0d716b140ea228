"""SchedulerOutput: the scheduler's decision for one step, as a diff for the worker (vLLM v1's shape).

A request's prompt, sampling parameters and blocks cross once, when it is first scheduled; after that each
step sends only ids, token counts and newly added block ids. The worker keeps everything else in its
persistent input batch. No `Request` object crosses, so the diff is cheap to send to another process.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvserve.lora.request import LoRARequest
from kvserve.sampling_params import SamplingParams


@dataclass(slots=True)
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


@dataclass(slots=True)
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


@dataclass(slots=True)
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

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
