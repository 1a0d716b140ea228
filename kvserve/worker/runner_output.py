"""ModelRunnerOutput: what one step of the worker hands back to the scheduler."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.sample.prompt_logprobs import PromptLogprobsChunk
from kvserve.sample.sampler import RowLogprobs


@dataclass(slots=True)
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
