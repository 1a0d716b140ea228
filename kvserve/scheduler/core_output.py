"""What update() reports for one request: an EngineCoreOutput built from the request's state."""
from __future__ import annotations

from kvserve.core_types import EngineCoreOutput
from kvserve.request import Request


def core_output(req: Request, new_ids: list[int], new_logprobs, now: float,
                new_prompt_logprobs=None) -> EngineCoreOutput:
    """The request's output for this step: new tokens (and their logprobs), its finish and its counters."""
    return EngineCoreOutput(
        request_id=req.request_id, new_token_ids=new_ids, new_logprobs=new_logprobs, timestamp=now,
        first_scheduled_time=req.metrics.first_scheduled_time, num_cached_tokens=req.num_cached_tokens,
        finish_reason=req.status.finish_reason,
        stop_reason=req.stop_reason if isinstance(req.stop_reason, int) else None, error=req.error,
        num_draft_tokens=req.metrics.num_draft_tokens, num_accepted_tokens=req.metrics.num_accepted_tokens,
        new_prompt_logprobs=new_prompt_logprobs,
        kv_transfer_params=req.finished_kv_transfer_params if req.status.finish_reason is not None else None)
